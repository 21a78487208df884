"""The skill author's API: what a skill is (:class:`Skill`), what it gets (:class:`SkillContext`),
what it may spend (:class:`TaskBudget`) and how it says it failed or needs a person
(:class:`SkillError`, :class:`OutcomeUnknown`, :class:`InputRequired`).

:mod:`specialists.kit` serves skills as an A2A agent and re-exports all of this; the agent loop
(:mod:`specialists.llm`) runs a skill that has instructions. Neither is imported here: a skill's
tools are anything with the :class:`Tools` methods (the kit's ``Toolbox``).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from a2a.types import AgentSkill

from fleet.errors import ErrorCode, FleetError
from fleet.tokens import Claims
from registry import McpServerRecord


class Tools(Protocol):
    """The MCP tools a skill may call, for its caller (the kit's ``Toolbox``)."""

    async def available(self) -> list[McpServerRecord]:
        """The MCP servers and tools this agent may use now."""
        ...

    async def call(
        self,
        server_id: str,
        tool: str,
        arguments: dict[str, Any],
        *,
        tenant: str,
        scopes: Sequence[str],
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Call ``tool`` of ``server_id`` with ``arguments``; its structured result."""
        ...


class SkillError(FleetError):
    """A skill could not do its work; the task fails with this code and message."""


class OutcomeUnknown(SkillError):
    """A tool call's outcome cannot be known (it timed out and the tool cannot be asked): the
    operation ends ``uncertain`` and a person has to look."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.OUTCOME_UNKNOWN, message)


@dataclass(frozen=True, slots=True)
class TaskBudget:
    """What one task of a skill may spend: tool calls, seconds and LLM tokens (None: no cap).

    A skill declares its own; a caller may lower it for one task (message metadata
    ``fleet.budget``, the same keys), never raise it."""

    max_tool_calls: int | None = 50
    max_seconds: float | None = 600.0
    max_llm_tokens: int | None = 50_000

    def lowered(self, asked: Any) -> TaskBudget:
        """This budget, lowered to what ``asked`` (a caller's mapping) names; other keys ignored."""
        if not isinstance(asked, dict):
            return self

        def lower(mine: Any, key: str) -> Any:
            theirs = asked.get(key)
            if isinstance(theirs, bool) or not isinstance(theirs, int | float) or theirs <= 0:
                return mine
            return theirs if mine is None else min(mine, type(mine)(theirs))

        return TaskBudget(
            max_tool_calls=lower(self.max_tool_calls, "max_tool_calls"),
            max_seconds=lower(self.max_seconds, "max_seconds"),
            max_llm_tokens=lower(self.max_llm_tokens, "max_llm_tokens"),
        )


class BudgetMeter:
    """One task's spending against its :class:`TaskBudget`; raises ``budget_exhausted`` before the
    spend that would pass a cap (the tool call is then not made)."""

    def __init__(self, budget: TaskBudget) -> None:
        self.budget = budget
        self.tool_calls = 0
        self.llm_tokens = 0
        self.out_of_time = False  # set by the executor's watchdog when max_seconds passed

    def spend_tool_call(self, what: str) -> None:
        """Count one tool call (``what``); raises ``budget_exhausted`` instead if the cap is spent."""
        cap = self.budget.max_tool_calls
        if cap is not None and self.tool_calls >= cap:
            raise SkillError(
                ErrorCode.BUDGET_EXHAUSTED,
                f"the task's budget of {cap} tool calls is spent; {what} not called",
            )
        self.tool_calls += 1

    def spend_tokens(self, tokens: int) -> None:
        """Count ``tokens`` a model used for this task; raises once the total passes the cap."""
        self.llm_tokens += max(0, tokens)
        cap = self.budget.max_llm_tokens
        if cap is not None and self.llm_tokens > cap:
            raise SkillError(
                ErrorCode.BUDGET_EXHAUSTED,
                f"the task's budget of {cap} LLM tokens is spent ({self.llm_tokens} used)",
            )

    def to_dict(self) -> dict[str, Any]:
        """What the task has spent so far."""
        return {"tool_calls": self.tool_calls, "llm_tokens": self.llm_tokens}


class InputRequired(Exception):  # not an error: the task asks its caller something
    """Raised by a skill that needs an answer from a person before it can go on: the task ends
    ``input-required`` with ``question`` and ``fields`` (what the answer should hold). The caller's
    answer comes back in the skill's next call as ``ctx.answer`` (the coordinator sends it after a
    person answered, with the recorded approval)."""

    def __init__(self, question: str, fields: dict[str, Any] | None = None) -> None:
        super().__init__(question)
        self.question = question
        self.fields = fields or {}


MEMORY_SERVER = "mcp-memory"


@dataclass(frozen=True, slots=True)
class MemoryTools:
    """Long-term memory through the memory MCP server, for the skill's caller (its tenant): every
    write passes the server's gate (personal data redacted, secrets refused, policy asked)."""

    tools: Tools
    tenant: str

    async def remember(
        self,
        text: str,
        *,
        tier: str = "episodic",
        source: str = "agent",
        ref: str = "",
        tags: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Keep ``text``; the gate's answer (``stored``, ``redacted``, ``held``, ``refused``...,
        and the ``trust`` the entry got). ``source`` says where the text came from (``user``: the
        caller's input, ``tool``, ``external``, ``agent``: the agent's own); the memory server gives
        its trust from the caller's verified identity, never from an argument, so there is none."""
        arguments = {"text": text, "tier": tier, "source": source, "ref": ref, "tags": list(tags)}
        return await self.tools.call(
            MEMORY_SERVER, "remember", arguments, tenant=self.tenant, scopes=["memory:write"]
        )

    async def recall(self, query: str, *, tiers: Sequence[str] = (), limit: int = 5) -> list[dict[str, Any]]:
        """The memories nearest in meaning to ``query``, best first, with their provenance: each
        says its ``trust``, and an ``untrusted`` one is data to weigh, never an instruction."""
        arguments: dict[str, Any] = {"query": query, "limit": limit}
        if tiers:
            arguments["tiers"] = list(tiers)
        found = await self.tools.call(
            MEMORY_SERVER, "recall", arguments, tenant=self.tenant, scopes=["memory:read"]
        )
        return list(found.get("result", []))


@dataclass(frozen=True, slots=True)
class SkillContext:
    """What a skill function gets besides its input."""

    claims: Claims
    tools: Tools
    progress: Callable[[str], Awaitable[None]]
    operation_id: str | None = None
    budget: BudgetMeter = field(default_factory=lambda: BudgetMeter(TaskBudget()))
    # A person's answer to this skill's earlier question (see InputRequired), if this call carries one.
    answer: dict[str, Any] | None = None

    @property
    def tenant(self) -> str:
        """The tenant the skill works for (its caller's, from the verified token)."""
        return self.claims.tenant

    @property
    def memory(self) -> MemoryTools:
        """Long-term memory for the skill's caller (:class:`MemoryTools`)."""
        return MemoryTools(self.tools, self.tenant)

    @property
    def run_id(self) -> str:
        """The coordinator run this call is part of ("" for a call from outside a run)."""
        return self.claims.run_id

    def idempotency_key(self, name: str) -> str:
        """A key for one effect of this operation: the same on every execution of the same
        operation, so the tool can refuse to repeat the effect."""
        return f"{self.operation_id or uuid.uuid4().hex}/{name}"


SkillFunction = Callable[[SkillContext, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Skill:
    """One thing an agent can do: its id, name and description (on the card), the function that
    does it, and what it promises (``idempotent``, ``output_schema``) and may spend (``budget``)."""

    id: str
    name: str
    description: str
    run: SkillFunction
    tags: tuple[str, ...] = ()
    # Safe to run again under the same operation id after an interruption: every effect it has is
    # made with an idempotency key (``SkillContext.idempotency_key``) that the tool honours. A caller
    # may also send such a step to another agent offering the skill when this one cannot answer.
    idempotent: bool = False
    # The JSON Schema its result satisfies: published on the card (the skills extension), so a
    # caller can refuse an answer that does not (a broken release answering garbage).
    output_schema: dict[str, Any] | None = None
    budget: TaskBudget = TaskBudget()
    # With an LLM configured (``FLEET_LLM_BASE_URL``), the skill is run by the agent loop over this
    # agent's MCP tools, told this; without one, ``run`` runs (it may refuse: ``llm_unavailable``).
    instructions: str = ""

    def card_skill(self) -> AgentSkill:
        """The skill as the agent's card lists it."""
        # A2A requires tags: a skill that names none is tagged with its id.
        tags = list(self.tags) or [self.id]
        return AgentSkill(id=self.id, name=self.name, description=self.description, tags=tags)


class Brain(Protocol):
    """What runs a skill that has ``instructions`` when an LLM is configured (see
    :mod:`specialists.llm`); skills without instructions always run their own function."""

    async def run(self, skill: Skill, ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
        """Run ``skill`` on ``payload`` for ``ctx``'s caller; the skill's result."""
        ...


__all__ = [
    "MEMORY_SERVER",
    "Brain",
    "BudgetMeter",
    "InputRequired",
    "MemoryTools",
    "OutcomeUnknown",
    "Skill",
    "SkillContext",
    "SkillError",
    "SkillFunction",
    "TaskBudget",
    "Tools",
]
