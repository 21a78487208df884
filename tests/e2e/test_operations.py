"""The operations ledger under crashes: real workers die by SIGKILL at exact points (crash points) or
at a moment the test picks, and the effects are counted where they happen (rows the cases tool wrote).

After every recovery: each effect happened once, no run is lost, the ledger says what the world says,
and an outcome nobody can establish ends in ``needs_human``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from fleetctl.testing.e2e import (
    FAST_FAILOVER,
    TWO_STEPS,
    Stack,
    all_events,
    clean_env,
    event_of,
    first_event,
    fleet,
    run_id_of_first_run,
    send,
    user_message,
)
from tests.e2e.run_helpers import count_rows, events_so_far, operations, running, table_locked, victim_pid

pytestmark = pytest.mark.e2e


def pid_of(actor: str) -> str:
    """The process id in a worker's actor id (``service-id:pid:instance``); empty for others."""
    parts = actor.split(":")
    return parts[1] if len(parts) > 2 else ""


FAST_FAILOVER_LEASE_S = float(FAST_FAILOVER["FLEET_LEASE_TTL_S"])

# Totals, outliers, then one review case per outlier (an effect, through a keyed tool).
REVIEW: dict[str, Any] = {
    "steps": [
        *TWO_STEPS["steps"],
        {
            "id": "cases",
            "skill": "open-review-cases",
            "input": {"records": {"$from": "outliers.outliers"}, "label": "label", "reason": "outlier"},
        },
    ]
}
NOTE: dict[str, Any] = {
    "steps": [{"id": "note", "skill": "post-note", "input": {"channel": "finance", "text": "books closed"}}]
}


def crash_env(tmp_path: Path, point: str, **extra: str) -> dict[str, str]:
    return clean_env(**FAST_FAILOVER, FLEET_CRASH_POINTS=f"{point}@{tmp_path / 'crashed'}", **extra)


async def blocked_on(stack: Stack, table: str) -> None:
    """Wait until a write to ``table`` waits for its lock: the tool call is in flight, held there."""
    async with (
        asyncio.timeout(60),
        await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data"), autocommit=True) as conn,
    ):
        while True:
            cursor = await conn.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass",
                (f"tenant_data.{table}",),
            )
            row = await cursor.fetchone()
            if row is not None and row[0] > 0:
                return
            await asyncio.sleep(0.1)


async def desk_operation(stack: Stack, op_id: str, token: str, *, cancel: bool = False) -> dict[str, Any]:
    """What the case desk itself says of an operation (the operations extension), or its answer to a
    cancel of it; ``token`` is for the case desk."""
    url = f"{stack.endpoints['specialists']['case-desk']}/v1/operations/{op_id}"
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=60) as http:
        response = await (
            http.post(url + "/cancel", headers=headers) if cancel else http.get(url, headers=headers)
        )
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


async def intent_of_step(stack: Stack, run_id: str, token: str, step: str) -> dict[str, Any]:
    """The ``operation.intent`` event of ``step``, once it is recorded."""
    async with asyncio.timeout(60):
        while True:
            for event in await events_so_far(stack, run_id, token):
                if event["type"] == "operation.intent" and event["payload"]["step"] == step:
                    return event
            await asyncio.sleep(0.2)


def assert_gap_free_and_one_end(events: list[dict[str, Any]]) -> None:
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    ends = [e["type"] for e in events if e["type"] in ("run.completed", "run.failed", "run.canceled")]
    assert len(ends) == 1, ends


