"""A one-line progress bar for batch runs, drawn in place with ANSI (no dependency).

It draws only on a terminal: on a pipe, or with ``--json``, :meth:`ProgressBar.disabled` draws
nothing, so what a script reads is never interleaved with carriage returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TextIO

WIDTH = 30
CLEAR_LINE = "\r\x1b[K"


def render(step: str, done: int, total: int, rate: float) -> str:
    """``step [#####-----] done/total  N items/s``: the text of the bar, without control codes."""
    filled = WIDTH * done // total if total else WIDTH
    bar = "#" * filled + "-" * (WIDTH - filled)
    percent = 100 * done // total if total else 100
    return f"{step} [{bar}] {done}/{total} {percent}%  {rate:.1f} items/s"


@dataclass(slots=True)
class ProgressBar:
    """The bar of one stream of events; :meth:`update` on each ``batch.progress`` event, and
    :meth:`clear` before printing a line of anything else (it is drawn again on the next update)."""

    stream: TextIO | None
    started: float = field(default_factory=time.monotonic)
    first_done: int | None = None
    shown: bool = False

    @classmethod
    def for_stream(cls, stream: TextIO, *, as_json: bool) -> ProgressBar:
        """A bar on ``stream`` if it is a terminal and the output is not JSON; else a silent one."""
        return cls(stream if stream.isatty() and not as_json else None)

    @property
    def enabled(self) -> bool:
        return self.stream is not None

    def update(self, step: str, done: int, total: int) -> None:
        if self.stream is None:
            return
        if self.first_done is None:
            # The rate counts from the first update seen: a bar attached to a run half-way through
            # must not credit this session with the items done before it.
            self.first_done, self.started = done, time.monotonic()
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = (done - self.first_done) / elapsed
        self.stream.write(CLEAR_LINE + render(step, done, total, rate))
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.stream is not None and self.shown:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self.shown = False

    def finish(self) -> None:
        """Leave the last bar on its own line."""
        if self.stream is not None and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
