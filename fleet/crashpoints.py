"""Named crash points and hold points: places where a process can be made to die by SIGKILL, or to
stop for a while, so that tests prove recovery from a crash at exactly that place (before an intent is
durable, after a tool accepted a call, ...) or act while a process is held there (cancel a skill
before its first tool call). A crash or a cancel at a random moment cannot hit such a window reliably.

They are off unless ``FLEET_CRASH_POINTS`` (or ``FLEET_HOLD_POINTS``) is set, to a comma-separated list
of ``point@marker``, where ``point`` is a name or ``name:qualifier`` (e.g. the skill of the step, to
act at one step only). A point fires once: the first process to reach it creates ``marker``
(atomically, with its pid) and kills itself, or holds there for ``FLEET_HOLD_S`` seconds (default 10);
later arrivals, in any process, see the marker and go on. A restarted or second worker thus runs
through.
"""

from __future__ import annotations

import asyncio
import os
import signal

ENV = "FLEET_CRASH_POINTS"
HOLD_ENV = "FLEET_HOLD_POINTS"
HOLD_S_ENV = "FLEET_HOLD_S"


def crash_point(name: str, qualifier: str = "") -> None:
    if _first_arrival(os.environ.get(ENV), name, qualifier):
        os.kill(os.getpid(), signal.SIGKILL)


async def hold_point(name: str, qualifier: str = "") -> None:
    """Wait here (cancellable) the first time a listed point is reached."""
    if _first_arrival(os.environ.get(HOLD_ENV), name, qualifier):
        await asyncio.sleep(float(os.environ.get(HOLD_S_ENV, "10")))


def _first_arrival(spec: str | None, name: str, qualifier: str) -> bool:
    """Whether ``spec`` lists this point and this process is the first to reach it (it then made the
    marker)."""
    if not spec:
        return False
    for item in spec.split(","):
        point, _, marker = item.strip().partition("@")
        if point not in (name, f"{name}:{qualifier}") or not marker:
            continue
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        os.close(fd)
        return True
    return False
