"""The lock that marks a data dir as in use by a running supervisor.

It is a POSIX record lock, so anyone can ask who holds it (``F_GETLK`` returns the holder's pid)
without taking it, and the kernel releases it when the supervisor dies, however it dies.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

# struct flock on Linux (x86_64 and aarch64): l_type, l_whence, l_start, l_len, l_pid, padding.
_FLOCK = "hhqqi4x"


def acquire(path: Path) -> int:
    """Take the lock (never waits); return its file descriptor. ``BlockingIOError`` if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise BlockingIOError(f"{path} is locked") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(fd: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN)
    os.close(fd)


def holder(path: Path) -> int | None:
    """The pid of the process holding the lock, or None if nobody does."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    finally:
        os.close(fd)
    lock_type, _, _, _, pid = struct.unpack(_FLOCK, answer)
    return None if lock_type == fcntl.F_UNLCK else int(pid)
