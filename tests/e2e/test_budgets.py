"""The mission budget, convergence limits and activity lease, from policy: a run that spends its
budget gets a new tranche, stops with the best result so far, or asks a person (who may not answer in
time); a run that repeats itself stops as non-converging; a quiet call wakes a supervisor that renews,
escalates or asks instead of killing it.

One stack, with the shipped policy bundle plus per-tenant budgets that only these tests use.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fleetctl.testing.e2e import (
    TWO_STEPS,
    Stack,
    all_events,
    clean_env,
    fleet,
    send,
    start_stack,
    stop_stack,
    user_message,
)
from policy import DEFAULT_BUNDLE_DIR
from tests.e2e.run_helpers import count_rows, events_so_far, get_run, operations, table_locked

pytestmark = pytest.mark.e2e

TENANT_BUDGETS = {
    "one-step": {"max_steps": 1, "on_exhausted": "summarize"},
    "two-tranches": {"max_steps": 1, "on_exhausted": "tranche", "max_tranches": 1},
    "ask": {"max_steps": 1, "on_exhausted": "ask"},
    "ask-expires": {
        "max_steps": 1,
        "on_exhausted": "ask",
        "ask": {"timeout_s": 3, "warn_before_s": 2, "on_expired": "expire"},
    },
    "quiet": {"activity": {"quiet_after_s": 1, "max_renewals": 2, "on_stuck": "escalate"}},
    "quiet-ask": {"activity": {"quiet_after_s": 1, "max_renewals": 2, "on_stuck": "ask"}},
}

# Three steps, each after the one before, each a different query.
CHAIN: dict[str, Any] = {
    "steps": [
        {"id": name, "skill": "sql-query", "input": {"sql": f"SELECT {n} AS n"}, "after": after}
        for n, (name, after) in enumerate((("a", []), ("b", ["a"]), ("c", ["b"])))
    ]
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
    env = clean_env(FLEET_POLICY_DIR=str(bundle), FLEET_SWEEP_INTERVAL_S="0.5")
    stack = start_stack(tmp_path_factory.mktemp("stack"), env=env)
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
    result, events = await run(budget_stack, "two-tranches", CHAIN)
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


async def until_waiting(stack: Stack, run_id: str, token: str, times: int) -> dict[str, Any]:
    """The run, once it has gone to ``waiting`` ``times`` times and waits."""
    async with asyncio.timeout(60):
        while True:
            events = await events_so_far(stack, run_id, token)
            if sum(e["type"] == "run.waiting" for e in events) >= times:
                run = await get_run(stack, run_id, token)
                if run["state"] == "waiting":
                    return run
            await asyncio.sleep(0.2)


def decide(stack: Stack, tenant: str, run_id: str, *args: str) -> Any:
    return fleet(
        "runs", "decide", "--data-dir", stack.data_dir, "--tenant", tenant, run_id, *args, timeout=60
    )


async def test_a_person_decides_on_a_spent_budget_a_new_tranche_then_a_close(budget_stack: Stack) -> None:
    token = budget_stack.token("coordinator", tenant="ask")
    outcome = await send(budget_stack, user_message(data=CHAIN), token=token)
    # The caller is told the run needs someone; no process holds it.
    assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
    run_id = outcome.task_id
    run = await until_waiting(budget_stack, run_id, token, 1)
    wait = run["wait"]
    assert (wait["type"], wait["awaited"]) == ("budget", "budget:0")
    assert wait["deadline"] > wait["since"]
    assert "max_steps 1 reached" in wait["detail"]["why"]

    # A caller without the scope is refused; a decision that is not one is refused, with its code.
    async with httpx.AsyncClient(timeout=30) as http:
        url = f"{budget_stack.endpoints['coordinator']}/v1/runs/{run_id}/decision"
        refused = await http.post(
            url, headers={"Authorization": f"Bearer {token}"}, json={"decision": "tranche"}
        )
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "forbidden")
        operator = budget_stack.token("coordinator", tenant="ask", scopes=("agent:invoke", "runs:resolve"))
        for bad in ({"decision": "approve"}, {"decision": "close", "limits": {"max_steps": 3}}):
            invalid = await http.post(url, headers={"Authorization": f"Bearer {operator}"}, json=bad)
            assert (invalid.status_code, invalid.json()["error"]["code"]) == (400, "invalid_request")
    assert (await get_run(budget_stack, run_id, token))["state"] == "waiting"  # nothing was lost

    granted = await asyncio.to_thread(decide, budget_stack, "ask", run_id, "tranche", "--note", "one more")
    assert granted.returncode == 0, granted.stderr
    second = await until_waiting(budget_stack, run_id, token, 2)
    assert second["wait"]["awaited"] == "budget:1"  # a new ask: the first answer does not answer it

    closed = await asyncio.to_thread(decide, budget_stack, "ask", run_id, "close", "--note", "enough")
    assert closed.returncode == 0, closed.stderr
    events = await all_events(budget_stack, run_id, token)
    assert events[-1]["type"] == "run.completed"
    assert events[-1]["payload"]["reason"] == "budget_exhausted"
    answers = [e for e in events if e["type"] == "wait.answered"]
    assert [(a["payload"]["decision"], a["payload"]["note"]) for a in answers] == [
        ("tranche", "one more"),
        ("close", "enough"),
    ]
    assert all(a["actor"] == answers[0]["payload"]["by"] != "" for a in answers)
    assert [e["payload"]["by"] for e in events if e["type"] == "budget.tranche"] == [answers[0]["actor"]]
    artifact = next(e for e in events if e["type"] == "artifact")
    assert set(artifact["payload"]["steps"]) == {"a", "b"}

    # The run no longer waits: a late decision is refused, not applied.
    late = await asyncio.to_thread(decide, budget_stack, "ask", run_id, "tranche")
    assert late.returncode == 1
    assert "conflict" in late.stderr


async def test_a_budget_decision_nobody_makes_expires_and_is_not_a_denial(budget_stack: Stack) -> None:
    token = budget_stack.token("coordinator", tenant="ask-expires")
    outcome = await send(budget_stack, user_message(data=CHAIN), token=token)
    assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
    async with asyncio.timeout(60):
        events = await all_events(budget_stack, outcome.task_id, token)
    types = [e["type"] for e in events]
    assert types.index("run.waiting") < types.index("wait.deadline_near") < types.index("wait.expired")
    assert types.count("wait.deadline_near") == 1
    assert "budget.expired" in types and "run.rejected" not in types
    assert events[-1]["type"] == "run.failed"
    assert events[-1]["payload"]["reason"] == "approval_expired"
    expired = next(e for e in events if e["type"] == "wait.expired")
    assert expired["actor"] == "supervisor"
    deadline = next(e for e in events if e["type"] == "run.waiting")["payload"]["wait"]["deadline"]
    assert next(e for e in events if e["type"] == "budget.expired")["payload"]["deadline"] == deadline


# One review case, opened through the keyed cases tool (which a test can make hang).
ONE_CASE: dict[str, Any] = {
    "steps": [
        {
            "id": "cases",
            "skill": "open-review-cases",
            "input": {"records": [{"label": "INV-7"}], "label": "label", "reason": "quiet"},
        }
    ]
}


async def test_a_quiet_call_wakes_a_supervisor_that_renews_then_escalates_and_never_kills_it(
    budget_stack: Stack,
) -> None:
    token = budget_stack.token("coordinator", tenant="quiet")
    async with table_locked(budget_stack, "cases"):  # the tool call hangs; the agent is silent
        sending = asyncio.create_task(send(budget_stack, user_message(data=ONE_CASE), token=token))
        async with asyncio.timeout(60):
            while True:
                runs = await list_runs(budget_stack, token)
                events = await events_so_far(budget_stack, runs[0]["run_id"], token) if runs else []
                if any(e["type"] == "run.escalated" for e in events):
                    break
                await asyncio.sleep(0.3)
    outcome = await sending
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    events = await all_events(budget_stack, outcome.task_id, token)
    renewals = [e["payload"]["renewals"] for e in events if e["type"] == "step.renewed"]
    assert renewals[:2] == [1, 2]
    escalated = [e for e in events if e["type"] == "run.escalated"]
    assert len(escalated) == 1 and escalated[0]["payload"]["step"] == "cases"
    # The call was waited for, not killed and not sent again: one case, one send.
    assert await count_rows(budget_stack, "cases", "tenant_id = %s", "quiet") == 1
    assert sum(e["type"] == "operation.intent" for e in events) == 1
    assert not any(e["type"] == "operation.retry" for e in events)


async def test_a_stuck_call_can_be_handed_to_a_person_who_has_it_reconciled(budget_stack: Stack) -> None:
    token = budget_stack.token("coordinator", tenant="quiet-ask")
    async with table_locked(budget_stack, "cases"):
        outcome = await send(budget_stack, user_message(data=ONE_CASE), token=token)
        assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
        run = await until_waiting(budget_stack, outcome.task_id, token, 1)
    assert run["wait"]["type"] == "needs_human"
    (op,) = await operations(budget_stack, outcome.task_id, token)
    assert op["status"] == "needs_human"
    assert "quiet" in op["error"]["message"]
    # The lock is gone, the tool finishes the case; a person asks the coordinator to check again.
    resolved = await asyncio.to_thread(
        fleet,
        "runs",
        "resolve",
        "--data-dir",
        budget_stack.data_dir,
        "--tenant",
        "quiet-ask",
        outcome.task_id,
        op["op_id"],
        "retry",
        timeout=60,
    )
    assert resolved.returncode == 0, resolved.stderr
    events = await all_events(budget_stack, outcome.task_id, token)
    assert events[-1]["type"] == "run.completed"
    (op,) = await operations(budget_stack, outcome.task_id, token)
    assert op["status"] == "succeeded"
    assert await count_rows(budget_stack, "cases", "tenant_id = %s", "quiet-ask") == 1


async def list_runs(stack: Stack, token: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs", headers={"Authorization": f"Bearer {token}"}
        )
    response.raise_for_status()
    runs: list[dict[str, Any]] = response.json()["runs"]
    return runs


async def test_an_event_wait_that_times_out_goes_on_without_an_event(budget_stack: Stack) -> None:
    plan = {"steps": [{"id": "gate", "wait": {"event": "fleet.events.never.comes", "timeout_s": 2}}]}
    token = budget_stack.token("coordinator", tenant="acme")
    async with asyncio.timeout(60):
        outcome = await send(budget_stack, user_message(data=plan), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert outcome.result["steps"]["gate"] == {"event": None, "expired": True}
    events = await all_events(budget_stack, outcome.task_id, token)
    expired = next(e for e in events if e["type"] == "wait.expired")
    assert expired["actor"] == "supervisor" and "no event came" in expired["payload"]["text"]


async def test_a_timer_step_parks_the_run_and_fires_from_the_database_after_a_worker_died(
    budget_stack: Stack,
) -> None:
    """(Last in this module: it kills a worker of the shared stack.)"""
    plan = {
        "steps": [
            {"id": "before", "skill": "sql-query", "input": {"sql": "SELECT 11 AS n"}},
            {"id": "pause", "wait": {"for_s": 3}, "after": ["before"]},
            {"id": "after", "skill": "sql-query", "input": {"sql": "SELECT 12 AS n"}, "after": ["pause"]},
        ]
    }
    token = budget_stack.token("coordinator", tenant="acme")
    sending = asyncio.create_task(send(budget_stack, user_message(data=plan), token=token))
    async with asyncio.timeout(60):
        while True:
            runs = await list_runs(budget_stack, token)
            run = runs[0] if runs else {}
            if run.get("state") == "waiting":
                break
            await asyncio.sleep(0.1)
    assert run["wait"]["type"] == "timer" and run["wait"]["awaited"] == "timer:pause"
    # Nothing holds the run while it waits: the workers may die; the timer is a row, not a process.
    os.kill(budget_stack.endpoints["processes"]["worker-1"], signal.SIGKILL)
    outcome = await sending  # the stream stays open: a timer is not a wait for anyone
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    events = await all_events(budget_stack, outcome.task_id, token)
    types = [e["type"] for e in events]
    assert types.index("run.waiting") < types.index("timer.due") < types.index("timer.fired")
    assert next(e for e in events if e["type"] == "timer.due")["actor"] == "supervisor"
    pause = outcome.result["steps"]["pause"]
    assert pause["fired_at"] >= pause["due"]
    assert set(outcome.result["steps"]) == {"before", "pause", "after"}
