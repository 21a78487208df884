"""Plans by a model (``coordinator.planning.llm_planner``) from a scripted model over real HTTP, checked as a
caller's plan is, and used by ``plan_request`` only for text no routing rule matches (the fleet's
own routing policy in the real Rego engine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.types import AgentSkill

from coordinator.planning.llm_planner import LlmPlanner, offered_skills, registry_planner
from coordinator.planning.plan import PlanError, Step, plan_request
from fleet.errors import ErrorCode, FleetError
from fleet.llm import ChatModel
from policy import RegorusEngine
from registry import AgentRecord, SkillRecord
from tests.llm.tool_plane import tool_plane
from tests.llm_script import ScriptedModel, say, scripted_model

SKILLS = [
    {"id": "invoice-totals", "name": "Invoice totals", "description": "Totals per customer, from SQL"},
    {"id": "outliers", "name": "Outliers", "description": "Outliers of a field over records"},
]
TWO_STEPS = {
    "steps": [
        {"id": "totals", "skill": "invoice-totals"},
        {
            "id": "odd",
            "skill": "outliers",
            "input": {"records": {"$from": "totals.records"}, "field": "largest"},
        },
    ]
}


def planner_at(model: ScriptedModel, http: httpx.AsyncClient) -> LlmPlanner:
    return LlmPlanner(ChatModel(model.base_url, "scripted-1", "", http))


async def refusal(answer: str, http: httpx.AsyncClient) -> PlanError:
    async with scripted_model(say(answer)) as model:
        with pytest.raises(PlanError) as caught:
            await planner_at(model, http).plan("reconcile the ledger", SKILLS)
    return caught.value


async def test_the_models_plan_is_read_with_its_references_between_steps(http: httpx.AsyncClient) -> None:
    async with scripted_model(say(f"```json\n{json.dumps(TWO_STEPS)}\n```")) as model:
        steps = await planner_at(model, http).plan("which customers spend oddly?", SKILLS)
    assert steps == [
        Step("totals", "invoice-totals", {}),
        Step("odd", "outliers", {"records": {"$from": "totals.records"}, "field": "largest"}),
    ]
    system, user = model.requests[0]["messages"]
    assert user == {"role": "user", "content": "which customers spend oddly?"}
    assert "- invoice-totals: Invoice totals: Totals per customer, from SQL" in system["content"]
    assert '{"$from": "STEP.FIELD"}' in system["content"]
    assert "tools" not in model.requests[0]


async def test_a_plan_that_uses_a_skill_nobody_offers_is_refused_naming_it(http: httpx.AsyncClient) -> None:
    error = await refusal(json.dumps({"steps": [{"id": "pay", "skill": "wire-money"}]}), http)
    assert error.code == ErrorCode.INVALID_REQUEST
    assert "uses skill 'wire-money' in step pay, which no specialist offers" in error.message


async def test_a_wait_step_from_a_model_is_refused_too(http: httpx.AsyncClient) -> None:
    error = await refusal(json.dumps({"steps": [{"id": "nap", "wait": {"for_s": 86400}}]}), http)
    assert "uses skill 'fleet.timer' in step nap, which no specialist offers" in error.message


async def test_a_plan_in_which_the_model_names_an_agent_is_refused(http: httpx.AsyncClient) -> None:
    named = {"steps": [{"id": "totals", "skill": "invoice-totals", "agent": "acme-partner"}]}
    error = await refusal(json.dumps(named), http)
    assert error.code == ErrorCode.INVALID_REQUEST
    assert (
        "names agent 'acme-partner' in step totals: only a caller's plan or policy may name" in error.message
    )


async def test_an_invalid_plan_is_refused_with_the_models_mistake_in_the_message(
    http: httpx.AsyncClient,
) -> None:
    backwards = {"steps": [{"id": "a", "skill": "outliers", "input": {"r": {"$from": "b.records"}}}]}
    error = await refusal(json.dumps(backwards), http)
    assert error.message == "the model's plan is invalid: step a refers to 'b', which is not an earlier step"


@pytest.mark.parametrize("answer", ["I would first total the invoices.", '{"plan": []}', "[]"])
async def test_an_answer_that_is_not_a_plan_object_is_refused(answer: str, http: httpx.AsyncClient) -> None:
    error = await refusal(answer, http)
    assert error.message.startswith('the model\'s plan is not a JSON object with "steps"')


async def test_with_no_skills_on_offer_the_model_is_not_asked(http: httpx.AsyncClient) -> None:
    async with scripted_model() as model:
        with pytest.raises(PlanError, match="no specialist offers a skill"):
            await planner_at(model, http).plan("anything", [])
    assert model.requests == []


async def test_the_planner_plans_only_text_that_no_routing_rule_matches(http: httpx.AsyncClient) -> None:
    engine = RegorusEngine.from_dir()
    async with scripted_model(say(json.dumps(TWO_STEPS))) as model:
        planner = planner_at(model, http)

        async def plan(text: str) -> list[Step]:
            return await planner.plan(text, SKILLS)

        routed = await plan_request([], "any outlier in the invoices?", engine, "acme", planner=plan)
        assert model.requests == []  # a routing rule matched: the model is not asked
        explicit = await plan_request(
            [{"steps": [{"skill": "outliers"}]}], "write a sonnet", engine, "acme", planner=plan
        )
        assert model.requests == []  # explicit steps win over both
        planned = await plan_request([], "write a sonnet about spend", engine, "acme", planner=plan)
    assert [s.skill for s in routed] == ["invoice-totals", "outliers"]
    assert [s.skill for s in explicit] == ["outliers"]
    assert [s.id for s in planned] == ["totals", "odd"]
    assert model.requests[0]["messages"][1]["content"] == "write a sonnet about spend"


async def test_without_a_planner_unmatched_text_is_still_no_specialist() -> None:
    with pytest.raises(FleetError) as caught:
        await plan_request([], "write a sonnet", RegorusEngine.from_dir(), "acme")
    assert caught.value.code == ErrorCode.NO_SPECIALIST


def _agent(agent_id: str, skills: list[str], **more: Any) -> AgentRecord:
    return AgentRecord(
        id=agent_id,
        kind=more.pop("kind", "specialist"),
        card_url=f"http://{agent_id}/.well-known/agent-card.json",
        url=f"http://{agent_id}",
        version="1",
        skills=[SkillRecord(id=s, name=s.title(), description=f"does {s}") for s in skills],
        card={},
        registered_at=0.0,
        **more,
    )


def test_the_skills_offered_are_those_of_specialists_discovery_hands_out_each_once() -> None:
    agents = [
        _agent("sql", ["invoice-totals"]),
        _agent("stats", ["outliers", "invoice-totals"]),
        _agent("forged", ["wire-money"], status="quarantined"),
        _agent("away", ["sleep"], status="unreachable"),
        _agent("coordinator", ["orchestrate"], kind="coordinator"),
        _agent("acme-partner", ["fraud-score"], external=True),  # another organisation's card text
    ]
    assert offered_skills(agents) == [
        {"id": "invoice-totals", "name": "Invoice-Totals", "description": "does invoice-totals"},
        {"id": "outliers", "name": "Outliers", "description": "does outliers"},
    ]


async def test_the_coordinators_planner_offers_the_model_the_skills_registered_specialists_offer(
    registry_nats: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    skills = (AgentSkill(id="invoice-check", name="Check an invoice", description="Over the limit?"),)
    plan = {"steps": [{"id": "check", "skill": "invoice-check", "input": {"number": "INV-7"}}]}
    async with (
        tool_plane(registry_nats, tmp_path, skills) as plane,
        scripted_model(say(json.dumps(plan))) as model,
    ):
        planner = registry_planner(ChatModel(model.base_url, "scripted-1", "", http), plane.registry)
        steps = await plan_request([], "is INV-7 too big?", RegorusEngine.from_dir(), "acme", planner=planner)
    assert steps == [Step("check", "invoice-check", {"number": "INV-7"})]
    system = model.requests[0]["messages"][0]["content"]
    assert "- invoice-check: Check an invoice: Over the limit?" in system
