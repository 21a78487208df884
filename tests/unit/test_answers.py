"""What a caller makes of a specialist's answer and budget: the card's schema check of a result (a
broken release's garbage is refused, naming what is wrong), the skills extension a card carries, and
the per-task budget a caller may lower but never raise."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from coordinator.engine.delegation import check_answer, skill_is_idempotent
from fleet.errors import ErrorCode, FleetError
from fleet.operation_ext import skill_traits, skills_extension
from registry import AgentRecord
from specialists.code_runner.agent import SKILLS as CODE_RUNNER
from specialists.kit import BudgetMeter, LoopPolicy, Price, SkillError, TaskBudget


def _agent(skills: Any) -> AgentRecord:
    card = {"capabilities": {"extensions": [MessageToDict(skills_extension(skills))]}}
    return AgentRecord(
        id="code-runner", kind="specialist", card_url="", url="", version="1.0.0", skills=[], card=card,
        registered_at=0.0,
    )  # fmt: skip


GOOD = {
    "scored": 3,
    "anomalies": [{"invoice": "INV-1", "score": 9.5, "reasons": ["no payment received"]}],
    "max_score": 9.5,
    "report_artifact": "artifact:sha256:" + "ab" * 32,
    "summary": "3 invoices reconciled, 1 anomalies",
    "findings": ["Invoice INV-1 scored 9.5"],
}


def test_a_result_that_satisfies_the_cards_schema_is_taken() -> None:
    check_answer(_agent(CODE_RUNNER), "score-anomalies", GOOD)


@pytest.mark.parametrize(
    ("garbage", "where"),
    [
        ({**GOOD, "max_score": "high"}, "max_score"),
        ({k: v for k, v in GOOD.items() if k != "report_artifact"}, "the result"),
        ({**GOOD, "anomalies": [{"invoice": "INV-1"}]}, "anomalies/0"),
        ({**GOOD, "report_artifact": "/etc/passwd"}, "report_artifact"),
    ],
)
def test_a_result_that_breaks_the_cards_schema_is_refused_naming_the_agent_and_the_field(
    garbage: dict[str, Any], where: str
) -> None:
    with pytest.raises(FleetError) as refused:
        check_answer(_agent(CODE_RUNNER), "score-anomalies", garbage)
    assert refused.value.code == ErrorCode.BAD_ANSWER
    assert refused.value.message.startswith("code-runner (v1.0.0) answered score-anomalies")
    assert f": {where}: " in refused.value.message


def test_an_answer_that_asks_a_person_is_not_held_to_the_result_schema() -> None:
    check_answer(_agent(CODE_RUNNER), "score-anomalies", {"status": "input_required", "question": "which?"})


def test_the_skills_extension_says_which_skills_are_safe_to_repeat() -> None:
    agent = _agent(CODE_RUNNER)
    assert skill_is_idempotent(agent, "score-anomalies")
    assert not skill_is_idempotent(agent, "run-python")
    assert not skill_is_idempotent(agent, "no-such-skill")
    assert skill_traits({}, "score-anomalies") == {}  # a card without the extension says nothing


def test_a_caller_may_lower_a_budget_but_not_raise_it() -> None:
    mine = TaskBudget(max_tool_calls=10, max_seconds=60.0, max_llm_tokens=None)
    lowered = mine.lowered({"max_tool_calls": 3, "max_seconds": 600, "max_llm_tokens": 100, "other": 1})
    assert lowered == TaskBudget(max_tool_calls=3, max_seconds=60.0, max_llm_tokens=100)
    assert mine.lowered({"max_tool_calls": -1, "max_seconds": True}) == mine
    assert mine.lowered("not a mapping") == mine


def test_the_tool_call_over_the_budget_is_refused_before_it_is_made() -> None:
    meter = BudgetMeter(TaskBudget(max_tool_calls=2, max_llm_tokens=1000))
    meter.spend_tool_call("mcp-sql/query")
    meter.spend_tool_call("mcp-sql/query")
    with pytest.raises(SkillError) as spent:
        meter.spend_tool_call("mcp-sql/query")
    assert spent.value.code == ErrorCode.BUDGET_EXHAUSTED
    assert meter.tool_calls == 2
    meter.spend_tokens(900)
    with pytest.raises(SkillError, match="1000 LLM tokens is spent"):
        meter.spend_tokens(200)


def test_a_caller_lowers_the_loops_limits_and_never_raises_them() -> None:
    mine = TaskBudget(max_turns=20, max_tool_calls_per_turn=8, repeat_limit=3, max_cost_usd=2.0)
    asked = {"max_turns": 50, "max_tool_calls_per_turn": 2, "repeat_limit": 0, "max_cost_usd": 0.5}
    lowered = mine.lowered(asked)
    assert (lowered.max_turns, lowered.max_tool_calls_per_turn, lowered.repeat_limit) == (20, 2, 3)
    assert lowered.max_cost_usd == 0.5
    assert TaskBudget().lowered({"max_turns": 5}).max_turns == 5  # no cap of its own: the caller's


def test_a_callers_loop_policy_is_read_with_every_wrong_part_left_at_the_default() -> None:
    assert LoopPolicy.of(None) == LoopPolicy()
    policy = LoopPolicy.of(
        {
            "on_stuck": "summarize",
            "on_spent": "launch",
            "prices": {"m": {"input_per_mtok": 1, "output_per_mtok": 2}, "bad": {"input_per_mtok": -1}},
            "default_price": {"input_per_mtok": 5, "output_per_mtok": 5},
            "rate_limit_retries": True,
            "rate_limit_max_wait_s": 10_000,
        }
    )
    assert (policy.on_stuck, policy.on_spent) == ("summarize", "stop")
    assert policy.prices == {"m": Price(1.0, 2.0)} and policy.price_of("other") == Price(5.0, 5.0)
    assert (policy.rate_limit_retries, policy.rate_limit_max_wait_s) == (3, 30.0)


def test_a_completion_is_priced_by_the_policys_table_and_the_money_is_a_budget() -> None:
    meter = BudgetMeter(
        TaskBudget(max_llm_tokens=None, max_cost_usd=1.0), LoopPolicy(prices={"m": Price(2.0, 10.0)})
    )
    meter.spend_completion("m", 100_000, 50_000, 0)
    assert meter.cost_usd == pytest.approx(0.7) and meter.llm_tokens == 150_000 and meter.spent() == ""
    meter.spend_completion("unpriced", 1_000_000, 1_000_000, 2_000_000)
    assert meter.cost_usd == pytest.approx(0.7)  # a model with no price costs nothing known
    meter.spend_completion("m", 100_000, 20_000, 120_000)
    assert meter.spent() == "cost"
    with pytest.raises(SkillError) as spent:
        meter.check_tokens()
    assert spent.value.details == {"reason": "cost"}
