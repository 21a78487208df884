"""The mission budget and convergence limits, from policy: a run that spends its budget gets a new
tranche or stops with the best result so far; a run that repeats itself stops as non-converging.

One stack, with the shipped policy bundle plus per-tenant budgets that only these tests use.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from policy import DEFAULT_BUNDLE_DIR
from tests.e2e.conftest import (
    TWO_STEPS,
    Stack,
    all_events,
    clean_env,
    send,
    start_stack,
    stop_stack,
    user_message,
)

pytestmark = pytest.mark.e2e

TENANT_BUDGETS = {
    "one-step": {"max_steps": 1, "on_exhausted": "summarize"},
    "two-tranches": {"max_steps": 1, "on_exhausted": "tranche", "max_tranches": 1},
}

# Three steps, each after the one before, all asking the same thing.
SAME_CALL_THRICE: dict[str, Any] = {
    "steps": [
        {"id": "a", "skill": "sql-query", "input": {"sql": "SELECT 1 AS one"}},
        {"id": "b", "skill": "sql-query", "input": {"sql": "SELECT 1 AS one"}, "after": ["a"]},
        {"id": "c", "skill": "sql-query", "input": {"sql": "SELECT 1 AS one"}, "after": ["b"]},
    ]
}


@pytest.fixture(scope="module")
def budget_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    bundle = tmp_path_factory.mktemp("policy") / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    data["config"]["budgets"]["tenants"] = TENANT_BUDGETS
    data["config"]["convergence"] = {"repeat_limit": 3, "max_calls_per_turn": 2}
    (bundle / "data.json").write_text(json.dumps(data))
    stack = start_stack(tmp_path_factory.mktemp("stack"), env=clean_env(FLEET_POLICY_DIR=str(bundle)))
    yield stack
    stop_stack(stack)


async def run(stack: Stack, tenant: str, plan: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    token = stack.token("coordinator", tenant=tenant)
    outcome = await send(stack, user_message(data=plan), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    return outcome.result, await all_events(stack, outcome.task_id, token)


async def test_a_spent_budget_closes_the_run_with_the_best_result_so_far(budget_stack: Stack) -> None:
    result, events = await run(budget_stack, "one-step", TWO_STEPS)
    assert set(result["steps"]) == {"totals"}
    assert events[-1]["type"] == "run.completed"
    assert events[-1]["payload"]["reason"] == "budget_exhausted"
    exhausted = next(e for e in events if e["type"] == "budget.exhausted")
    assert exhausted["payload"]["spent"] == ["max_steps 1 reached"]
    artifact = next(e for e in events if e["type"] == "artifact")
    assert "not run: outliers" in artifact["payload"]["text"]
    assert not any(e["type"] == "step.started" and e["payload"]["step"] == "outliers" for e in events)


async def test_policy_can_grant_a_new_tranche_before_closing(budget_stack: Stack) -> None:
    chain = {
        "steps": [
            {"id": name, "skill": "sql-query", "input": {"sql": f"SELECT {n} AS n"}, "after": after}
            for n, (name, after) in enumerate((("a", []), ("b", ["a"]), ("c", ["b"])))
        ]
    }
    result, events = await run(budget_stack, "two-tranches", chain)
    assert set(result["steps"]) == {"a", "b"}
    assert [e["payload"]["tranche"] for e in events if e["type"] == "budget.tranche"] == [1]
    assert events[-1]["payload"]["reason"] == "budget_exhausted"


async def test_the_same_call_a_third_time_degrades_gracefully(budget_stack: Stack) -> None:
    result, events = await run(budget_stack, "acme", SAME_CALL_THRICE)
    assert set(result["steps"]) == {"a", "b"}
    assert events[-1]["payload"]["reason"] == "non_converging"
    degraded = next(e for e in events if e["type"] == "run.degraded")
    assert degraded["payload"]["why"] == "the same call 3 times"


async def test_too_many_calls_in_one_turn_is_not_converging(budget_stack: Stack) -> None:
    wide = {
        "steps": [
            {"id": f"q{i}", "skill": "sql-query", "input": {"sql": f"SELECT {i} AS n"}} for i in range(3)
        ]
    }
    result, events = await run(budget_stack, "acme", wide)
    assert result["steps"] == {}
    assert events[-1]["payload"]["reason"] == "non_converging"
    assert not any(e["type"] == "operation.intent" for e in events)


async def test_within_its_limits_a_run_is_not_stopped(budget_stack: Stack) -> None:
    result, events = await run(budget_stack, "acme", TWO_STEPS)
    assert set(result["steps"]) == {"totals", "outliers"}
    assert "reason" not in events[-1]["payload"]