async def finish_review(stack: Stack, token: str) -> tuple[str, dict[str, Any]]:
    async with asyncio.timeout(120):
        outcome = await send(stack, user_message(data=REVIEW), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    return outcome.task_id, outcome.result


@pytest.mark.parametrize(
    ("point", "redispatched"),
    [
        # (a) the worker dies before the intent is durable: nothing was sent, the next worker sends it
        ("worker.before_intent:open-review-cases", 0),
        # the intent is durable but nothing was sent: the agent says "unknown", it is sent once
        ("worker.after_intent:open-review-cases", 1),
        # (b) the agent did the work, the worker died before recording it: the agent is asked and
        # its answer recorded; nothing is sent again
        ("worker.before_result:open-review-cases", 0),
    ],
)
async def test_a_worker_killed_around_an_effect_leaves_exactly_one_effect(
    tmp_path: Path, point: str, redispatched: int
) -> None:
    with running(tmp_path / "fleet", crash_env(tmp_path, point)) as stack:
        token = stack.token("coordinator")
        run_id, result = await finish_review(stack, token)
        killed = victim_pid(tmp_path)
        assert killed in stack.endpoints["processes"].values()
        assert [c["subject"] for c in result["steps"]["cases"]["cases"]] == ["Fabrikam"]

        events = await all_events(stack, run_id, token)
        assert_gap_free_and_one_end(events)
        assert any(e["type"] == "run.resumed" for e in events)
        assert not any(pid_of(e["actor"]) == str(killed) for e in events if e["type"] == "run.resumed")
        case_op = next(op for op in await operations(stack, run_id, token) if op["step_id"] == "cases")
        assert case_op["status"] == "succeeded"
        types = [e["type"] for e in events if e["payload"].get("op_id") == case_op["op_id"]]
        assert types.count("operation.intent") == 1
        assert types.count("operation.redispatch") == redispatched
        assert types.count("operation.succeeded") == 1
        # Counted at the tool: one case, opened once.
        assert await count_rows(stack, "cases", "idempotency_key LIKE %s", case_op["op_id"] + "/%") == 1
        assert await count_rows(stack, "cases") == 1


async def lease_owner(stack: Stack, run_id: str) -> str | None:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT lease_owner FROM fleet_runs.runs WHERE run_id = %s AND lease_expires_at > now()",
            (run_id,),
        )
        row = await cursor.fetchone()
    return str(row[0]) if row and row[0] else None


async def test_two_workers_claiming_one_run_leave_one_writer_and_one_effect(tmp_path: Path) -> None:
    """A worker that stalls (SIGSTOP: a long GC pause, a partition) while it holds a run loses the
    run to another worker when its lease expires. When it wakes, both believe they own the run;
    the fence lets only the new owner write, and the effect happens once."""
    with running(tmp_path / "fleet", clean_env(**FAST_FAILOVER)) as stack:
        token = stack.token("coordinator")
        async with table_locked(stack, "cases"):  # the effect is in flight, and stays so
            sending = asyncio.create_task(send(stack, user_message(data=REVIEW), token=token))
            run_id = await run_id_of_first_run(stack, token)
            await intent_of_step(stack, run_id, token, "cases")
            owner = await lease_owner(stack, run_id)
            assert owner is not None
            stalled = int(pid_of(owner))
            os.kill(stalled, signal.SIGSTOP)
            try:
                async with asyncio.timeout(60):  # the other worker takes the run over
                    while True:
                        events = await events_so_far(stack, run_id, token)
                        resumed = [e for e in events if e["type"] == "run.resumed"]
                        if resumed:
                            break
                        await asyncio.sleep(0.3)
                assert pid_of(resumed[0]["actor"]) != str(stalled)
            finally:
                os.kill(stalled, signal.SIGCONT)  # it wakes believing it still owns the run
        outcome = await sending
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        await asyncio.sleep(FAST_FAILOVER_LEASE_S)  # time for the stale worker to try writing
        events = await all_events(stack, run_id, token)
        assert_gap_free_and_one_end(events)
        takeover = next(e["seq"] for e in events if e["type"] == "run.resumed")
        assert not [e for e in events if e["seq"] > takeover and pid_of(e["actor"]) == str(stalled)]
        (case_op,) = [op for op in await operations(stack, run_id, token) if op["step_id"] == "cases"]
        assert case_op["status"] == "succeeded"
        assert case_op["attempts"] == 1  # asked about, not sent again
        assert await count_rows(stack, "cases") == 1


async def test_killing_the_worker_while_the_agent_runs_the_effect_waits_for_it_instead_of_resending(
    tmp_path: Path,
) -> None:
    with running(tmp_path / "fleet", clean_env(**FAST_FAILOVER)) as stack:
        token = stack.token("coordinator")
        async with table_locked(stack, "cases"):
            sending = asyncio.create_task(send(stack, user_message(data=REVIEW), token=token))
            run_id = await run_id_of_first_run(stack, token)
            intent = await intent_of_step(stack, run_id, token, "cases")
            await asyncio.sleep(1.0)  # the call is in flight, blocked at the tool
            victim = stack.endpoints["processes"][intent["actor"].split(":")[0]]
            os.kill(victim, signal.SIGKILL)
            await asyncio.sleep(8)  # the run has been taken over and is asking the agent
        async with asyncio.timeout(120):
            outcome = await sending
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        events = await all_events(stack, run_id, token)
        assert_gap_free_and_one_end(events)
        assert not any(e["type"] == "operation.redispatch" for e in events)
        assert await count_rows(stack, "cases") == 1


