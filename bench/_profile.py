"""Where a service's CPU goes: py-spy attached to running processes (no change to them), sampling
their event loop's thread on CPU, summarised as the share of samples in each function (with what it
calls: inclusive) and in each function alone (self).

Samples in an idle wait (the selector's ``select``, a thread pool's idle workers) are left out: what
remains is the time the process spent computing or in system calls.
"""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RATE_HZ = 200
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*?):\d+\)$")
# frames every stack of a service has: the interpreter, the CLI and the event loop's machinery
_OURS = re.compile(r"\((coordinator|specialists|mcp_servers|registry|memory|fleet|policy)/")
_PLUMBING = (
    "<frozen runpy>",
    "fleetctl/cli.py",
    "fleetctl/__main__.py",
    "asyncio/runners.py",
    "asyncio/base_events.py",
    "asyncio/events.py",
)


def _py_spy() -> str | None:
    """py-spy beside this interpreter (a virtual environment's bin/), or on the PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def available() -> bool:
    return _py_spy() is not None


def record(pids: Mapping[str, int], seconds: float, into: Path) -> dict[str, subprocess.Popen[bytes]]:
    """Start sampling each process for ``seconds``, in raw (collapsed stacks) form, into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    return {
        name: subprocess.Popen(
            [
                str(_py_spy()),
                "record",
                "--rate",
                str(RATE_HZ),
                "--format",
                "raw",
                "--duration",
                str(int(seconds)),
                "--output",
                str(into / f"{name}.txt"),
                "--pid",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    }


def _name(frame: str) -> str:
    match = _FRAME.match(frame)
    if match is None:
        return frame
    file = match["file"].split("site-packages/")[-1]
    file = re.sub(
        r"^.*?/(?=(coordinator|specialists|mcp_servers|registry|memory|fleet|fleetctl|policy)/)", "", file
    )
    return f"{match['function']} ({file})"


def summarise(path: Path, top: int = 12) -> dict[str, Any]:
    """The event loop's on-CPU samples of one recording: their number, and the functions with the
    largest inclusive and self shares (percent)."""
    inclusive: collections.Counter[str] = collections.Counter()
    alone: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "run_forever" not in stack:  # another thread: a pool's, mostly idle
            continue
        frames = stack.split(";")
        if "select (selectors.py" in frames[-1] or "EpollSelector.select" in frames[-1]:
            continue  # waiting for I/O
        samples = int(count)
        total += samples
        for name in {_name(f) for f in frames if not any(p in f for p in _PLUMBING)}:
            inclusive[name] += samples
        alone[_name(frames[-1])] += samples

    def shares(counter: collections.Counter[str], keep: Any = lambda name: True) -> list[tuple[str, float]]:
        kept = [(name, n) for name, n in counter.most_common() if keep(name)][:top]
        return [(name, round(100 * n / total, 1)) for name, n in kept] if total else []

    return {
        "samples": total,
        # the platform's own functions, with what they call: where its code spends the time
        "inclusive": shares(inclusive, lambda name: _OURS.search(name) is not None),
        "self": shares(alone),
    }
