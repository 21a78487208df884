"""Runs seen through the run API: the event log of a real run, resumable SSE, tenancy."""

from __future__ import annotations

import asyncio
import csv
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetctl.testing.e2e import TWO_STEPS, Stack, fleet, send, user_message

pytestmark = pytest.mark.e2e


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        events.append({"id": int(fields["id"]), "event": fields["event"], **json.loads(fields["data"])})
    return events


async def read_events(
    stack: Stack, run_id: str, token: str, last_event_id: int | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.get(f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/events", headers=headers)


async def test_a_run_records_every_transition_and_step_in_a_gap_free_log(stack: Stack) -> None:
    token = stack.token("coordinator")
    outcome = await send(stack, user_message(data=TWO_STEPS), token=token)
    response = await read_events(stack, outcome.task_id, token)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert [e["id"] for e in events] == [e["seq"] for e in events]
    types = [e["type"] for e in events]
    assert types[:2] == ["run.submitted", "run.working"]
    assert [s["skill"] for s in events[0]["payload"]["steps"]] == ["invoice-totals", "outliers"]  # the plan
    assert all("input" not in s for s in events[0]["payload"]["steps"])  # its inputs are on the run
    assert types[-2:] == ["artifact", "run.completed"]
    steps = [
        (e["type"], e["payload"]["step"]) for e in events if e["type"] in ("step.started", "step.completed")
    ]
    assert steps == [
        ("step.started", "totals"),
        ("step.completed", "totals"),
        ("step.started", "outliers"),
        ("step.completed", "outliers"),
    ]
    assert all(e["run_id"] == outcome.task_id for e in events)


async def test_reconnecting_with_the_last_event_id_gives_exactly_the_missed_events(stack: Stack) -> None:
    token = stack.token("coordinator")
    outcome = await send(stack, user_message(data=TWO_STEPS), token=token)
    everything = parse_sse((await read_events(stack, outcome.task_id, token)).text)
    resumed = parse_sse((await read_events(stack, outcome.task_id, token, last_event_id=4)).text)
    assert resumed == everything[4:]


async def test_a_failed_run_ends_failed_with_its_reason(stack: Stack) -> None:
    token = stack.token("coordinator")
    steps = {"steps": [{"skill": "sql-query", "input": {"sql": "DELETE FROM tenant_data.invoices"}}]}
    outcome = await send(stack, user_message(data=steps), token=token)
    events = parse_sse((await read_events(stack, outcome.task_id, token)).text)
    assert events[-1]["type"] == "run.failed"
    assert events[-1]["payload"]["reason"] == "specialist_failed"
    async with httpx.AsyncClient() as http:
        run = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs/{outcome.task_id}",
            headers={"Authorization": f"Bearer {token}"},
        )
    assert (run.json()["state"], run.json()["reason"]) == ("failed", "specialist_failed")


async def test_runs_are_visible_only_to_their_tenant(stack: Stack) -> None:
    outcome = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator"))
    other = stack.token("coordinator", tenant="globex")
    assert (await read_events(stack, outcome.task_id, other)).status_code == 404
    async with httpx.AsyncClient() as http:
        listing = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs", headers={"Authorization": f"Bearer {other}"}
        )
    assert outcome.task_id not in {r["run_id"] for r in listing.json()["runs"]}


async def test_the_run_api_requires_a_token(stack: Stack) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{stack.endpoints['coordinator']}/v1/runs")
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")


async def test_a_malformed_cursor_is_a_clear_error(stack: Stack) -> None:
    token = stack.token("coordinator")
    outcome = await send(stack, user_message(data=TWO_STEPS), token=token)
    async with httpx.AsyncClient() as http:
        response = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs/{outcome.task_id}/events",
            headers={"Authorization": f"Bearer {token}", "Last-Event-ID": "yesterday"},
        )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


