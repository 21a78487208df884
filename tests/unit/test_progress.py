"""The batch progress bar: drawn in place on a terminal, never on a pipe or with --json."""

from __future__ import annotations

import io

from fleet.progress import CLEAR_LINE, ProgressBar, render


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_items_done_of_total_and_a_percentage() -> None:
    text = render("reconcile", 50, 200, 12.5)
    assert text.startswith("reconcile [" + "#" * 7 + "-" * 23 + "]")
    assert text.endswith(" 50/200 25%  12.5 items/s")
    assert "[" + "#" * 30 + "]" in render("s", 3, 3, 0.0)


def test_on_a_terminal_each_update_redraws_the_same_line() -> None:
    out = Terminal()
    bar = ProgressBar.for_stream(out, as_json=False)
    bar.update("batch", 50, 100)
    bar.update("batch", 100, 100)
    bar.finish()
    drawn = out.getvalue()
    assert drawn.count(CLEAR_LINE) == 2
    assert "\n" not in drawn[:-1] and drawn.endswith("100/100 100%  " + drawn.split("100%  ")[-1])
    assert drawn.endswith("items/s\n")


def test_nothing_is_drawn_on_a_pipe_or_with_json() -> None:
    for out, as_json in ((io.StringIO(), False), (Terminal(), True)):
        bar = ProgressBar.for_stream(out, as_json=as_json)
        bar.update("batch", 1, 2)
        bar.clear()
        bar.finish()
        assert not bar.enabled
        assert out.getvalue() == ""
