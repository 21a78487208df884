"""``fleet logs [SERVICE] [--follow]``: a local stack's service logs, from its data dir
(``.fleet/logs/SERVICE.log``; the supervisor writes each child's output there)."""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import BinaryIO

from fleet.errors import ErrorCode, FleetError
from fleetctl.cli_common import EXIT_OK
from fleetctl.layout import StackLayout

POLL_S = 0.25


def logs(layout: StackLayout, service: str | None, *, lines: int, follow: bool, list_only: bool) -> int:
    """Print the last ``lines`` lines of ``service``'s log, and with ``follow`` what it writes after
    (until Ctrl-C); ``list_only`` (or no service): the services that have a log."""
    known = sorted(path.stem for path in layout.logs_dir.glob("*.log")) if layout.logs_dir.is_dir() else []
    if list_only or service is None:
        for name in known:
            print(name)
        return EXIT_OK
    path = layout.log_file(service)
    if service not in known:
        raise FleetError(
            ErrorCode.NOT_FOUND,
            f"no log of {service} in {layout.logs_dir}"
            + (f"; there are: {', '.join(known)}" if known else " (has the stack been started there?)"),
        )
    if lines < 0:
        raise FleetError(ErrorCode.INVALID_REQUEST, "--lines is a number of lines, 0 or more")
    with path.open("rb") as log:
        for line in deque(log, maxlen=lines) if lines else ():
            sys.stdout.buffer.write(line)
        sys.stdout.flush()
        if follow:
            _follow(path, log)
    return EXIT_OK


def _follow(path: Path, log: BinaryIO) -> None:
    """Print what is appended to ``path`` from the open file's position, reopening it when it is
    replaced or cut shorter (a new stack on the same data dir)."""
    handle = log
    inode = os.fstat(handle.fileno()).st_ino
    while True:
        chunk = handle.read()
        if chunk:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            continue
        time.sleep(POLL_S)
        try:
            status = os.stat(path)
        except FileNotFoundError:
            continue
        if status.st_ino != inode or status.st_size < handle.tell():
            handle.close()
            handle = path.open("rb")
            inode = os.fstat(handle.fileno()).st_ino


__all__ = ["logs"]
