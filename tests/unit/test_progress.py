"""The batch progress bar: drawn in place on a terminal, never on a pipe or with --json."""

from __future__ import annotations

import io

import pytest

from fleetctl import progress
from fleetctl.progress import CLEAR_LINE, ProgressBar, render


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_items_done_of_total_and_a_percentage() -> None:
    text = render("reconcile", 50, 200, 12.5)
    assert text.startswith("reconcile [" + "#" * 7 + "-" * 23 + "]")
    assert text.endswith(" 50/200 25%  12.5 items/s")
    assert "[" + "#" * 30 + "]" in render("s", 3, 3, 0.0)


class Clock:
    """``time.monotonic`` for the bar: it stands still until the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_on_a_terminal_each_update_redraws_the_same_line(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(progress, "time", clock)
    out = Terminal()
    bar = ProgressBar.for_stream(out, as_json=False)
    bar.update("batch", 50, 100)
    clock.now += 2.0
    bar.update("batch", 100, 100)  # 50 more items in 2 s
    bar.finish()
    first = "batch [" + "#" * 15 + "-" * 15 + "] 50/100 50%  0.0 items/s"
    last = "batch [" + "#" * 30 + "] 100/100 100%  25.0 items/s"
    assert out.getvalue() == CLEAR_LINE + first + CLEAR_LINE + last + "\n"


def test_nothing_is_drawn_on_a_pipe_or_with_json() -> None:
    for out, as_json in ((io.StringIO(), False), (Terminal(), True)):
        bar = ProgressBar.for_stream(out, as_json=as_json)
        bar.update("batch", 1, 2)
        bar.clear()
        bar.finish()
        assert not bar.enabled
        assert out.getvalue() == ""
