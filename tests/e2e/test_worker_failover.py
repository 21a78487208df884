"""Runs survive the death of the worker advancing them: SIGKILL it mid-step, another resumes."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetctl.testing.e2e import (
    FAST_FAILOVER,
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

pytestmark = pytest.mark.e2e


@pytest.fixture
def failover_stack(tmp_path: Path) -> Iterator[Stack]:
    stack = start_stack(tmp_path / "fleet", env=clean_env(**FAST_FAILOVER))
    yield stack
    stop_stack(stack)


async def test_killing_the_worker_mid_step_loses_nothing_and_another_worker_finishes(
    failover_stack: Stack,
) -> None:
    stack = failover_stack
    token = stack.token("coordinator")
    slow = {
        "steps": [
            {"id": "slow", "skill": "sql-query", "input": {"sql": "SELECT pg_sleep(2) IS NULL AS slept"}},
            {"id": "totals", "skill": "invoice-totals", "after": ["slow"]},
        ]
    }
    message = user_message(data=slow)
    sending = asyncio.create_task(send(stack, message, token=token))
    run_id = await run_id_of_first_run(stack, token)
    async with asyncio.timeout(30):
        started = await first_event(stack, run_id, token, "step.started")
    victim = started["actor"].split(":")[0]
    victim_pid = stack.endpoints["processes"][victim]
    assert int(started["actor"].split(":")[1]) == victim_pid
    os.kill(victim_pid, signal.SIGKILL)

    async with asyncio.timeout(90):
        outcome = await sending
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    assert set(outcome.result["steps"]) == {"slow", "totals"}

    events = await all_events(stack, run_id, token)
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    resumed = [e for e in events if e["type"] == "run.resumed"]
    assert len(resumed) == 1
    assert not resumed[0]["actor"].startswith(victim + ":")
    # At the interrupted step; or, if the checkpoint's fan-out had not been saved yet when the worker
    # died, at the scheduler, which sends the step again.
    assert resumed[0]["payload"]["at"] in (["delegate"], ["schedule"])
    assert [e["type"] for e in events].count("run.completed") == 1
    # The interrupted step ran again on the new worker (node execution is at-least-once); the finished
    # checkpoints before it were not redone.
    starts = [e["payload"]["step"] for e in events if e["type"] == "step.started"]
    assert starts == ["slow", "slow", "totals"]


async def test_cancel_while_a_step_is_in_flight_ends_the_run_canceled_once(failover_stack: Stack) -> None:
    from a2a.client import ClientCallContext, ClientConfig, ClientFactory
    from a2a.types import CancelTaskRequest, GetTaskRequest, TaskState

    from fleetctl.testing.e2e import fetch_card

    stack = failover_stack
    token = stack.token("coordinator")
    slow = {
        "steps": [
            {"id": "slow", "skill": "sql-query", "input": {"sql": "SELECT pg_sleep(3) IS NULL AS slept"}},
            {"id": "totals", "skill": "invoice-totals", "after": ["slow"]},
        ]
    }
    sending = asyncio.create_task(send(stack, user_message(data=slow), token=token))
    run_id = await run_id_of_first_run(stack, token)
    await first_event(stack, run_id, token, "step.started")
    context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
    async with httpx.AsyncClient(timeout=60) as http:
        card = await fetch_card(http, stack.endpoints["coordinator"])
        client = ClientFactory(ClientConfig(httpx_client=http)).create(card)
        canceled = await client.cancel_task(CancelTaskRequest(id=run_id), context=context)
        assert canceled.status.state == TaskState.TASK_STATE_CANCELED
        task = await client.get_task(GetTaskRequest(id=run_id), context=context)
        assert task.status.state == TaskState.TASK_STATE_CANCELED
        again = await client.cancel_task(CancelTaskRequest(id=run_id), context=context)
        assert again.status.state == TaskState.TASK_STATE_CANCELED
        await client.close()
    await asyncio.gather(sending, return_exceptions=True)
    events = await all_events(stack, run_id, token)
    types = [e["type"] for e in events]
    assert "run.cancel_requested" in types
    assert types[-1] == "run.canceled"
    assert sum(t in ("run.completed", "run.failed", "run.canceled") for t in types) == 1
    assert "totals" not in {e["payload"].get("step") for e in events}


async def test_a_run_whose_work_message_was_lost_is_found_and_finished(tmp_path: Path) -> None:
    from psycopg_pool import AsyncConnectionPool

    from coordinator.record.runs import PostgresRunStore

    env = clean_env(**FAST_FAILOVER, FLEET_SWEEP_INTERVAL_S="0.5", FLEET_STRANDED_AFTER_S="1")
    stack = start_stack(tmp_path / "fleet", env=env)
    try:
        dsn = stack.pg_dsn("fleet")
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, open=False, kwargs={"autocommit": True})
        async with pool:
            # A run that was created but whose submit never reached the queue.
            plan = [{"id": "totals", "skill": "invoice-totals", "input": {}}]
            await PostgresRunStore(pool).create_run("stranded-1", "acme", "operator", {}, plan)
        token = stack.token("coordinator")
        async with asyncio.timeout(60):
            events = await all_events(stack, "stranded-1", token)  # follows until the run ends
        assert [e["type"] for e in events][-1] == "run.completed"
    finally:
        stop_stack(stack)
