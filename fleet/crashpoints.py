"""Named crash points: places where a process can be made to die by SIGKILL, so that tests prove
recovery from a crash at exactly that place (before an intent is durable, after a tool accepted a call,
...). A crash at a random moment cannot hit such a window reliably.

They are off unless ``FLEET_CRASH_POINTS`` is set, to a comma-separated list of ``point@marker``, where
``point`` is a name or ``name:qualifier`` (e.g. the skill of the step, to crash at one step only). A
point fires once: the first process to reach it creates ``marker`` (atomically) and kills itself; later
arrivals, in any process, see the marker and go on. A restarted or second worker thus runs through.
"""

from __future__ import annotations

import os
import signal

ENV = "FLEET_CRASH_POINTS"


def crash_point(name: str, qualifier: str = "") -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(","):
        point, _, marker = item.strip().partition("@")
        if point not in (name, f"{name}:{qualifier}") or not marker:
            continue
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.fsync(fd)
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
