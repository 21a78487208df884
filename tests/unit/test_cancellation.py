"""Cooperative cancellation of a running skill: a tool call in flight is never cut, and none starts
after a cancel. Real asyncio tasks; the "tool call" is a step the test controls."""

from __future__ import annotations

import asyncio

import pytest

from specialists.cancellation import ToolCalls


class Tool:
    """A tool call whose answer the test releases, as a slow downstream system would give it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.effects = 0

    async def call(self, calls: ToolCalls) -> None:
        calls.start()
        answered = False
        try:
            self.entered.set()
            await self.release.wait()
            self.effects += 1
            answered = True
        finally:
            calls.end(answered=answered)


class Thinking:
    """Work the skill does before its first tool call, until the test lets it go on."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.done = asyncio.Event()

    async def __call__(self) -> None:
        self.started.set()
        await self.done.wait()


async def skill(calls: ToolCalls, tool: Tool, thinking: Thinking, n: int) -> None:
    await thinking()
    for _ in range(n):
        await tool.call(calls)


async def test_a_cancel_between_tool_calls_stops_the_skill_at_once() -> None:
    calls, tool, thinking = ToolCalls(), Tool(), Thinking()
    task = asyncio.create_task(skill(calls, tool, thinking, 2))
    calls.attach(task)
    await asyncio.wait_for(thinking.started.wait(), 5)  # at work, no tool call in flight
    calls.cancel()
    thinking.done.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert (calls.started, calls.completed, tool.effects) == (0, 0, 0)
    assert calls.canceled_error() == {
        "code": "canceled",
        "message": "canceled after 0 tool calls completed",
        "tool_calls": 0,
    }


async def test_a_cancel_during_a_tool_call_lets_it_finish_and_starts_no_other() -> None:
    calls, tool, thinking = ToolCalls(), Tool(), Thinking()
    thinking.done.set()
    task = asyncio.create_task(skill(calls, tool, thinking, 3))
    calls.attach(task)
    await asyncio.wait_for(tool.entered.wait(), 5)
    calls.cancel()
    finished, _ = await asyncio.wait({task}, timeout=0.2)
    assert not finished  # the call in flight is not cut
    tool.release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert (calls.started, calls.completed, calls.all_answered, tool.effects) == (1, 1, True, 1)
    assert calls.canceled_error()["tool_calls"] == 1


async def test_a_tool_call_that_ends_without_an_answer_is_not_counted_as_completed() -> None:
    calls = ToolCalls()
    calls.start()
    calls.end(answered=False)  # timed out, or failed in transit: its effect is unknown
    assert (calls.in_flight, calls.completed, calls.all_answered) == (0, 0, False)
