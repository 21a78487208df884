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
    """What one task of a skill may spend, and where its agent loop stops (None: no cap).

    Spending: tool calls, seconds, LLM tokens and money (``max_cost_usd``, priced by the caller's
    :class:`LoopPolicy`). The agent loop (a skill with instructions): model turns (None: the
    agent's ``FLEET_LLM_MAX_TURNS``), tool calls one turn may ask for, and how often the same call
    (tool and arguments) or the same model output may come back before the loop is not converging.

    A skill declares its own; a caller may lower it for one task (message metadata
    ``fleet.budget``, the same keys), never raise it."""

    max_tool_calls: int | None = 50
    max_seconds: float | None = 600.0
    max_llm_tokens: int | None = 50_000
    max_cost_usd: float | None = None
    max_turns: int | None = None
    max_tool_calls_per_turn: int | None = 8
    repeat_limit: int | None = 3
    output_repeat_limit: int | None = 3

    def lowered(self, asked: Any) -> TaskBudget:
        """This budget, lowered to what ``asked`` (a caller's mapping) names; other keys ignored."""
        if not isinstance(asked, dict):
            return self

        def lower(mine: Any, key: str, kind: type) -> Any:
            theirs = asked.get(key)
            if isinstance(theirs, bool) or not isinstance(theirs, int | float) or theirs <= 0:
                return mine
            return kind(theirs) if mine is None else min(mine, kind(theirs))

        return TaskBudget(
            **{
                name: lower(getattr(self, name), name, kind)
                for name, kind in (
                    ("max_tool_calls", int),
                    ("max_seconds", float),
                    ("max_llm_tokens", int),
                    ("max_cost_usd", float),
                    ("max_turns", int),
                    ("max_tool_calls_per_turn", int),
                    ("repeat_limit", int),
                    ("output_repeat_limit", int),
                )
            }
        )


SPENT_ACTIONS = ("stop", "summarize", "ask")
STUCK_ACTIONS = (*SPENT_ACTIONS, "review")  # a stuck loop may go to the reviewer (specialists.review)


@dataclass(frozen=True, slots=True)
class Price:
    """What a model's tokens cost, in US dollars per million."""

    input_per_mtok: float
    output_per_mtok: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """The dollars ``prompt_tokens`` in and ``completion_tokens`` out cost."""
        return (prompt_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok) / 1e6


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    """What the caller's policy says the agent loop does at a limit (message metadata
    ``fleet.loop``): ``on_stuck`` when it is not converging (the same call or output again, too
    many calls in a turn), ``on_spent`` when a budget is spent (turns, tool calls, tokens, money):
    ``stop`` (the task fails with the reason), ``summarize`` (one last turn without tools: the
    model answers from what it has) or ``ask`` (a person decides: the task asks, with its progress
    notes saved, and goes on from them as the answer says: continue with a new allowance,
    summarize, or stop); a stuck loop may also go to the reviewer (``review``:
    :mod:`specialists.review` decides continue, stop or a person), at most ``max_reviews`` times a
    task, then a person decides.
    ``prices``: per model, what its tokens cost (a model not listed costs ``default_price``, if
    any). A model that answers 429 is waited out (its ``Retry-After``, at most
    ``rate_limit_max_wait_s``) at most ``rate_limit_retries`` times, then the task stops
    ``llm_rate_limited``. With no caller's policy, the loop stops at every limit."""

    on_stuck: str = "stop"
    on_spent: str = "stop"
    prices: dict[str, Price] = field(default_factory=dict)
    default_price: Price | None = None
    rate_limit_retries: int = 3
    rate_limit_max_wait_s: float = 30.0
    max_reviews: int = 2

    def price_of(self, model: str) -> Price | None:
        """What ``model``'s tokens cost, if the policy says."""
        return self.prices.get(model, self.default_price)

    @classmethod
    def of(cls, asked: Any) -> LoopPolicy:
        """The policy a caller sent (``fleet.loop``); what it does not say, or says wrongly, is
        this class's default."""
        if not isinstance(asked, dict):
            return cls()
        default = cls()

        def action(key: str, actions: tuple[str, ...]) -> str:
            value = asked.get(key)
            return value if value in actions else str(getattr(default, key))

        def number(key: str, most: float) -> float:
            value = asked.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= most:
                return float(value)
            return float(getattr(default, key))

        prices = asked.get("prices")
        return cls(
            on_stuck=action("on_stuck", STUCK_ACTIONS),
            on_spent=action("on_spent", SPENT_ACTIONS),
            prices={
                str(model): found
                for model, price in (prices.items() if isinstance(prices, dict) else [])
                if (found := _price(price)) is not None
            },
            default_price=_price(asked.get("default_price")),
            rate_limit_retries=int(number("rate_limit_retries", 20)),
            rate_limit_max_wait_s=number("rate_limit_max_wait_s", 600),
            max_reviews=int(number("max_reviews", 20)),
        )