async def test_an_effect_nobody_can_confirm_parks_the_run_for_a_person_who_resolves_it(
    tmp_path: Path,
) -> None:
    env = clean_env(**FAST_FAILOVER, FLEET_NOTE_TIMEOUT_S="2")
    with running(tmp_path / "fleet", env) as stack:
        token = stack.token("coordinator")
        async with table_locked(stack, "notes"):
            sending = asyncio.create_task(send(stack, user_message(data=NOTE), token=token))
            run_id = await run_id_of_first_run(stack, token)
            async with asyncio.timeout(60):
                waiting = await first_event(stack, run_id, token, "run.waiting")
        # The lock is gone: the note the tool was writing when the call timed out goes out now.
        for _ in range(150):
            if await count_rows(stack, "notes") == 1:
                break
            await asyncio.sleep(0.2)
        wait = waiting["payload"]["wait"]
        assert wait["type"] == "needs_human"
        (op,) = await operations(stack, run_id, token)
        assert op["status"] == "needs_human"
        assert wait["awaited"] == op["op_id"]
        assert op["error"]["code"] == "outcome_unknown"

        # (c) a worker dies while the run waits: nothing is lost, nothing held the run.
        os.kill(stack.endpoints["processes"]["worker-1"], signal.SIGKILL)
        await asyncio.sleep(1)
        async with httpx.AsyncClient(timeout=30) as http:
            run = (
                await http.get(
                    f"{stack.endpoints['coordinator']}/v1/runs/{run_id}",
                    headers={"Authorization": f"Bearer {token}"},
                )
            ).json()
        assert run["state"] == "waiting"

        # Without the scope to resolve, a caller is refused.
        async with httpx.AsyncClient(timeout=30) as http:
            refused = await http.post(
                f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/operations/{op['op_id']}/resolve",
                headers={"Authorization": f"Bearer {token}"},
                json={"verdict": "succeeded"},
            )
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "forbidden"

        # A person checks the channel, sees the note, and says so.
        resolved = await asyncio.to_thread(
            fleet,
            "runs",
            "resolve",
            "--data-dir",
            stack.data_dir,
            "--tenant",
            "acme",
            "--result",
            json.dumps({"note_id": 1}),
            "--note",
            "the note is in #finance",
            run_id,
            op["op_id"],
            "succeeded",
        )
        assert resolved.returncode == 0, resolved.stderr
        events = await all_events(stack, run_id, token)
        assert events[-1]["type"] == "run.completed"
        assert_gap_free_and_one_end(events)
        by_person = next(e for e in events if e["type"] == "operation.resolved")
        assert by_person["actor"] == "operator"
        assert by_person["payload"]["note"] == "the note is in #finance"
        (op,) = await operations(stack, run_id, token)
        assert op["status"] == "succeeded"
        assert await count_rows(stack, "notes") == 1  # resolving sent nothing again
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)

        again = await asyncio.to_thread(
            fleet,
            "runs",
            "resolve",
            "--data-dir",
            stack.data_dir,
            "--tenant",
            "acme",
            run_id,
            op["op_id"],
            "failed",
        )
        assert again.returncode == 1
        assert "conflict" in again.stderr


async def test_cancel_while_an_effect_is_in_flight_records_what_the_tool_did(tmp_path: Path) -> None:
    from a2a.client import ClientCallContext, ClientConfig, ClientFactory
    from a2a.types import CancelTaskRequest, TaskState

    from fleetctl.testing.e2e import fetch_card

    with running(tmp_path / "fleet", clean_env(**FAST_FAILOVER)) as stack:
        token = stack.token("coordinator")
        context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
        async with httpx.AsyncClient(timeout=90) as http:
            card = await fetch_card(http, stack.endpoints["coordinator"])
            client = ClientFactory(ClientConfig(httpx_client=http)).create(card)
            async with table_locked(stack, "cases"):
                sending = asyncio.create_task(send(stack, user_message(data=REVIEW), token=token))
                run_id = await run_id_of_first_run(stack, token)
                op_id = (await intent_of_step(stack, run_id, token, "cases"))["payload"]["op_id"]
                desk = stack.token("case-desk")
                await blocked_on(stack, "cases")  # the open_cases call is in flight, held at the tool
                canceling = asyncio.create_task(
                    client.cancel_task(CancelTaskRequest(id=run_id), context=context)
                )
                # The cancel reaches the case desk, which lets the tool call in flight finish.
                async with asyncio.timeout(60):
                    while True:
                        if (await desk_operation(stack, op_id, desk)).get("cancel_requested"):
                            break
                        await asyncio.sleep(0.2)
            canceled = await canceling
            await client.close()
        assert canceled.status.state == TaskState.TASK_STATE_CANCELED
        await asyncio.gather(sending, return_exceptions=True)
        events = await all_events(stack, run_id, token)
        assert_gap_free_and_one_end(events)
        assert events[-1]["type"] == "run.canceled"
        # The skill stopped after the call in flight and before doing anything more; the ledger says
        # so, with the count of tool calls it completed (their effects are whole and known to the tool).
        case_op = next(op for op in await operations(stack, run_id, token) if op["step_id"] == "cases")
        assert case_op["op_id"] == op_id
        assert case_op["status"] == "failed", case_op
        assert (case_op["error"]["code"], case_op["error"]["tool_calls"]) == ("canceled", 1)
        journaled = await desk_operation(stack, op_id, desk)
        assert (journaled["status"], journaled["error"]["tool_calls"]) == ("canceled", 1)
        assert await count_rows(stack, "cases", "idempotency_key LIKE %s", op_id + "/%") == 1
        assert await count_rows(stack, "cases") == 1


