"""The specialist kit, through the coordinator: a skill that asks a person (A2A ``input-required``) and
gets the answer in its next call, per-task budgets (tool calls and time), and the skills extension
of a card. The specialists are kit agents served by the test (see ``kit_agent``) beside the stack."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf.json_format import MessageToDict

from fleetctl.testing.e2e import Stack, fetch_card, send, user_message
from specialists.kit import InputRequired, Skill, SkillContext, TaskBudget
from tests.e2e.a2a_helpers import run_events, start
from tests.e2e.kit_agent import kit_agent

pytestmark = pytest.mark.e2e


async def _confirm_payee(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    if ctx.answer is None or "account" not in ctx.answer:
        raise InputRequired("Which account should the refund go to?", {"account": "an account id"})
    return {"account": ctx.answer["account"], "confirmed_by": payload["approval"]["by"]}


async def test_a_skill_that_asks_waits_for_a_person_and_gets_the_answer_in_its_next_call(
    stack: Stack, tmp_path: Path
) -> None:
    skill = Skill("confirm-payee", "Confirm payee", "Asks which account", _confirm_payee)
    async with kit_agent(stack, tmp_path, [skill]) as agent_id:
        token = stack.token("coordinator", scopes=("agent:invoke", "runs:approve"))
        plan = {"steps": [{"id": "payee", "skill": "confirm-payee"}]}
        task = await start(stack, token, user_message(data=plan))
        events = await run_events(stack, task.id, token, until="run.waiting")
        assert "Which account should the refund go to?" in events[-1]["payload"]["text"]
        async with httpx.AsyncClient(timeout=30) as http:
            run = (
                await http.get(
                    f"{stack.endpoints['coordinator']}/v1/runs/{task.id}",
                    headers={"Authorization": f"Bearer {token}"},
                )
            ).json()
        assert run["state"] == "waiting" and run["wait"]["type"] == "input"
        assert run["wait"]["detail"]["agent"] == agent_id
        assert run["wait"]["detail"]["asked"]["details"] == [{"fields": {"account": "an account id"}}]
        async with httpx.AsyncClient(timeout=30) as http:
            answered = await http.post(
                f"{stack.endpoints['coordinator']}/v1/runs/{task.id}/signals",
                headers={"Authorization": f"Bearer {token}"},
                json={"action": "input", "input": {"account": "ACC-7"}, "note": "from the ticket"},
            )
        assert answered.status_code == 200 and answered.json()["applied"], answered.text
        ended = await run_events(stack, task.id, token)
    assert ended[-1]["type"] == "run.completed", ended[-1]
    [result] = [e["payload"]["steps"]["payee"] for e in ended if e["type"] == "artifact"]
    assert result == {"account": "ACC-7", "confirmed_by": "operator"}


async def _two_queries(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    for _ in range(2):
        await ctx.tools.call(
            "mcp-sql", "query", {"sql": "SELECT 1 AS one"}, tenant=ctx.tenant, scopes=["sql:query"]
        )
    return {"queries": 2}


async def _slow(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    await asyncio.sleep(30)  # the skill under test outlives its time budget
    return {}


async def test_a_task_stops_at_its_budget_of_tool_calls_or_seconds_with_budget_exhausted(
    stack: Stack, tmp_path: Path
) -> None:
    skills = [
        Skill(
            "two-queries", "Two queries", "Queries twice", _two_queries, budget=TaskBudget(max_tool_calls=1)
        ),
        Skill("slow", "Slow", "Takes its time", _slow, budget=TaskBudget(max_seconds=0.5)),
    ]
    async with kit_agent(stack, tmp_path, skills, scopes=("sql:query",)):
        token = stack.token("coordinator")
        calls = await send(stack, user_message(data={"steps": [{"skill": "two-queries"}]}), token=token)
        slow = await send(stack, user_message(data={"steps": [{"skill": "slow"}]}), token=token)
    assert calls.state_name == "TASK_STATE_FAILED"
    assert "budget of 1 tool calls is spent; mcp-sql/query not called" in calls.final_text
    assert slow.state_name == "TASK_STATE_FAILED"
    assert "ran out of its 0.5 s budget after 0 tool calls" in slow.final_text


async def test_a_specialists_card_says_which_skills_are_safe_to_repeat_and_what_they_answer(
    stack: Stack,
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        card = await fetch_card(http, stack.endpoints["specialists"]["code-runner"])
    [extension] = [e for e in card.capabilities.extensions if e.uri.endswith("/ext/skills/v1")]
    skills: dict[str, Any] = MessageToDict(extension.params)["skills"]
    assert skills["score-anomalies"]["idempotent"] is True
    assert "max_score" in skills["score-anomalies"]["output"]["required"]
    assert skills["run-python"]["idempotent"] is False
    assert list(card.default_input_modes) == ["application/json"]
