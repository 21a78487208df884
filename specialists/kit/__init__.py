"""The specialist kit: a few skill functions become a deployable A2A agent of the fleet.

A specialist is a module that declares its skills and calls :func:`serve_specialist` from ``main``::

    from fleet.settings import ServiceSettings
    from specialists.kit import Skill, SkillContext, serve_specialist


    async def greet(ctx: SkillContext, payload: dict) -> dict:
        await ctx.progress("greeting")
        return {"greeting": f"hello, {payload.get('name', 'world')} (tenant {ctx.tenant})"}


    async def main(settings: ServiceSettings) -> None:
        await serve_specialist(
            settings, name="Greeter", description="Greets.", version="0.1.0",
            skills=[Skill("greet", "Greet", 'Input: {"name": ...}', greet)],
        )

The kit gives it an identity (its own key, enrolled with the registry), a signed agent card,
bearer-JWT auth on every call, registration, an operation journal (a step sent again after a crash
gets its recorded outcome instead of running twice), cooperative cancellation, and, inside a skill:

- the verified caller and its tenant (:attr:`SkillContext.claims`, :attr:`SkillContext.tenant`);
- MCP tools through the fleet (:attr:`SkillContext.tools`: a token exchanged per server, for the
  caller, never the agent's own authority);
- long-term memory (:attr:`SkillContext.memory`: :class:`MemoryTools`, through the memory server's
  PII and policy gate);
- progress lines the caller sees (:attr:`SkillContext.progress`);
- keys that make effects happen once (:meth:`SkillContext.idempotency_key`);
- a question to a person (raise :class:`InputRequired`; the answer comes back in
  :attr:`SkillContext.answer`) and an honest "I do not know what happened" (:class:`OutcomeUnknown`);
- budgets (:class:`TaskBudget` on the skill, spent through :class:`BudgetMeter`).

Refuse with :class:`SkillError` (a :class:`~fleet.errors.FleetError` with a stable code): the
caller reads the code, the message and whether to retry. With an LLM configured, a skill that has
``instructions`` is run by the agent loop over the agent's MCP tools (:class:`Brain`).
"""

from specialists.kit._server import (
    SkillExecutor,
    Toolbox,
    ToolCatalog,
    build_specialist_app,
    mcp_http_client,
    serve_specialist,
)
from specialists.skill import (
    MEMORY_SERVER,
    Brain,
    BudgetMeter,
    InputRequired,
    LoopPolicy,
    MemoryTools,
    OutcomeUnknown,
    Price,
    Skill,
    SkillContext,
    SkillError,
    SkillFunction,
    TaskBudget,
    Tools,
)

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
    "SkillExecutor",
    "SkillFunction",
    "TaskBudget",
    "ToolCatalog",
    "Toolbox",
    "Tools",
    "build_specialist_app",
    "mcp_http_client",
    "serve_specialist",
]
