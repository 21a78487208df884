"""A2A tasks survive the death of the coordinator, and the event log's retention is visible to a
resuming client as a fresh snapshot. One private stack: its coordinator and workers are killed in the
middle of a run, and the stack is started again on its data dir."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import pytest
from a2a.types import (
    GetTaskRequest,
    ListTasksRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)

from fleetctl.testing.e2e import TEST_PUSH_HOSTS, clean_env, send, start_stack, stop_stack, user_message
from tests.e2e.a2a_helpers import (
    INLINE_OUTLIERS,
    a2a_client,
    as_tenant,
    event_id,
    fresh_tenant,
    receiver,
    resumed_as,
    run_events,
    start,
    state_of,
    subscribe,
)

pytestmark = pytest.mark.e2e

# Fast failover (the run in flight resumes within seconds of the restart) and a short retention:
# a run's older events are pruned 40 seconds after it ends (long enough for the pushes of the run in
# flight to be delivered before its events go, even if the killed coordinator held their claim).
RESTART_ENV = {
    "FLEET_LEASE_TTL_S": "3",
    "FLEET_ACK_WAIT_S": "6",
    **TEST_PUSH_HOSTS,
    "FLEET_EVENT_RETENTION_S": "40",
    "FLEET_RETENTION_SWEEP_S": "0.5",
}
COMPLETED = TaskState.TASK_STATE_COMPLETED
# Long enough to be in flight when the stack stops: four steps of two seconds each.
LONG_STEPS = {
    "steps": [
        {
            "id": f"long{n}",
            "skill": "sql-query",
            "input": {"sql": f"SELECT pg_sleep(2) IS NULL AS slept{n}"},
            "after": [f"long{n - 1}"] if n > 1 else [],
        }
        for n in range(1, 5)
    ]
}


def unique(responses: list[StreamResponse]) -> list[StreamResponse]:
    """Pushes are delivered at least once: a restart may repeat one."""
    seen: dict[bytes, StreamResponse] = {}
    for response in responses:
        seen.setdefault(response.SerializeToString(deterministic=True), response)
    return list(seen.values())


async def test_tasks_subscriptions_and_pushes_survive_a_killed_coordinator_and_retention_gives_a_snapshot(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "fleet"
    stack = start_stack(data_dir, env=clean_env(**RESTART_ENV))
    tenant = fresh_tenant()
    try:
        token = stack.token("coordinator", tenant=tenant)
        done = await send(stack, user_message(data=INLINE_OUTLIERS), token=token)
        async with receiver(stack) as hook:
            task = await start(
                stack, token, user_message(data=LONG_STEPS), push=TaskPushNotificationConfig(url=hook.url())
            )
            seen = []
            async with a2a_client(stack) as client:
                request = SubscribeToTaskRequest(id=task.id)
                stream = cast(
                    AsyncGenerator[StreamResponse], client.subscribe(request, context=as_tenant(token))
                )
                async for response in stream:
                    seen.append(response)
                    if len(seen) == 4:
                        break
                await stream.aclose()
            last = event_id(seen[-1])

            # The coordinator and the workers die at once, the run in the middle of a step (a graceful
            # stop would let the specialists go first and fail the step); then the stack comes back.
            for name in ("coordinator", "worker-1", "worker-2"):
                os.kill(stack.endpoints["processes"][name], signal.SIGKILL)
            await asyncio.to_thread(stop_stack, stack)
            stack = await asyncio.to_thread(start_stack, data_dir, clean_env(**RESTART_ENV))
            hook.coordinator = stack.endpoints["coordinator"]
            token = stack.token("coordinator", tenant=tenant)

            async with a2a_client(stack, streaming=False) as client:
                finished = await client.get_task(GetTaskRequest(id=done.task_id), context=as_tenant(token))
                listing = await client.list_tasks(ListTasksRequest(), context=as_tenant(token))
            assert finished.status.state == COMPLETED
            assert finished.artifacts[0].name == "result"
            assert {t.id for t in listing.tasks} == {done.task_id, task.id}

            resumed = await subscribe(stack, task.id, token, last_event_id=last)
            assert resumed_as(resumed[0].task) is None, "the run ended and was pruned before the restart"
            assert event_id(resumed[0]) == last
            assert state_of(resumed[-1]) == COMPLETED
            pushes = await hook.until_final(task.id)
        assert hook.refused == []
        after_snapshot = [
            p.response for p in pushes if (event_id(p.response) or 0) > (event_id(seen[0]) or 0)
        ]
        assert unique(after_snapshot) == seen[1:] + resumed[1:]
        assert "run.resumed" in {e["type"] for e in await run_events(stack, task.id, token)}

        # Retention: once a run has been over for 40 seconds, its older events are pruned. A cursor
        # from before that gets the task as it is now, marked as a snapshot.
        async with asyncio.timeout(90):
            while True:
                tail = await subscribe(stack, done.task_id, token, last_event_id=1)
                if resumed_as(tail[0].task) == "snapshot":
                    break
                await asyncio.sleep(0.5)
        assert len(tail) == 1
        snapshot = tail[0].task
        assert snapshot.status.state == COMPLETED
        assert snapshot.artifacts[0].name == "result"
        assert event_id(tail[0]) == event_id_of_last(await run_events(stack, done.task_id, token))
    finally:
        stop_stack(stack)


def event_id_of_last(events: list[dict[str, object]]) -> int:
    """The run API still ends a pruned run's stream: its terminal event is kept."""
    assert [e["type"] for e in events] == ["run.completed"]
    return int(cast(int, events[-1]["seq"]))