async def test_debug_bundle_of_a_failed_run_explains_the_failure(stack: Stack, tmp_path: Path) -> None:
    token = stack.token("coordinator")
    steps = {
        "steps": [
            {"id": "totals", "skill": "invoice-totals"},
            {
                "id": "wipe",
                "skill": "sql-query",
                "input": {"sql": "DELETE FROM tenant_data.invoices"},
                "after": ["totals"],
            },
        ]
    }
    outcome = await send(stack, user_message(data=steps), token=token)
    assert outcome.state_name == "TASK_STATE_FAILED"
    result = fleet(
        "runs",
        "export",
        outcome.task_id,
        str(tmp_path / "bundle"),
        "--tenant",
        "acme",
        "--data-dir",
        stack.data_dir,
    )
    assert result.returncode == 0, result.stderr
    assert "failed (specialist_failed)" in result.stdout
    bundle = tmp_path / "bundle"
    assert sorted(p.name for p in bundle.iterdir()) == [
        "EXPLAIN.md",
        "agents.json",
        "checkpoints.jsonl",
        "env.txt",
        "events.jsonl",
        "last_state.json",
        "model_requests.jsonl",
        "operations.jsonl",
        "tool_calls.csv",
        "trace.json",
        "workspace.json",
    ]
    # The run never ran code: the sandbox lists its workspace empty.
    assert json.loads((bundle / "workspace.json").read_text()) == {"files": []}
    events = [json.loads(line) for line in (bundle / "events.jsonl").read_text().splitlines()]
    assert events[-1]["type"] == "run.failed"
    calls = list(csv.DictReader((bundle / "tool_calls.csv").read_text().splitlines()))
    assert [(c["tool"], c["status"]) for c in calls] == [
        ("sql-analyst/invoice-totals", "ok"),
        ("sql-analyst/sql-query", "failed"),
    ]
    assert calls[1]["error_code"] == "specialist_failed"
    assert calls[1]["causes"].split()[:1] == ["tool_failed"], calls[1]  # the agent's error, then the tool's
    operations = [json.loads(line) for line in (bundle / "operations.jsonl").read_text().splitlines()]
    assert [(op["step_id"], op["target"], op["status"]) for op in operations] == [
        ("totals", "sql-analyst", "succeeded"),
        ("wipe", "sql-analyst", "failed"),
    ]
    error = operations[1]["error"]  # as data: the agent failed the step because its tool refused
    assert (error["code"], error["cause"]["code"]) == ("specialist_failed", "tool_failed"), error
    last_state = json.loads((bundle / "last_state.json").read_text())
    assert last_state["failure"]["step"] == "wipe"
    assert "policy bundle revision local-1+" in (bundle / "env.txt").read_text()
    # The run as a trace: its span, then a span per step and operation, the failed ones marked.
    traced = json.loads((bundle / "trace.json").read_text())
    assert traced["conversation_id"] == outcome.task_id
    root, *spans = traced["spans"]
    assert root["name"] == f"run {outcome.task_id}" and root["status"] == "failed"
    assert [(s["name"], s.get("status")) for s in spans if s["name"].startswith("step")] == [
        ("step totals", "ok"),
        ("step wipe", "error"),
    ]
    assert {s["attributes"]["gen_ai.agent.id"] for s in spans if s["name"].startswith("operation")} == {
        "sql-analyst"
    }
    assert (bundle / "model_requests.jsonl").read_text() == ""  # no agent loop ran a model


async def test_a_runs_debug_bundle_lists_its_sandbox_workspace_and_no_other_runs(
    stack: Stack, tmp_path: Path
) -> None:
    code = "import os\nos.makedirs('out', exist_ok=True)\nopen('out/model.txt', 'w').write('v1')\nprint('ok')"

    async def run_code(tenant: str) -> str:
        steps = {"steps": [{"id": "code", "skill": "run-python", "input": {"code": code}}]}
        outcome = await send(stack, user_message(data=steps), token=stack.token("coordinator", tenant=tenant))
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        return str(outcome.task_id)

    ran = await run_code("acme")
    other = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator", tenant="acme"))

    def exported(run_id: str, tenant: str = "acme") -> dict[str, Any]:
        out = tmp_path / run_id
        done = fleet("runs", "export", run_id, str(out), "--tenant", tenant, "--data-dir", stack.data_dir)
        assert done.returncode == 0, done.stderr
        listed: dict[str, Any] = json.loads((out / "workspace.json").read_text())
        return listed

    files = exported(ran)["files"]
    assert [f["path"] for f in files] == ["out/model.txt"]
    assert files[0]["size"] == 2 and len(files[0]["sha256"]) == 64
    # Another run of the same tenant has a workspace of its own (empty): the listing is the run's.
    assert exported(str(other.task_id))["files"] == []


def test_exporting_a_run_of_another_tenant_finds_nothing(stack: Stack, tmp_path: Path) -> None:
    result = fleet(
        "runs", "export", "no-such-run", str(tmp_path), "--tenant", "acme", "--data-dir", stack.data_dir
    )
    assert result.returncode == 5  # not found
    assert "no run no-such-run" in result.stderr
    assert result.stderr.strip().endswith("[not_found]")


async def test_a_run_started_again_with_its_idempotency_key_is_made_once(stack: Stack) -> None:
    # A client that lost the answer (a timeout, a partition) sends the request again with the same
    # key: one run, whatever arrives twice or at once; the key is its caller's own.
    url = f"{stack.endpoints['coordinator']}/v1/runs"
    token = stack.token("coordinator", tenant="acme")
    key = {"Idempotency-Key": f"invoices-{uuid.uuid4()}"}
    auth = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=60) as http:
        answers = await asyncio.gather(
            *(http.post(url, json=TWO_STEPS, headers={**auth, **key}) for _ in range(4))
        )
        run_ids = {a.json()["run_id"] for a in answers}
        assert len(run_ids) == 1, [a.text for a in answers]
        assert {a.status_code for a in answers} <= {200, 202}
        again = await http.post(url, json=TWO_STEPS, headers={**auth, **key})
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        assert again.json()["run_id"] in run_ids
        (run_id,) = run_ids
        events = parse_sse((await read_events(stack, run_id, token)).text)
        submitted = [e for e in events if e["type"] == "run.submitted"]
        assert len(submitted) == 1
        # The same key from another caller is another request: its own run.
        other = stack.token("coordinator", tenant="globex")
        theirs = await http.post(url, json=TWO_STEPS, headers={"Authorization": f"Bearer {other}", **key})
        assert theirs.status_code == 202 and theirs.json()["run_id"] != run_id
        bad = await http.post(url, json=TWO_STEPS, headers={**auth, "Idempotency-Key": "x" * 256})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
