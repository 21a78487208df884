"""Cooperative cancellation of a running skill.

A tool call in flight is never cut: cut in the middle, its effect could have been made or not, and
nobody could say which. So a cancel stops the skill's task at once when no tool call is in flight, and
otherwise as soon as the calls in flight have returned; no tool call starts after a cancel. What the
skill did is then known: the tool calls it completed (each answered by its tool), and none other.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.errors import ErrorCode


class ToolCalls:
    """The tool calls of one running skill, and whether it was asked to stop. The kit's
    ``Toolbox.call`` reports each call here; the executor attaches the skill's task."""

    def __init__(self) -> None:
        self.started = 0
        self.ended = 0
        self.completed = 0  # answered by the tool: its effect, if any, is made and known to the tool
        self.cancel_requested = False
        self._task: asyncio.Task[Any] | None = None

    @property
    def in_flight(self) -> int:
        return self.started - self.ended

    @property
    def all_answered(self) -> bool:
        """Every call that started got its tool's answer (none timed out, failed in transit or was cut)."""
        return self.completed == self.started

    def attach(self, task: asyncio.Task[Any]) -> None:
        self._task = task
        self._stop_if_idle()

    def cancel(self) -> None:
        """Ask the skill to stop: at once if no tool call is in flight, else when they have returned."""
        self.cancel_requested = True
        self._stop_if_idle()

    def start(self) -> None:
        """A tool call starts now; refused (the skill's task is being canceled) after a cancel."""
        if self.cancel_requested:
            raise asyncio.CancelledError("the operation was canceled: no tool call starts after that")
        self.started += 1

    def end(self, *, answered: bool) -> None:
        self.ended += 1
        if answered:
            self.completed += 1
        self._stop_if_idle()

    def canceled_error(self) -> dict[str, Any]:
        """The error an operation canceled between tool calls ends with."""
        return {
            "code": str(ErrorCode.CANCELED),
            "message": f"canceled after {self.completed} tool calls completed",
            "tool_calls": self.completed,
        }

    def _stop_if_idle(self) -> None:
        if self.cancel_requested and self.in_flight == 0 and self._task is not None:
            self._task.cancel()
