"""The whole fleet on the production broker's shape: a three-node NATS cluster with every stream,
KV bucket and object store R3, and four worker processes sharing the work queue.

* Four workers share the load; SIGKILL one with runs in flight: every run completes, once, the
  killed worker's runs resumed by the others.
* SIGKILL the NATS node that leads the work queue while events arrive and runs are in flight: every
  event makes exactly one run, and every run completes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from nats.errors import Error as NatsError
from nats.js.errors import Error as JetStreamError

from coordinator.record.work import STREAM as WORK_STREAM
from deploy.nats_cluster import NatsCluster
from fleet.buskeys import admin_credentials
from fleet.events import Event, publish_event
from fleet.natsconn import Credentials, connect
from fleetctl.testing.e2e import (
    FAST_FAILOVER,
    Stack,
    bundle_with,
    clean_env,
    send,
    start_stack,
    stop_stack,
    user_message,
)

pytestmark = pytest.mark.e2e

CLOSED = "fleet.events.invoices.closed"
WORKERS = 4
# Two runs at a time per worker: sixteen slow runs keep every worker busy at once.
SETTINGS = {
    **FAST_FAILOVER,
    "FLEET_NATS_REPLICAS": "3",
    "FLEET_WORKERS": str(WORKERS),
    "FLEET_CONCURRENCY": "2",
}
SLOW = {
    "steps": [
        {"id": "slow", "skill": "sql-query", "input": {"sql": "SELECT pg_sleep(1.5) IS NULL AS slept"}},
        {"id": "totals", "skill": "invoice-totals", "after": ["slow"]},
    ]
}


@pytest.fixture(scope="module")
def fleet_on_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsCluster, Stack]]:
    root = tmp_path_factory.mktemp("cluster")
    keys = root / "bus-keys"
    with NatsCluster(root / "nats", size=3, keys_dir=keys) as cluster:
        # Four workers: one tenant may have all their sixteen consumer tasks busy (the shipped
        # policy's cap is sized for the local stack's two).
        bundle = bundle_with(
            root,
            lambda data: data["config"]["limits"]["fair"]["work"]["default"].update(
                max_in_flight=16, shared_in_flight=16
            ),
        )
        env = clean_env(
            **SETTINGS,
            FLEET_NATS_URL=cluster.url,
            FLEET_NATS_KEYS_DIR=str(keys),
            FLEET_POLICY_DIR=str(bundle),
        )
        stack = start_stack(root / "fleet", env=env)
        try:
            yield cluster, stack
        finally:
            stop_stack(stack)


def admin_of(cluster: NatsCluster) -> Credentials:
    assert cluster.keys_dir is not None
    return admin_credentials(cluster.keys_dir)


async def query(stack: Stack, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(sql, args)
        return await cursor.fetchall()


async def states(stack: Stack, run_ids: list[str]) -> dict[str, str]:
    rows = await query(stack, "SELECT run_id, state FROM fleet_runs.runs WHERE run_id = ANY(%s)", run_ids)
    return {str(run_id): str(state) for run_id, state in rows}


async def until_ended(stack: Stack, run_ids: list[str], timeout_s: float = 180) -> dict[str, str]:
    async with asyncio.timeout(timeout_s):
        while True:
            found = await states(stack, run_ids)
            if len(found) == len(run_ids) and all(s in ("completed", "failed") for s in found.values()):
                return found
            await asyncio.sleep(0.3)


async def failures(stack: Stack, ended: dict[str, str]) -> list[tuple[Any, ...]]:
    """The failed runs with their reasons and last events (for the assertion's message)."""
    failed = [run_id for run_id, state in ended.items() if state != "completed"]
    return await query(
        stack,
        "SELECT r.run_id, r.reason, e.type, e.payload::text FROM fleet_runs.runs r"
        " JOIN fleet_runs.events e USING (run_id) WHERE r.run_id = ANY(%s) AND e.seq > r.last_seq - 3",
        failed,
    )


async def completions(stack: Stack, run_ids: list[str]) -> dict[str, int]:
    rows = await query(
        stack,
        "SELECT run_id, count(*) FROM fleet_runs.events WHERE run_id = ANY(%s) AND type = 'run.completed'"
        " GROUP BY run_id",
        run_ids,
    )
    return {str(run_id): int(n) for run_id, n in rows}


async def test_four_workers_share_the_load_and_killing_one_loses_no_run(
    fleet_on_cluster: tuple[NatsCluster, Stack],
) -> None:
    _, stack = fleet_on_cluster
    token = stack.token("coordinator")
    marker = uuid.uuid4().hex[:8]
    sending = [
        asyncio.create_task(send(stack, user_message(f"{marker}-{n}", data=SLOW), token=token))
        for n in range(16)
    ]
    # Wait until every worker has a slow step under way (the runs are this test's: started after it).
    async with asyncio.timeout(90):
        while True:
            busy = await query(
                stack,
                "SELECT split_part(e.actor, ':', 1), e.run_id FROM fleet_runs.events e"
                " JOIN fleet_runs.runs r USING (run_id)"
                " WHERE e.type = 'step.started' AND e.payload->>'step' = 'slow'"
                " AND r.request::text LIKE %s AND r.state = 'working'",
                f"%{marker}%",
            )
            by_worker: dict[str, list[str]] = {}
            for worker, run_id in busy:
                by_worker.setdefault(str(worker), []).append(str(run_id))
            if len(by_worker) == WORKERS:
                break
            await asyncio.sleep(0.1)
    victim = max(by_worker, key=lambda w: len(by_worker[w]))
    os.kill(stack.endpoints["processes"][victim], signal.SIGKILL)

    async with asyncio.timeout(180):
        outcomes = await asyncio.gather(*sending)
    run_ids = [outcome.task_id for outcome in outcomes]
    assert len(set(run_ids)) == 16
    ended = await until_ended(stack, run_ids)
    assert set(ended.values()) == {"completed"}, await failures(stack, ended)
    assert await completions(stack, run_ids) == dict.fromkeys(run_ids, 1)  # each completed once
    # The killed worker's runs were taken over by the others and finished there.
    for run_id in by_worker[victim]:
        finishers = await query(
            stack,
            "SELECT split_part(actor, ':', 1) FROM fleet_runs.events WHERE run_id = %s AND type = 'run.completed'",
            run_id,
        )
        assert finishers and finishers[0][0] != victim


async def publish_until_kept(client: Any, event_id: str) -> None:
    """What a producer must do: publish until the stream acknowledges, always with the same id."""
    for attempt in range(300):
        try:
            await publish_event(
                client,
                CLOSED,
                tenant="acme",
                source="cluster-test",
                type_="invoices.closed",
                data={"night": "2026-12-01"},
                event_id=event_id,
            )
            return
        except (TimeoutError, NatsError, JetStreamError):
            await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
    raise AssertionError(f"event {event_id} was never acknowledged")


async def test_killing_the_work_queues_nats_node_loses_no_event_and_runs_continue(
    fleet_on_cluster: tuple[NatsCluster, Stack],
) -> None:
    cluster, stack = fleet_on_cluster
    token = stack.token("coordinator")
    producer = await connect(cluster.url, "cluster-producer", replicas=3, credentials=admin_of(cluster))
    try:
        info = await producer.jetstream().stream_info(WORK_STREAM)
        assert info.config.num_replicas == 3 and info.cluster is not None and info.cluster.leader
        doomed = cluster.node_named(info.cluster.leader)
        marker = uuid.uuid4().hex[:8]
        event_ids = [f"closed-{marker}-{n}" for n in range(30)]
        in_flight = [
            asyncio.create_task(send(stack, user_message(f"{marker}-a2a-{n}", data=SLOW), token=token))
            for n in range(4)
        ]
        for n, event_id in enumerate(event_ids):
            if n == 10:
                await asyncio.to_thread(cluster.kill, doomed)
            if n in (11, 12):  # new runs over A2A while the work queue elects its next leader
                message = user_message(f"{marker}-a2a-during-{n}", data=SLOW)
                in_flight.append(asyncio.create_task(send(stack, message, token=token)))
            await publish_until_kept(producer, event_id)
            await asyncio.sleep(0.05)
        async with asyncio.timeout(180):
            outcomes = await asyncio.gather(*in_flight)
    finally:
        await producer.close()

    triggered = [
        Event(CLOSED, e, "cluster-test", "invoices.closed", "acme", "", {}).run_id() for e in event_ids
    ]
    a2a_runs = [outcome.task_id for outcome in outcomes]
    ended = await until_ended(stack, triggered + a2a_runs)
    assert set(ended.values()) == {"completed"}, await failures(stack, ended)
    # One run per event (none lost, none doubled by a producer's retry) and each completed once.
    submitted = await query(
        stack,
        "SELECT run_id, count(*) FROM fleet_runs.events WHERE run_id = ANY(%s) AND type = 'run.submitted'"
        " GROUP BY run_id",
        triggered,
    )
    assert {str(r): int(n) for r, n in submitted} == dict.fromkeys(triggered, 1)
    assert await completions(stack, triggered + a2a_runs) == dict.fromkeys(triggered + a2a_runs, 1)

    # The node returns and catches up; the work queue is replicated on three nodes again.
    await asyncio.to_thread(cluster.restart, doomed)
    await asyncio.to_thread(cluster.wait_healthy)
    checker = await connect(cluster.url, "cluster-check", credentials=admin_of(cluster))
    try:
        async with asyncio.timeout(60):
            while True:
                info = await checker.jetstream().stream_info(WORK_STREAM)
                replicas = info.cluster.replicas if info.cluster else None
                if replicas and len(replicas) == 2 and all(peer.current for peer in replicas):
                    break
                await asyncio.sleep(0.3)
    finally:
        await checker.close()
