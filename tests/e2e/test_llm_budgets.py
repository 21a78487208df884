"""The agent loop under the fleet's policy, end to end: ``fleet up`` with a scripted model and a
policy bundle whose loop limits and prices differ by tenant and agent. A model that repeats a call,
floods tokens or answers 429 is stopped, summarizes or is throttled as its tenant's policy says,
with the reason, and the step before it keeps its result; what each task spent is on its operation,
priced by policy; a fan-out is sent only as far as the run's token budget covers it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import expect
from prometheus_client.parser import text_string_to_metric_families

from fleetctl.testing.e2e import (
    FAST_METRICS,
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
from specialists.llm import SUMMARIZE
from tests.e2e.browser import launched, signed_in
from tests.e2e.run_helpers import operations, run_when
from tests.llm_script import ScriptedModel, call, rate_limited, say, scripted_model_thread

pytestmark = pytest.mark.e2e

MODEL = "scripted"
RECALL = {"query": "Fabrikam", "limit": 3}
ANSWER = {"query": "Fabrikam", "memories": []}
LOOP_TENANTS = {
    "stops": {"on_stuck": "stop", "on_spent": "stop"},
    "summarizes": {"on_stuck": "summarize"},
    "pays": {"max_cost_usd": 1.0, "on_spent": "stop"},
    "throttled": {"rate_limit_retries": 1, "rate_limit_max_wait_s": 5, "on_spent": "stop"},
    "tight": {"max_llm_tokens": 100},
    "asks": {"on_stuck": "ask"},
    "reviewed": {"on_stuck": "review"},
    "endless": {"max_turns": 3, "on_spent": "stop"},
}
# The researcher's own loop: the same call twice is already not converging (tenants above win).
LOOP_AGENTS = {"researcher": {"repeat_limit": 2}}
PRICES = {MODEL: {"input_per_mtok": 30.0, "output_per_mtok": 150.0}}
BUDGETS = {"tight": {"max_llm_tokens": 250, "on_exhausted": "summarize"}}

# A step with no model, then the researcher's recall, which its agent loop runs.
FIRST_THEN_RECALL = {
    "steps": [
        {"id": "first", "skill": "sql-query", "input": {"sql": "SELECT 1 AS one"}},
        {"id": "ask", "skill": "recall", "input": RECALL, "after": ["first"]},
    ]
}


RECALL_FLOW = """
from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from coordinator.engine.workflows import delegate


class Found(TypedDict, total=False):
    query: str
    found: list[Any]


async def recall_three(state: Found) -> Found:
    found = [await delegate("recall", {"query": state["query"], "limit": n}) for n in (1, 2, 3)]
    return {"found": found}


def build() -> StateGraph:
    graph = StateGraph(Found)
    graph.add_node("recall_three", recall_three)
    graph.add_edge(START, "recall_three")
    graph.add_edge("recall_three", END)
    return graph
