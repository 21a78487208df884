"""The specialist fleet under failure: a specialist killed in the middle of a step, and a broken
release that answers garbage. Each runs against real processes (the stack of ``fleet up``; the
broken release is a kit specialist served by the test, enrolled and registered as any other)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetctl.testing.e2e import (
    Stack,
    all_events,
    clean_env,
    first_event,
    run_id_of_first_run,
    send,
    start_stack,
    stop_stack,
    user_message,
)
from specialists.kit import Skill, SkillContext
from tests.e2e.kit_agent import kit_agent

pytestmark = pytest.mark.e2e

# Settled invoices beside the demo's payments (mcp_servers/sql/_schema.py DEMO_PAYMENTS): INV-A-1004
# was paid twice, INV-A-1003 not at all.
INVOICES = [
    {"invoice": "INV-A-1001", "customer": "Northwind", "amount": 1180.0},
    {"invoice": "INV-A-1003", "customer": "Fabrikam", "amount": 14250.0},
    {"invoice": "INV-A-1004", "customer": "Tailspin", "amount": 1060.0},
]
RECONCILE_AND_SCORE: dict[str, Any] = {
    "steps": [
        {"id": "reconcile", "skill": "reconcile-invoices", "input": {"invoices": INVOICES}},
        {
            "id": "score",
            "skill": "score-anomalies",
            "input": {"records": {"$from": "reconcile.records"}, "usual": {"$from": "reconcile.usual"}},
        },
    ]
}
HOLD_S = 30.0  # how long the first code runner to start scoring holds there (it is killed meanwhile)


@pytest.fixture
def held_scoring(tmp_path: Path) -> Iterator[tuple[Stack, Path]]:
    """A stack whose first code runner to start ``score-anomalies`` holds there for ``HOLD_S``; the
    marker appears when it does."""
    marker = tmp_path / "held"
    env = clean_env(FLEET_HOLD_POINTS=f"skill.start:score-anomalies@{marker}", FLEET_HOLD_S=f"{HOLD_S:g}")
    stack = start_stack(tmp_path / "fleet", env=env)
    try:
        yield stack, marker
    finally:
        stop_stack(stack)


async def test_a_specialist_killed_mid_step_is_replaced_by_its_replica_and_the_run_completes(
    held_scoring: tuple[Stack, Path],
) -> None:
    stack, marker = held_scoring
    token = stack.token("coordinator")
    sending = asyncio.create_task(send(stack, user_message(data=RECONCILE_AND_SCORE), token=token))
    run_id = await run_id_of_first_run(stack, token)
    async with asyncio.timeout(60):
        started = await first_event(stack, run_id, token, "step.started", step="score")
        while not marker.exists():  # noqa: ASYNC110  # a file another process makes: no event to wait on
            await asyncio.sleep(0.05)
    victim = str(started["payload"]["agent"])
    assert victim in ("code-runner", "code-runner-2")
    os.kill(stack.endpoints["processes"][victim], signal.SIGKILL)

    async with asyncio.timeout(90):
        outcome = await sending
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    scored = outcome.result["steps"]["score"]
    assert [a["invoice"] for a in scored["anomalies"]] == ["INV-A-1003", "INV-A-1004"]
    assert scored["scored"] == 3
    events = await all_events(stack, run_id, token)
    moved_ = [e for e in events if e["type"] == "step.rerouted"]
    assert len(moved_) == 1, "\n".join(f"{e['type']} {e['payload']}" for e in events)
    [moved] = moved_
    other = ({"code-runner", "code-runner-2"} - {victim}).pop()
    assert moved["payload"]["from"] == victim and moved["payload"]["to"] == other
    assert victim in moved["payload"]["why"]
    # The operation kept its id: sent once to each agent, run to its end once.
    score_ops = [e for e in events if e["type"] == "operation.intent" and e["payload"]["step"] == "score"]
    assert len(score_ops) == 1
    assert [e["payload"]["step"] for e in events if e["type"] == "operation.succeeded"] == [
        "reconcile",
        "score",
    ]


# A broken release: the skill's card says what its result holds, and it answers something else.
BROKEN_SKILL = "robust-score"
BROKEN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["outliers"],
    "properties": {"outliers": {"type": "array", "items": {"type": "object"}}},
}


async def _garbage(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    return {"outliers": "all of them", "note": "v2.0.0 changed the result's shape"}


async def test_a_broken_release_answering_garbage_fails_its_step_clearly_and_the_rest_carry_on(
    stack: Stack, tmp_path: Path
) -> None:
    token = stack.token("coordinator")
    skill = Skill(BROKEN_SKILL, "Robust score", "Scores records", _garbage, output_schema=BROKEN_SCHEMA)
    async with kit_agent(stack, tmp_path, [skill], version="2.0.0") as agent_id:
        plan = {
            "steps": [
                {"id": "scored", "skill": BROKEN_SKILL, "input": {}},
                {"id": "totals", "skill": "invoice-totals"},  # in parallel, on a healthy specialist
            ]
        }
        outcome = await send(stack, user_message(data=plan), token=token)
        assert outcome.state_name == "TASK_STATE_FAILED"
        assert f"{agent_id} (v2.0.0) answered {BROKEN_SKILL}" in outcome.final_text
        assert "outliers" in outcome.final_text
        events = await all_events(stack, outcome.task_id, token)
        [failed] = [e for e in events if e["type"] == "step.failed"]
        assert failed["payload"]["step"] == "scored"
        assert failed["payload"]["code"] == "specialist_bad_answer"
        assert failed["payload"]["agent"] == agent_id
        completed = [e["payload"]["step"] for e in events if e["type"] == "step.completed"]
        assert completed == ["totals"]

        # The rest of the fleet is untouched: the next run goes as it would have.
        healthy = await send(
            stack, user_message(data={"steps": [{"id": "totals", "skill": "invoice-totals"}]}), token=token
        )
        assert healthy.state_name == "TASK_STATE_COMPLETED", healthy.final_text
