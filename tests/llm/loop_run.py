"""The agent loop as the LLM tests run it: one skill with instructions, run by
``specialists.llm.AgentLoop`` over a scripted model and the tool plane, with what it reported."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from fleet.llm import ChatModel
from fleet.tokens import Claims
from specialists.cancellation import ToolCalls
from specialists.kit import BudgetMeter, LoopPolicy, Skill, SkillContext, TaskBudget
from specialists.llm import AgentLoop, function_name
from tests.llm.tool_plane import ToolPlane
from tests.llm_script import Reply, ScriptedModel, call


async def _never(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    raise AssertionError("with a model configured, the agent loop runs the skill")


SKILL = Skill(
    "invoice-check",
    "Check an invoice",
    "Looks an invoice up and says whether it is over the approval limit",
    _never,
    instructions="You check invoices for the finance team. The approval limit is 1000.",
)


@dataclass
class Run:
    """One skill run by the loop, and what it reported."""

    plane: ToolPlane
    model: ScriptedModel
    http: httpx.AsyncClient
    budget: TaskBudget = field(default_factory=TaskBudget)
    progress: list[str] = field(default_factory=list)
    loop: LoopPolicy = field(default_factory=LoopPolicy)
    meter: BudgetMeter | None = None
    context_tokens: int = 32_000  # the model's window, as the loop is told it
    resume: dict[str, Any] | None = None  # progress notes the task comes back with
    answer: dict[str, Any] | None = None  # a person's answer it comes back with
    saved: list[dict[str, Any]] = field(default_factory=list)  # the notes the loop saved, in order

    @property
    def lookup(self) -> str:
        return function_name(self.plane.server_id, "lookup_invoice")

    @property
    def pay(self) -> str:
        return function_name(self.plane.server_id, "pay_invoice")

    @property
    def status(self) -> str:
        return function_name(self.plane.server_id, "job_status")

    @property
    def void(self) -> str:
        return function_name(self.plane.server_id, "void_invoice")

    async def __call__(self, payload: dict[str, Any], max_turns: int = 8) -> dict[str, Any]:
        meter = self.meter = BudgetMeter(self.budget, self.loop)
        claims = Claims("operator", "acme", "ledger-agent", frozenset(), "jti", int(time.time()) + 300, {})

        async def report(text: str) -> None:
            self.progress.append(text)

        tools = self.plane.toolbox.for_skill(ToolCalls(), None, meter)

        async def save(notes: dict[str, Any]) -> None:
            self.saved.append(notes)

        ctx = SkillContext(
            claims,
            tools,
            report,
            "op-1",
            budget=meter,
            answer=self.answer,
            resume=self.resume,
            save_progress=save,
        )
        model = ChatModel(self.model.base_url, "scripted-1", "", self.http)
        loop = AgentLoop(model, max_turns=max_turns, context_tokens=self.context_tokens)
        return await loop.run(SKILL, ctx, payload)


def lookup_of(plane: ToolPlane, number: str = "INV-7") -> Reply:
    return call(function_name(plane.server_id, "lookup_invoice"), {"number": number})