"""


@pytest.fixture(scope="module")
def fleet_and_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, ScriptedModel]]:
    bundle = tmp_path_factory.mktemp("policy") / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    data["config"]["loop"]["tenants"] = LOOP_TENANTS
    data["config"]["loop"]["agents"] = LOOP_AGENTS
    data["config"]["models"]["prices"] = PRICES
    data["config"]["budgets"]["tenants"] = BUDGETS
    data["config"]["registry"]["skills"]["identities"]["coordinator"] = ["workflow:recalls"]
    (bundle / "data.json").write_text(json.dumps(data))
    # A workflow of three recalls, one after another (importable by the workers: on their path).
    flows = tmp_path_factory.mktemp("flows")
    (flows / "recall_flow.py").write_text(RECALL_FLOW)
    with scripted_model_thread() as model:
        env = clean_env(
            PYTHONPATH=os.pathsep.join(p for p in (str(flows), os.environ.get("PYTHONPATH", "")) if p),
            FLEET_WORKFLOWS=json.dumps({"recalls": "recall_flow:build"}),
            FLEET_LLM_BASE_URL=model.base_url,
            FLEET_LLM_MODEL=MODEL,
            FLEET_LLM_API_KEY="sk-test",
            FLEET_POLICY_DIR=str(bundle),
            **FAST_METRICS,
        )
        stack = start_stack(tmp_path_factory.mktemp("stack"), env)
        try:
            yield stack, model
        finally:
            stop_stack(stack)


async def _run(
    stack: Stack, tenant: str, plan: dict[str, Any]
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    token = stack.token("coordinator", tenant=tenant)
    outcome = await send(stack, user_message(data=plan), token=token)
    events = await all_events(stack, outcome.task_id, token)
    ops = {op["step_id"]: op for op in await operations(stack, outcome.task_id, token)}
    return outcome, events, ops


def _recall(limit: int = 3, usage: int = 10) -> Any:
    return call("mcp-memory__recall", {**RECALL, "limit": limit}, usage=usage)


async def test_a_repeated_call_is_stopped_by_the_tenants_policy_and_the_step_before_keeps_its_result(
    fleet_and_model: tuple[Stack, ScriptedModel], tmp_path: Path
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    model.replies[:] = [_recall(), _recall(), say(json.dumps(ANSWER))]
    outcome, events, ops = await _run(stack, "stops", FIRST_THEN_RECALL)
    assert outcome.state_name == "TASK_STATE_FAILED", outcome.final_text
    failed = next(e for e in events if e["type"] == "step.failed")
    assert failed["payload"]["step"] == "ask"
    cause = failed["payload"]["cause"]
    assert cause["code"] == "non_converging" and cause["details"]["reason"] == "repeated_call"
    assert len(model.requests) == 2  # the second, repeated call was never made: the loop stopped
    # The step before kept its result; the stopped one says what it spent and why it stopped.
    assert ops["first"]["status"] == "succeeded"
    usage = ops["ask"]["usage"]
    assert (usage["stopped"], usage["tool_calls"], usage["llm_calls"]) == ("repeated_call", 1, 2)
    assert usage["models"] == [MODEL]
    # The debug bundle: the last request the failed loop sent, as sent (redacted), the tokens
    # attributed in EXPLAIN.md, and the run as a trace with what the operation spent.
    bundle = tmp_path / "bundle"
    exported = await asyncio.to_thread(
        fleet,
        "runs",
        "export",
        outcome.task_id,
        str(bundle),
        "--tenant",
        "stops",
        "--data-dir",
        stack.data_dir,
    )
    assert exported.returncode == 0, exported.stderr
    (request,) = [json.loads(line) for line in (bundle / "model_requests.jsonl").read_text().splitlines()]
    assert request["step_id"] == "ask" and request["target"] == AGENT
    assert request["request"]["messages"] == model.requests[-1]["messages"]  # the one the model got
    assert request["request"]["tools"] == [t["function"]["name"] for t in model.requests[-1]["tools"]]
    explained = (bundle / "EXPLAIN.md").read_text()
    assert "## Tokens" in explained and "repeated_call" in explained
    assert "went to repeating 1 call(s) already made: `mcp-memory__recall` x1" in explained
    spans = json.loads((bundle / "trace.json").read_text())["spans"]
    (operation,) = [
        s for s in spans if s["name"].startswith("operation") and s["attributes"]["fleet.step"] == "ask"
    ]
    assert operation["attributes"]["fleet.usage"]["llm_calls"] == 2 and operation["status"] == "error"


async def test_another_tenant_has_the_stuck_loop_summarize_and_the_run_completes(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    model.replies[:] = [_recall(), _recall(), say(json.dumps(ANSWER))]
    outcome, _, ops = await _run(stack, "summarizes", FIRST_THEN_RECALL)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert outcome.result["steps"]["ask"] == ANSWER
    last = model.requests[-1]
    assert "tools" not in last
    assert last["messages"][-1]["content"] == SUMMARIZE.format(
        why="the model called mcp-memory__recall with the same arguments 2 times"
    )
    usage = ops["ask"]["usage"]
    assert (usage["stopped"], usage["summarized"], usage["llm_calls"]) == ("repeated_call", True, 3)


async def test_a_model_that_floods_tokens_is_stopped_by_what_they_cost(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    # 10,000 tokens in and out: $0.30 + $1.50 = $1.80 for one turn, past the tenant's $1.00 a task.
    model.replies[:] = [_recall(usage=20_000), say(json.dumps(ANSWER))]
    outcome, events, ops = await _run(stack, "pays", FIRST_THEN_RECALL)
    assert outcome.state_name == "TASK_STATE_FAILED", outcome.final_text
    cause = next(e for e in events if e["type"] == "step.failed")["payload"]["cause"]
    assert cause["code"] == "budget_exhausted" and cause["details"]["reason"] == "cost"
    assert len(model.requests) == 1
    usage = ops["ask"]["usage"]
    assert usage["cost_usd"] == pytest.approx(1.8) and usage["tool_calls"] == 0
    assert (usage["tokens_in"], usage["tokens_out"]) == (10_000, 10_000)
    assert ops["first"]["status"] == "succeeded"


async def test_a_model_that_never_stops_is_stopped_at_its_tenants_turns_and_the_step_before_is_kept(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    # A new recall every turn, never an answer: three turns, then the tenant's policy stops it.
    model.replies[:] = [_recall(limit=n) for n in range(1, 7)]
    outcome, events, ops = await _run(stack, "endless", FIRST_THEN_RECALL)
    assert outcome.state_name == "TASK_STATE_FAILED", outcome.final_text
    cause = next(e for e in events if e["type"] == "step.failed")["payload"]["cause"]
    assert (cause["code"], cause["details"]["reason"]) == ("budget_exhausted", "max_turns")
    assert len(model.requests) == 3
    assert ops["first"]["status"] == "succeeded" and ops["ask"]["usage"]["tool_calls"] == 3


async def test_a_model_that_keeps_answering_429_throttles_the_task_with_the_reason(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    model.replies[:] = [rate_limited("0"), rate_limited("0"), say(json.dumps(ANSWER))]
    outcome, events, ops = await _run(stack, "throttled", FIRST_THEN_RECALL)
    assert outcome.state_name == "TASK_STATE_FAILED", outcome.final_text
    cause = next(e for e in events if e["type"] == "step.failed")["payload"]["cause"]
    assert (cause["code"], cause["retryable"], cause["details"]["reason"]) == (
        "llm_rate_limited",
        True,
        "rate_limited",
    )
    assert len(model.requests) == 2
    usage = ops["ask"]["usage"]
    assert (usage["rate_limited"], usage["llm_retries"], usage.get("llm_calls", 0)) == (2, 1, 0)


async def test_a_fan_out_is_sent_only_as_far_as_the_runs_token_budget_covers_it(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    # Four recalls at once, each task capped at 100 tokens by its loop, the run at 250: two are
    # sent, then one with what is left; each spends 100, and the fourth is never sent.
    model.replies[:] = [say(json.dumps(ANSWER), usage=100) for _ in range(4)]
    wide = {
        "steps": [{"id": f"r{n}", "skill": "recall", "input": {**RECALL, "limit": n + 1}} for n in range(4)]
    }
    outcome, events, ops = await _run(stack, "tight", wide)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert sorted(ops) == ["r0", "r1", "r2"]
    exhausted = next(e for e in events if e["type"] == "budget.exhausted")
    assert exhausted["payload"]["spent"] == ["max_llm_tokens 250 reached"]
    order = [e["type"] for e in events if e["type"] in ("operation.intent", "operation.succeeded")]
    assert order[:2] == ["operation.intent", "operation.intent"]  # the first turn: two at once
    assert order.index("operation.intent", 2) > 2  # the third only after one of them ended
    assert len(model.requests) == 3
    caps = sorted(r.get("max_tokens", 0) for r in model.requests)
    assert caps[0] == 50  # the third was sent with what was left (250 - 200), and asked to keep to it


async def test_a_batch_round_is_sent_only_as_far_as_the_runs_token_budget_covers_it(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    # One batch step over six items, a call each: its round would make six calls at once. Each call
    # reserves its loop's 100 tokens against the run's 250: two go, then one with what is left.
    model.replies[:] = [say(json.dumps(ANSWER), usage=100) for _ in range(6)]
    batch = {
        "steps": [
            {
                "id": "each",
                "skill": "recall",
                "input": RECALL,
                "for_each": list(range(6)),
                "batch": {"call_size": 1, "checkpoint_every": 6},
            }
        ]
    }
    outcome, events, ops = await _run(stack, "tight", batch)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert sorted(ops) == ["each@0", "each@1", "each@2"]
    exhausted = next(e for e in events if e["type"] == "budget.exhausted")
    assert exhausted["payload"]["spent"] == ["max_llm_tokens 250 reached"]
    assert len(model.requests) == 3
    caps = sorted(r.get("max_tokens", 0) for r in model.requests)
    assert caps[0] == 50  # the third call was sent with what was left, and asked to keep to it
    # What the calls spent is the run's: each operation says it, and the budget counted it.
    assert all(ops[op]["usage"]["llm_tokens"] == 100 for op in ops), ops


async def test_a_workflows_calls_share_one_reservation_and_the_run_counts_what_they_spent(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    # The workflow's three calls share what is left of the run's 250 tokens (each call also held
    # to its loop's 100): 100, 100, then 50 left. What they spent is the run's, so the step after
    # the workflow finds the budget spent and is never sent.
    model.replies[:] = [say(json.dumps(ANSWER), usage=100) for _ in range(4)]
    flow = {
        "steps": [
            {"id": "wf", "skill": "workflow:recalls", "input": {"query": "Fabrikam"}},
            {"id": "after", "skill": "recall", "input": RECALL, "after": ["wf"]},
        ]
    }
    outcome, events, ops = await _run(stack, "tight", flow)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert len(model.requests) == 3 and all(op.startswith("wf.") for op in ops), sorted(ops)
    caps = [r.get("max_tokens", 0) for r in model.requests]
    assert caps[2] == 50, caps  # the third call was sent with what the first two left
    exhausted = next(e for e in events if e["type"] == "budget.exhausted")
    assert exhausted["payload"]["spent"] == ["max_llm_tokens 250 reached"]


AGENT = "researcher"


async def _agent_metrics(stack: Stack) -> dict[str, float]:
    """The fleet_agent_* samples of the researcher, summed over the workers that count them."""
    totals: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for name, url in stack.endpoints["services"].items():
            if not name.startswith("worker-"):
                continue
            text = (await http.get(url + "/metrics")).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name.startswith("fleet_agent_") and sample.labels.get("agent") == AGENT:
                        key = sample.name + "".join(
                            f"|{v}" for k, v in sorted(sample.labels.items()) if k != "agent"
                        )
                        totals[key] = totals.get(key, 0.0) + sample.value
    return totals


async def _console_agents(http: httpx.AsyncClient, stack: Stack) -> dict[str, Any]:
    found = (await http.get(f"{stack.endpoints['console']}/api/metrics", params={"window": "15m"})).json()
    total: dict[str, Any] = found["agents"].get(AGENT, {}).get("total", {})
    return total


async def _console(stack: Stack) -> httpx.AsyncClient:
    result = await asyncio.to_thread(
        fleet, "console", "--data-dir", stack.data_dir, "--tenant", "acme", "--json"
    )
    assert result.returncode == 0, result.stderr
    token = json.loads(result.stdout)["sign_in"].split("#token=", 1)[1]
    http = httpx.AsyncClient(timeout=30)
    signed = await http.post(
        f"{stack.endpoints['console']}/session",
        headers={"authorization": f"Bearer {token}", "x-fleet-console": "1"},
    )
    assert signed.status_code == 200, signed.text
    return http


async def test_the_metrics_and_the_console_move_by_exactly_what_the_scripted_models_did(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    console = await _console(stack)
    try:
        before = await _agent_metrics(stack)
        # The console's window holds what the workers' snapshots brought in: wait until it holds
        # what the tests before this one spent (a snapshot still on its way would count below).
        async with asyncio.timeout(60):
            while True:
                shown_before = await _console_agents(console, stack)
                if shown_before.get("tokens_in", 0) >= before.get("fleet_agent_llm_tokens_total|in", 0):
                    break
                await asyncio.sleep(0.5)
        # Three completions of 40, 60 and 100 tokens (half in, half out): 100 in, 100 out, two tool
        # calls; at $30 and $150 a million, $0.018. Then a loop stopped for repeating a call.
        model.replies[:] = [_recall(usage=40), _recall(limit=2, usage=60), say(json.dumps(ANSWER), usage=100)]
        metered, _, _ = await _run(
            stack, "acme", {"steps": [{"id": "ask", "skill": "recall", "input": RECALL}]}
        )
        assert metered.state_name == "TASK_STATE_COMPLETED", metered.final_text
        model.replies[:] = [_recall(), _recall()]
        stopped, _, _ = await _run(
            stack, "stops", {"steps": [{"id": "ask", "skill": "recall", "input": RECALL}]}
        )
        assert stopped.state_name == "TASK_STATE_FAILED"
        after = await _agent_metrics(stack)

        def moved(key: str) -> float:
            return round(after.get(key, 0.0) - before.get(key, 0.0), 6)

        assert moved("fleet_agent_llm_tokens_total|in") == 100 + 10  # the stopped loop's two turns: 5 + 5 in
        assert moved("fleet_agent_llm_tokens_total|out") == 100 + 10
        assert moved("fleet_agent_llm_cost_usd_total") == pytest.approx(0.018 + 10 * 30e-6 + 10 * 150e-6)
        assert moved("fleet_agent_tool_calls_total") == 2 + 1
        assert moved("fleet_agent_llm_request_duration_seconds_count") == 3 + 2
        assert moved("fleet_agent_loop_stops_total|repeated_call") == 1
        assert moved("fleet_agent_slow_tool_calls_total") == 0
        # The console's table of this window shows the same, once the workers' snapshots are in.
        async with asyncio.timeout(60):
            while True:
                shown = await _console_agents(console, stack)
                if shown.get("tokens_in", 0) - shown_before.get("tokens_in", 0) >= 110:
                    break
                await asyncio.sleep(0.5)
        assert shown["tokens_in"] - shown_before.get("tokens_in", 0) == 110
        assert shown["tokens_out"] - shown_before.get("tokens_out", 0) == 110
        assert shown["cost_usd"] - shown_before.get("cost_usd", 0) == pytest.approx(0.0198)
        assert (
            shown["stops"].get("repeated_call", 0) - shown_before.get("stops", {}).get("repeated_call", 0)
            == 1
        )
        assert shown["llm_calls"] - shown_before.get("llm_calls", 0) == 5

        # Under a review policy the same stuck loop goes to the reviewer, which finds it stuck (the
        # same answer again): its verdict is counted, and the step fails with it.
        model.replies[:] = [_recall(), _recall()]
        reviewed, _, _ = await _run(
            stack, "reviewed", {"steps": [{"id": "ask", "skill": "recall", "input": RECALL}]}
        )
        assert reviewed.state_name == "TASK_STATE_FAILED"
        assert "the reviewer found it stuck" in reviewed.final_text
        again = await _agent_metrics(stack)
        assert (
            again.get("fleet_agent_loop_reviews_total|stop", 0)
            - after.get("fleet_agent_loop_reviews_total|stop", 0)
            == 1
        )
        assert again.get("fleet_agent_loop_reviews_total|continue", 0) == after.get(
            "fleet_agent_loop_reviews_total|continue", 0
        )
    finally:
        await console.aclose()


async def test_the_console_shows_tokens_and_cost_per_agent(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.replies[:] = [_recall(usage=400), say(json.dumps(ANSWER), usage=600)]
    done, _, _ = await _run(stack, "acme", {"steps": [{"id": "ask", "skill": "recall", "input": RECALL}]})
    assert done.state_name == "TASK_STATE_COMPLETED", done.final_text
    async with launched() as browser:
        page = await signed_in(stack, browser, "acme", height=1400)
        await page.goto(f"{stack.endpoints['console']}/#/activity/15m")
        row = page.locator(f'[data-testid="agent-usage"] tr[data-agent="{AGENT}"]')
        await expect(row).to_be_visible(timeout=60_000)
        # At least this test's 500 tokens each way, at $30 and $150 a million: $0.09 (other tests of
        # the module may have spent more in the window).
        await page.wait_for_function(
            """(agent) => {
                const cell = document.querySelector(`[data-agent="${agent}"] [data-col="tokens_in"]`);
                return cell !== null && Number(cell.textContent) >= 500;
            }""",
            arg=AGENT,
            timeout=60_000,
        )
        cost = float(await row.locator('[data-col="cost_usd"]').get_attribute("data-value") or 0)
        assert cost >= 0.09
        await expect(
            page.locator('[data-testid="chart-agent-tokens"] [data-series="researcher"]')
        ).to_be_visible()


async def test_a_stuck_loop_asks_a_person_who_lets_it_continue_from_its_notes(
    fleet_and_model: tuple[Stack, ScriptedModel],
) -> None:
    stack, model = fleet_and_model
    model.requests.clear()
    # Stuck on the same recall: the tenant's policy asks a person. Allowed to go on, the loop gets
    # its notes back and a new allowance: the same recall once more, then its answer.
    model.replies[:] = [_recall(), _recall(), _recall(), say(json.dumps(ANSWER))]
    token = stack.token("coordinator", tenant="asks", scopes=("agent:invoke", "runs:approve"))
    asked = await send(stack, user_message(data=FIRST_THEN_RECALL), token=token)
    assert asked.state_name == "TASK_STATE_INPUT_REQUIRED", asked.final_text
    waiting = await run_when(stack, asked.task_id, token, "waiting")
    assert (
        waiting["wait"]["type"] == "input"
        and "the same arguments 2 times" in waiting["wait"]["detail"]["why"]
    )
    answer = {"action": "input", "input": {"decision": "continue"}, "awaited": waiting["wait"]["awaited"]}
    async with httpx.AsyncClient(timeout=30) as http:
        signaled = await http.post(
            f"{stack.endpoints['coordinator']}/v1/runs/{asked.task_id}/signals",
            json=answer,
            headers={"Authorization": f"Bearer {token}"},
        )
    assert signaled.status_code == 200 and signaled.json()["applied"], signaled.text
    done = await run_when(stack, asked.task_id, token, "completed", "failed")
    assert done["state"] == "completed", done
    resumed = model.requests[2]["messages"]
    assert any(m["role"] == "user" and "progress notes" in m["content"] for m in resumed)
    ops = await operations(stack, asked.task_id, token)
    answered = [op for op in ops if op["step_id"].startswith("ask~")]
    assert len(answered) == 1 and answered[0]["usage"]["resumed"] is True
