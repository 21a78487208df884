"""Test support: the peak resident memory a process reaches while a test attacks it."""

from __future__ import annotations

import os
import threading
from pathlib import Path


class PeakGrowth:
    """The peak resident memory of process ``pid`` (this one by default) above what it was on entry,
    sampled every 5 ms until exit (Linux: ``/proc/<pid>/statm``)."""

    def __init__(self, pid: int | None = None) -> None:
        self._statm = Path(f"/proc/{pid or os.getpid()}/statm")
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._done = threading.Event()
        self._baseline = self._peak = 0
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self._peak = max(self._peak, self._rss())

    def _rss(self) -> int:
        return int(self._statm.read_text().split()[1]) * self._page

    def __enter__(self) -> PeakGrowth:
        self._baseline = self._peak = self._rss()
        self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._sampler.join(timeout=10)

    @property
    def mib(self) -> int:
        """The growth so far, in MiB."""
        return (self._peak - self._baseline) >> 20