def _price(value: Any) -> Price | None:
    if not isinstance(value, dict):
        return None
    parts = [value.get("input_per_mtok"), value.get("output_per_mtok")]
    if not all(isinstance(p, int | float) and not isinstance(p, bool) and p >= 0 for p in parts):
        return None
    return Price(float(parts[0]), float(parts[1]))  # type: ignore[arg-type]


MAX_TIMED = 200  # completions of one task whose latency is reported
MAX_REPEATED = 20  # functions whose repeats one task reports
SLOW_TOOL_CALL_S = 30.0  # a tool call longer than this is slow (counted per agent)


class BudgetMeter:
    """One task's spending against its :class:`TaskBudget`; raises ``budget_exhausted`` before the
    spend that would pass a cap (the tool call is then not made). ``loop``: what the caller's policy
    says the agent loop does at a limit, and what tokens cost."""

    def __init__(self, budget: TaskBudget, loop: LoopPolicy | None = None) -> None:
        self.budget = budget
        self.loop = loop or LoopPolicy()
        self.tool_calls = 0
        self.llm_tokens = 0
        self.tokens_in = 0
        self.tokens_out = 0
        self.cost_usd = 0.0
        self.llm_calls = 0
        self.rate_limited = 0  # answers of 429 from the model
        self.llm_retries = 0  # completions asked again (after a 429 or a failure worth a retry)
        self.models: set[str] = set()
        self.out_of_time = False  # set by the executor's watchdog when max_seconds passed
        self.ran = False  # whether the skill ran (a repeat answered from the journal did not)
        self.stopped: str = ""  # why the agent loop stopped at a limit, if it did
        self.summarized = False  # whether it then answered from what it had
        self.compactions = 0  # times the loop's context was compacted
        self.resumed = False  # whether the loop went on from progress notes (after a crash)
        self.from_notes = 0  # calls answered from the notes instead of made again
        self.llm_seconds: list[float] = []  # how long each completion took (the first MAX_TIMED)
        self.slow_tool_calls = 0  # tool calls that took longer than SLOW_TOOL_CALL_S
        self.tokens_on_repeats = 0  # tokens of turns that asked only for calls made before
        # The last request the agent loop sent its model (redacted, bounded), kept for a failed
        # task's debug bundle.
        self.last_request: dict[str, Any] | None = None
        self.repeated: dict[str, int] = {}  # those calls, by function (at most MAX_REPEATED)
        self.reviews: dict[str, int] = {}  # the reviewer's verdicts on the loop, by verdict

    def timed_completion(self, seconds: float) -> None:
        """Note how long a completion took (the first :data:`MAX_TIMED` of the task)."""
        if len(self.llm_seconds) < MAX_TIMED:
            self.llm_seconds.append(max(0.0, seconds))

    def timed_tool_call(self, seconds: float) -> None:
        """Note how long a tool call took (one over :data:`SLOW_TOOL_CALL_S` is counted)."""
        self.slow_tool_calls += seconds > SLOW_TOOL_CALL_S

    def repeated_turn(self, tokens: int, functions: Sequence[str]) -> None:
        """Note a turn that asked only for calls already made: its tokens went to repeating them."""
        self.tokens_on_repeats += max(0, tokens)
        for name in functions:
            if name in self.repeated or len(self.repeated) < MAX_REPEATED:
                self.repeated[name] = self.repeated.get(name, 0) + 1

    def spend_tool_call(self, what: str) -> None:
        """Count one tool call (``what``); raises ``budget_exhausted`` instead if the cap is spent."""
        cap = self.budget.max_tool_calls
        if cap is not None and self.tool_calls >= cap:
            raise SkillError(
                ErrorCode.BUDGET_EXHAUSTED,
                f"the task's budget of {cap} tool calls is spent; {what} not called",
                details={"reason": "tool_calls"},
            )
        self.tool_calls += 1

    def spend_tokens(self, tokens: int) -> None:
        """Count ``tokens`` a model used for this task; raises once the total passes the cap."""
        self.llm_tokens += max(0, tokens)
        self.check_tokens()

    def spend_completion(self, model: str, prompt_tokens: int, completion_tokens: int, total: int) -> None:
        """Count one completion of ``model``: its tokens (``total`` when the server gave no split)
        and, priced by the loop's policy, its cost. Never raises: :meth:`spent` says what is over."""
        self.llm_calls += 1
        self.models.add(model)
        self.tokens_in += max(0, prompt_tokens)
        self.tokens_out += max(0, completion_tokens)
        self.llm_tokens += max(0, total or prompt_tokens + completion_tokens)
        price = self.loop.price_of(model)
        if price is not None:
            self.cost_usd += price.cost(max(0, prompt_tokens), max(0, completion_tokens))

    def spent(self) -> str:
        """The reason a spending cap is passed (``tokens``, ``cost``), or ""."""
        if self.budget.max_llm_tokens is not None and self.llm_tokens > self.budget.max_llm_tokens:
            return "tokens"
        if self.budget.max_cost_usd is not None and self.cost_usd > self.budget.max_cost_usd:
            return "cost"
        return ""

    def check_tokens(self) -> None:
        """Raise ``budget_exhausted`` if the tokens or the money are spent."""
        reason = self.spent()
        if reason == "tokens":
            raise SkillError(
                ErrorCode.BUDGET_EXHAUSTED,
                f"the task's budget of {self.budget.max_llm_tokens} LLM tokens is spent ({self.llm_tokens} used)",
                details={"reason": reason},
            )
        if reason == "cost":
            raise SkillError(
                ErrorCode.BUDGET_EXHAUSTED,
                f"the task's budget of ${self.budget.max_cost_usd:g} is spent (${self.cost_usd:.4f} used)",
                details={"reason": reason},
            )

    def tokens_left(self) -> int | None:
        """LLM tokens the task may still spend (None: no cap)."""
        cap = self.budget.max_llm_tokens
        return None if cap is None else max(0, cap - self.llm_tokens)

    def to_dict(self) -> dict[str, Any]:
        """What the task has spent so far (and, if its loop stopped at a limit, why)."""
        spent: dict[str, Any] = {"tool_calls": self.tool_calls, "llm_tokens": self.llm_tokens}
        if self.llm_calls:
            spent.update(
                tokens_in=self.tokens_in,
                tokens_out=self.tokens_out,
                llm_calls=self.llm_calls,
                cost_usd=round(self.cost_usd, 6),
                models=sorted(self.models),
                llm_seconds=[round(s, 3) for s in self.llm_seconds],
            )
        if self.slow_tool_calls:
            spent["slow_tool_calls"] = self.slow_tool_calls
        if self.repeated:
            spent["repeats"] = {"tokens": self.tokens_on_repeats, "calls": dict(self.repeated)}
        if self.rate_limited or self.llm_retries:
            spent.update(rate_limited=self.rate_limited, llm_retries=self.llm_retries)
        if self.stopped:
            spent.update(stopped=self.stopped, summarized=self.summarized)
        if self.compactions or self.resumed:
            spent.update(compactions=self.compactions, resumed=self.resumed, from_notes=self.from_notes)
        if self.reviews:
            spent["reviews"] = dict(self.reviews)
        return spent


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


async def _no_notes(notes: dict[str, Any]) -> None:
    """Progress notes with nowhere to go (a skill run outside the kit's executor)."""


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
    # The progress notes of this operation, when it comes back after the process running it died
    # (see specialists.progress), and where the agent loop saves them as it goes.
    resume: dict[str, Any] | None = None
    save_progress: Callable[[dict[str, Any]], Awaitable[None]] = field(default=_no_notes)

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
    "LoopPolicy",
    "MemoryTools",
    "OutcomeUnknown",
    "Price",
    "Skill",
    "SkillContext",
    "SkillError",
    "SkillFunction",
    "TaskBudget",
    "Tools",
]