# Two effects in parallel after the outliers are known (fan-out), then fan-in.
FAN_OUT: dict[str, Any] = {
    "steps": [
        *TWO_STEPS["steps"],
        *(
            {
                "id": f"cases-{desk}",
                "skill": "open-review-cases",
                "input": {"records": {"$from": "outliers.outliers"}, "label": "label", "reason": desk},
            }
            for desk in ("audit", "sales")
        ),
    ]
}


async def test_independent_steps_run_in_parallel_and_fan_in(stack: Stack) -> None:
    token = stack.token("coordinator")
    napping = {
        "steps": [
            {
                "id": f"nap{i}",
                "skill": "sql-query",
                "input": {"sql": "SELECT pg_sleep(0.5) IS NULL AS napped"},
            }
            for i in (1, 2)
        ]
    }
    outcome = await send(stack, user_message(data=napping), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert set(outcome.result["steps"]) == {"nap1", "nap2"}
    events = await all_events(stack, outcome.task_id, token)
    kinds = [(e["type"], e["payload"].get("step")) for e in events if e["type"].startswith("step.")]
    first_done = min(i for i, (kind, _) in enumerate(kinds) if kind == "step.completed")
    assert {step for kind, step in kinds[:first_done] if kind == "step.started"} == {"nap1", "nap2"}


async def test_a_worker_killed_mid_fan_out_leaves_each_parallel_effect_once(tmp_path: Path) -> None:
    with running(tmp_path / "fleet", crash_env(tmp_path, "worker.before_result:open-review-cases")) as stack:
        token = stack.token("coordinator")
        async with asyncio.timeout(120):
            outcome = await send(stack, user_message(data=FAN_OUT), token=token)
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        assert victim_pid(tmp_path) in stack.endpoints["processes"].values()
        events = await all_events(stack, outcome.task_id, token)
        assert_gap_free_and_one_end(events)
        assert any(e["type"] == "run.resumed" for e in events)
        ops = {op["step_id"]: op for op in await operations(stack, outcome.task_id, token)}
        assert {ops[s]["status"] for s in ("cases-audit", "cases-sales")} == {"succeeded"}
        for step in ("cases-audit", "cases-sales"):
            key = ops[step]["op_id"] + "/%"
            assert await count_rows(stack, "cases", "idempotency_key LIKE %s", key) == 1
        assert await count_rows(stack, "cases") == 2
        assert not any(e["type"] == "operation.redispatch" for e in events)


def batch_plan(n: int, call_size: int, every: int) -> dict[str, Any]:
    """Open a review case for each of ``n`` items: a batch step, ``call_size`` items per call."""
    return {
        "steps": [
            {
                "id": "review",
                "skill": "open-review-cases",
                "for_each": [{"label": f"item-{i:05d}"} for i in range(n)],
                "items_as": "records",
                "input": {"label": "label", "reason": "batch"},
                "batch": {"call_size": call_size, "checkpoint_every": every},
            }
        ]
    }


async def tenant_cases(stack: Stack, tenant: str) -> tuple[int, int, int]:
    """(cases, distinct subjects, cases whose opening was attempted more than once) of a tenant."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn:
        cursor = await conn.execute(
            "SELECT count(*), count(DISTINCT subject), count(*) FILTER (WHERE attempts > 1)"
            " FROM tenant_data.cases WHERE tenant_id = %s",
            (tenant,),
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


async def test_a_batch_step_runs_in_calls_and_checkpoints_its_progress(stack: Stack) -> None:
    tenant = f"batch-{uuid.uuid4().hex[:8]}"
    token = stack.token("coordinator", tenant=tenant)
    outcome = await send(stack, user_message(data=batch_plan(120, call_size=25, every=50)), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    review = outcome.result["steps"]["review"]
    assert (review["items"], review["calls"], len(review["cases"])) == (120, 5, 120)
    assert [c["subject"] for c in review["cases"]] == [f"item-{i:05d}" for i in range(120)]
    events = await all_events(stack, outcome.task_id, token)
    assert [e["payload"]["done"] for e in events if e["type"] == "batch.progress"] == [25, 50, 75, 100, 120]
    ops = await operations(stack, outcome.task_id, token)
    assert sorted(op["step_id"] for op in ops) == sorted(f"review@{o}" for o in (0, 25, 50, 75, 100))
    assert await tenant_cases(stack, tenant) == (120, 120, 0)


async def test_a_worker_killed_mid_batch_redoes_at_most_one_checkpoint_of_items_and_no_effect(
    tmp_path: Path,
) -> None:
    with running(tmp_path / "fleet", clean_env(**FAST_FAILOVER)) as stack:
        tenant = f"batch-{uuid.uuid4().hex[:8]}"
        token = stack.token("coordinator", tenant=tenant)
        sending = asyncio.create_task(
            send(stack, user_message(data=batch_plan(600, call_size=25, every=50)), token=token)
        )
        run_id = await run_id_of_first_run(stack, token)
        url = f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/events"
        async with (
            asyncio.timeout(60),
            httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http,
            http.stream("GET", url, headers={"Authorization": f"Bearer {token}"}) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    event = event_of(line)
                    if event["type"] == "batch.progress" and event["payload"]["done"] >= 200:
                        break
        os.kill(stack.endpoints["processes"][event["actor"].split(":")[0]], signal.SIGKILL)
        async with asyncio.timeout(120):
            outcome = await sending
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        events = await all_events(stack, run_id, token)
        trace = [(e["type"], e["actor"], e["payload"].get("done")) for e in events]
        assert outcome.result["steps"].get("review", {}).get("items") == 600, trace
        assert_gap_free_and_one_end(events)
        assert any(e["type"] == "run.resumed" for e in events)
        cases, distinct, repeated = await tenant_cases(stack, tenant)
        assert (cases, distinct) == (600, 600)  # every item's effect, once
        assert repeated <= 50  # at most the items since the last checkpoint were sent again
        done = [e["payload"]["done"] for e in events if e["type"] == "batch.progress"]
        assert done[-1] == 600


# Cancel before the first tool call. These tests share one stack, torn down with this module (so they
# come last).
HOLD_S = 10.0  # how long the case desk's skills are held at their start (FLEET_HOLD_S)


@pytest.fixture(scope="module")
def held_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    """A stack whose case desk holds each of its skills at its start, once, for ``HOLD_S``: before
    its first tool call. The marker ``DIR/<skill>`` appears when a skill is held."""
    markers = tmp_path_factory.mktemp("held")
    points = ",".join(
        f"skill.start:{skill}@{markers / skill}" for skill in ("open-review-cases", "post-note")
    )
    env = clean_env(**FAST_FAILOVER, FLEET_HOLD_POINTS=points, FLEET_HOLD_S=f"{HOLD_S:g}")
    with running(markers / "fleet", env) as stack:
        yield stack, markers


async def held(marker: Path) -> float:
    """When the skill was held (the marker's time), once it is."""
    async with asyncio.timeout(90):
        while True:
            since = await asyncio.to_thread(_mtime, marker)
            if since is not None:
                return since
            await asyncio.sleep(0.1)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


async def after_the_hold(since: float) -> None:
    """Wait until a held skill that was not stopped would have gone on and made its tool call."""
    await asyncio.sleep(max(0.0, since + HOLD_S + 3.0 - time.time()))


async def test_a_run_canceled_before_its_step_calls_a_tool_stops_the_skill_and_makes_no_effect(
    held_stack: tuple[Stack, Path],
) -> None:
    from a2a.client import ClientCallContext, ClientConfig, ClientFactory
    from a2a.types import CancelTaskRequest, TaskState

    from fleetctl.testing.e2e import fetch_card

    stack, markers = held_stack
    token = stack.token("coordinator")
    context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
    sending = asyncio.create_task(send(stack, user_message(data=REVIEW), token=token))
    run_id = await run_id_of_first_run(stack, token)
    since = await held(markers / "open-review-cases")  # the skill runs; no tool call yet
    async with httpx.AsyncClient(timeout=90) as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
        client = ClientFactory(ClientConfig(httpx_client=http)).create(card)
        canceled = await client.cancel_task(CancelTaskRequest(id=run_id), context=context)
        await client.close()
    assert canceled.status.state == TaskState.TASK_STATE_CANCELED
    assert time.time() < since + HOLD_S  # the skill was stopped while it was held
    await asyncio.gather(sending, return_exceptions=True)

    case_op = next(op for op in await operations(stack, run_id, token) if op["step_id"] == "cases")
    assert case_op["status"] == "failed", case_op
    assert (case_op["error"]["code"], case_op["error"]["tool_calls"]) == ("canceled", 0)
    journaled = await desk_operation(stack, case_op["op_id"], stack.token("case-desk"))
    assert journaled["status"] == "canceled"
    assert journaled["error"] == {
        "code": "canceled",
        "message": "canceled after 0 tool calls completed",
        "tool_calls": 0,
    }
    await after_the_hold(since)
    assert await count_rows(stack, "cases") == 0  # the skill never went on to its tool call


async def test_a2a_cancel_of_a_specialists_task_stops_its_skill_before_its_first_tool_call(
    held_stack: tuple[Stack, Path],
) -> None:
    from a2a.client import ClientCallContext, ClientConfig, ClientFactory
    from a2a.helpers import get_data_parts
    from a2a.types import CancelTaskRequest, SendMessageRequest, TaskState

    from fleetctl.testing.e2e import fetch_card

    stack, markers = held_stack
    channel, op_id = f"ops-{uuid.uuid4().hex[:8]}", f"op-test-{uuid.uuid4().hex}"
    message = user_message(data={"skill": "post-note", "input": {"channel": channel, "text": "hello"}})
    message.metadata.update({"fleet.operation_id": op_id})
    desk = stack.token("case-desk")
    context = ClientCallContext(service_parameters={"Authorization": f"Bearer {desk}"})
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=90.0)) as http:
        card = await fetch_card(http, stack.endpoints["specialists"]["case-desk"])
        client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        stream = client.send_message(SendMessageRequest(message=message), context=context)
        first = await anext(stream)
        task_id = first.task.id
        since = await held(markers / "post-note")
        canceled = await client.cancel_task(CancelTaskRequest(id=task_id), context=context)
        assert time.time() < since + HOLD_S  # the skill was stopped while it was held
        rest = [event async for event in stream]
        await client.close()
    assert canceled.status.state == TaskState.TASK_STATE_CANCELED
    last = rest[-1].status_update.status
    assert last.state == TaskState.TASK_STATE_CANCELED
    errors = [d["error"] for d in get_data_parts(last.message.parts) if isinstance(d, dict) and "error" in d]
    assert errors == [
        {"code": "canceled", "message": "canceled after 0 tool calls completed", "tool_calls": 0}
    ]
    assert (await desk_operation(stack, op_id, desk))["status"] == "canceled"
    await after_the_hold(since)
    assert await count_rows(stack, "notes", "channel = %s", channel) == 0


async def test_an_operation_canceled_before_it_arrives_is_refused_when_it_comes(
    held_stack: tuple[Stack, Path],
) -> None:
    stack, _ = held_stack
    desk = stack.token("case-desk")
    channel, op_id = f"late-{uuid.uuid4().hex[:8]}", f"op-test-{uuid.uuid4().hex}"
    assert (await desk_operation(stack, op_id, desk))["status"] == "unknown"
    tombstone = await desk_operation(stack, op_id, desk, cancel=True)
    assert tombstone["status"] == "canceled"
    assert (tombstone["error"]["code"], tombstone["error"]["tool_calls"]) == ("canceled", 0)

    late = user_message(data={"skill": "post-note", "input": {"channel": channel, "text": "late"}})
    late.metadata.update({"fleet.operation_id": op_id})
    outcome = await send(stack, late, token=desk, agent="case-desk")
    assert outcome.state_name == "TASK_STATE_FAILED"
    # Refused as canceled (not as an arguments conflict: the tombstone has none), and never run.
    assert outcome.codes == ["canceled"], outcome.final_text
    assert (await desk_operation(stack, op_id, desk))["status"] == "canceled"
    assert await count_rows(stack, "notes", "channel = %s", channel) == 0
