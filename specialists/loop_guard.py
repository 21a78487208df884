"""Where an agent loop stops: the limits of a :class:`~specialists.skill.TaskBudget` applied turn by
turn, and the repeats that mean a loop is not converging.

:class:`LoopGuard` sees each of the model's replies before any tool call it asks for is made, and
says :class:`Stop` when the loop must not go on as it is:

- not converging (``stuck``): the same call (tool and arguments) for the ``repeat_limit``-th time
  in the task (``repeated_call``), the same text from the model for the ``output_repeat_limit``-th
  time (``repeated_output``), or more calls in one turn than ``max_tool_calls_per_turn``
  (``calls_per_turn``);
- a budget spent: the turns (``max_turns``), the tool calls (``tool_calls``), the tokens
  (``tokens``), the money (``cost``), or the context (``context_limit``: the model's answer was cut
  at its token limit).

What happens then is the caller's policy's (:class:`~specialists.skill.LoopPolicy`): the agent loop
stops, summarizes, asks a person, or (when it is stuck) asks the reviewer (:mod:`specialists.review`). The calls of the reply that tripped a limit are never made.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from fleet.errors import ErrorCode
from fleet.llm import ChatReply
from specialists.progress import call_key
from specialists.skill import TaskBudget

STUCK_REASONS = frozenset({"repeated_call", "repeated_output", "calls_per_turn"})
SPENT_REASONS = frozenset({"max_turns", "tool_calls", "tokens", "cost", "context_limit"})


@dataclass(frozen=True, slots=True)
class Stop:
    """Why the loop must not go on as it is: a ``reason`` (one of :data:`STUCK_REASONS` or
    :data:`SPENT_REASONS`) and the words for it."""

    reason: str
    why: str

    @property
    def stuck(self) -> bool:
        """Whether the loop is not converging (rather than out of budget)."""
        return self.reason in STUCK_REASONS

    @property
    def code(self) -> ErrorCode:
        """The code a task stopped for this reason fails with."""
        return ErrorCode.NON_CONVERGING if self.stuck else ErrorCode.BUDGET_EXHAUSTED


class LoopGuard:
    """The turn-by-turn limits of one task's loop (``max_turns``: the agent's own cap on turns,
    lowered by the task's budget)."""

    def __init__(self, budget: TaskBudget, max_turns: int) -> None:
        self._budget = budget
        self.max_turns = min(max_turns, budget.max_turns) if budget.max_turns else max_turns
        self.turns = 0
        self.calls: Counter[str] = Counter()  # each call made, by call_key
        self._outputs: Counter[str] = Counter()
        self.said: list[str] = []  # a digest of each text the model said, in order (for the reviewer)

    def resume(self, turns: int, calls: Iterable[str]) -> None:
        """Go on counting from where a task's notes left it: ``turns`` taken, ``calls`` made (keys)."""
        self.turns = turns
        self.calls.update(calls)

    def reset(self) -> None:
        """A new allowance (a person let a stopped loop go on): turns and repeats count from zero."""
        self.turns = 0
        self.calls.clear()
        self._outputs.clear()

    def forgive(self, reply: ChatReply) -> None:
        """The reviewer found the loop's repeats were progress: repeats count from zero, with the
        calls of ``reply`` (the one that tripped the limit, now made) as the first; the turns taken
        still count."""
        self.calls.clear()
        self._outputs.clear()
        self.calls.update(call_key(call.name, call.arguments) for call in reply.tool_calls)

    def before_turn(self) -> Stop | None:
        """A stop if the loop may not ask the model again."""
        if self.turns >= self.max_turns:
            return Stop("max_turns", f"the model took its {self.max_turns} turns without a final answer")
        return None

    def after_reply(self, reply: ChatReply) -> Stop | None:
        """Count ``reply`` (one that asks for tool calls); a stop if its calls must not be made."""
        self.turns += 1
        budget = self._budget
        text = reply.content.strip()
        if text:
            digest = hashlib.sha256(text.encode()).hexdigest()
            self._outputs[digest] += 1
            self.said.append(digest)
            limit = budget.output_repeat_limit
            if limit is not None and self._outputs[digest] >= limit:
                return Stop("repeated_output", f"the model said the same thing {limit} times")
        per_turn = budget.max_tool_calls_per_turn
        if per_turn is not None and len(reply.tool_calls) > per_turn:
            return Stop(
                "calls_per_turn",
                f"the model asked for {len(reply.tool_calls)} tool calls in one turn (at most {per_turn})",
            )
        asked = Counter(call_key(call.name, call.arguments) for call in reply.tool_calls)
        limit = budget.repeat_limit
        for key, times in asked.items():
            if limit is not None and self.calls[key] + times >= limit:
                name = key.split(":", 1)[0]
                return Stop("repeated_call", f"the model called {name} with the same arguments {limit} times")
        self.calls.update(asked)
        return None
