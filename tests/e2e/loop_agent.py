"""A specialist whose one skill runs as an agent loop over the case desk's tools, served as a process
of its own (``python -m tests.e2e.loop_agent``, settings from ``FLEET_*``), so that a test can kill
it mid-loop and start it again."""

from __future__ import annotations

import asyncio
from typing import Any

from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, TaskBudget, serve_specialist

SKILL_ID = "triage-ticket"


async def _needs_a_model(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    raise AssertionError("this agent runs its skill with a model")


SKILL = Skill(
    SKILL_ID,
    "Triage a ticket",
    'Opens a review case for a ticket and notes it for the team. Input: {"ticket": TEXT}.',
    _needs_a_model,
    # Safe to run again under its operation id: its loop goes on from its progress notes, keys its
    # case by the operation, and ends outcome_unknown if a crash cut a call it cannot repeat.
    idempotent=True,
    budget=TaskBudget(max_turns=10),
    instructions="Open a review case for the ticket with the case desk's open_case tool, post a note on"
    ' the ops channel with post_note, then answer {"case": CASE_ID, "noted": true}.',
)


async def main() -> None:
    await serve_specialist(
        ServiceSettings(),  # type: ignore[call-arg]  # from FLEET_* in the environment
        name="Triage agent",
        description="a test's",
        version="1.0.0",
        skills=[SKILL],
    )


if __name__ == "__main__":
    asyncio.run(main())
