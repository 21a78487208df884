"""Ambient events: ingest with de-duplication, and the latency from an event to its run.

On a real local stack (NATS JetStream, Postgres, the coordinator's trigger ingest, the shipped trigger
rule ``invoices-closed``), interleaved with their baselines:

* ingest: ``N`` events published to the events stream (on ``fleet.events.bench.bench.bench.ingest``)
  with ``tenant/source/id`` as ``Nats-Msg-Id`` (one in five a repeat of the id before it, which the
  stream drops within its 100 ms window), ``CONCURRENCY`` publishes in flight; baseline: the
  same publishes without a message id (no de-duplication). Target (durable pauses issue): >= 3,000/s.
* admission: ``ADMIT_EVENTS`` events of the shipped trigger rule published at once (``CONCURRENCY``
  publishes in flight) with every worker stopped, for a tenant whose ingest rate the benchmark's
  policy raises (the shipped default, 100 a second with a burst of 2,000, would be what is
  measured); the time from the first publish until every event is acked, which the ingest does only
  once its run is durable and its work message queued, and every run exists. Baseline: the same
  publishes alone (the stream's pace). Target (cost issue): >= 500 runs/s admitted.
* event -> run started: one event at a time; the time from the publish to the moment the run is
  durable (its row and first events committed, announced by Postgres ``NOTIFY``); baseline: publish
  to delivery of the same message to a plain core-NATS subscriber. Target: p50 <= 25 ms.

Run: ``.venv/bin/python -m bench.events`` (starts and stops its own stack).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import psycopg

from coordinator.control.triggers import CONSUMER as TRIGGERS_CONSUMER
from coordinator.record.notifier import NOTIFY_CHANNEL
from fleet.events import EVENTS_STREAM, EventMessage, ensure_event_streams, event_message
from fleet.natsconn import connect
from fleetctl.layout import stack_admin
from fleetctl.testing.pauses import stop_workers
from fleetctl.testing.stack import running_stack
from policy import DEFAULT_BUNDLE_DIR

INGEST_EVENTS = 6000
CONCURRENCY = 64
LATENCY_EVENTS = 100
INGEST_TARGET = 3000.0
LATENCY_TARGET_MS = 25.0
ADMIT_EVENTS = 4000
ADMIT_TENANT = "admit"
ADMIT_TARGET = 500.0
UNMATCHED = "fleet.events.bench.ingest"  # no trigger rule: measures the stream, not the runs
MATCHED = "fleet.events.invoices.closed"


async def _ingest_rate(js: Any, dedup: bool) -> float:
    """Events accepted per second (a repeat counts as accepted: the stream answered it)."""
    ids = [uuid.uuid4().hex for _ in range(INGEST_EVENTS)]
    ids = [ids[i - 1] if dedup and i % 5 == 4 else event_id for i, event_id in enumerate(ids)]
    messages = [
        event_message(
            UNMATCHED, tenant="bench", source="bench", type_="bench.ingest", data={"i": i}, event_id=event_id
        )
        for i, event_id in enumerate(ids)
    ]
    return INGEST_EVENTS / await _publish_all(js, messages, with_ids=dedup)


async def _publish_all(js: Any, messages: list[EventMessage], *, with_ids: bool = True) -> float:
    """Seconds to publish ``messages`` to the stream, ``CONCURRENCY`` in flight (``with_ids``: with
    their ``Nats-Msg-Id``, which the stream de-duplicates by)."""
    queue: asyncio.Queue[EventMessage] = asyncio.Queue()
    for item in messages:
        queue.put_nowait(item)

    async def publisher() -> None:
        while not queue.empty():
            message = queue.get_nowait()
            await js.publish(message.subject, message.payload, headers=message.headers if with_ids else None)

    started = time.perf_counter()
    await asyncio.gather(*(publisher() for _ in range(CONCURRENCY)))
    return time.perf_counter() - started


async def _to_run_latency(client: Any, dsn: str, seen: set[str]) -> list[float]:
    """Seconds from publishing an event to its run being durable, one event at a time (``seen``:
    the runs that existed before, whose notifications are not a new run's)."""
    js = client.jetstream()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as listener:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        latencies = []
        for i in range(LATENCY_EVENTS):
            message = event_message(
                MATCHED,
                tenant="bench",
                source="bench",
                type_="invoices.closed",
                data={"i": i},
                event_id=f"bench-{uuid.uuid4().hex}",
            )
            started = time.perf_counter()
            await js.publish(message.subject, message.payload, headers=message.headers)
            async for note in listener.notifies(timeout=30):
                # The first notification of a new run is its creation (run.submitted and the plan).
                if note.payload not in seen:
                    seen.add(note.payload)
                    latencies.append(time.perf_counter() - started)
                    break
            await asyncio.sleep(0.02)  # let the run's own notifications pass
        return latencies


async def delivery_latency(client: Any, count: int = LATENCY_EVENTS) -> list[float]:
    """Seconds from publish to delivery to a core-NATS subscriber: what the broker alone costs."""
    got: asyncio.Queue[float] = asyncio.Queue()

    async def on_message(_: Any) -> None:
        got.put_nowait(time.perf_counter())

    subscription = await client.subscribe("bench.delivery", cb=on_message)
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        await client.publish("bench.delivery", b"{}")
        latencies.append(await asyncio.wait_for(got.get(), 10) - started)
    await subscription.unsubscribe()
    return latencies


def admission_policy(root: Path) -> Path:
    """The shipped bundle, with the event ingest rate of the benchmark's tenants raised out of the
    way (the ingest rounds' tens of thousands of events would otherwise drain at 100 a second before
    the later measurements' events are taken)."""
    bundle = root / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = json.loads((bundle / "data.json").read_text())
    for tenant in (ADMIT_TENANT, "bench"):  # the ingest rounds' events drain at the ingest's pace
        data["config"]["limits"]["fair"]["event_ingest"]["tenants"][tenant] = {
            "per_second": 100_000,
            "burst": 100_000,
        }
    (bundle / "data.json").write_text(json.dumps(data))
    return bundle


async def admission(client: Any, dsn: str, events: int = ADMIT_EVENTS) -> dict[str, Any]:
    """Runs admitted per second from a burst of events with no worker running (see the module's
    doc), beside the rate at which the stream took the same events."""
    js = client.jetstream()
    batch = uuid.uuid4().hex[:8]
    messages = [
        event_message(
            MATCHED,
            tenant=ADMIT_TENANT,
            source="bench",
            type_="invoices.closed",
            data={"i": i},
            event_id=f"admit-{batch}-{i}",
        )
        for i in range(events)
    ]
    started = time.perf_counter()
    published_s = await _publish_all(js, messages)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while True:
            consumer = await js.consumer_info(EVENTS_STREAM, TRIGGERS_CONSUMER)
            cursor = await conn.execute(
                "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND request->'event'->>'id' LIKE %s",
                (ADMIT_TENANT, f"admit-{batch}-%"),
            )
            row = await cursor.fetchone()
            runs = int(row[0]) if row else 0
            if consumer.num_pending == 0 and consumer.num_ack_pending == 0 and runs >= events:
                break
            if time.perf_counter() - started > 600:
                raise TimeoutError(f"{runs} of {events} runs admitted after 600 s")
            await asyncio.sleep(0.05)
    admitted_s = time.perf_counter() - started
    return {
        "events": events,
        "runs_admitted_per_s": round(events / admitted_s),
        "stream_took_per_s": round(events / published_s),
        "target_per_s": ADMIT_TARGET,
    }


async def measure(endpoints: dict[str, Any], dsn: str, *, stop: bool = True) -> dict[str, Any]:
    """The benchmark on a running stack (``stop``: its workers are stopped before the admission,
    as on a stack of its own; the short form leaves a shared stack's running)."""
    client = await connect(endpoints["nats"], "bench-events", credentials=stack_admin(endpoints))
    try:
        js = client.jetstream()
        await ensure_event_streams(js)
        await _ingest_rate(js, dedup=True)  # warm up
        with_dedup, without = [], []
        for _ in range(3):
            with_dedup.append(await _ingest_rate(js, dedup=True))
            without.append(await _ingest_rate(js, dedup=False))
        # Listen on the runs database for the run each matched event creates.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cursor = await conn.execute("SELECT run_id FROM fleet_runs.runs")
            seen = {str(row[0]) for row in await cursor.fetchall()}
        to_run = await _to_run_latency(client, dsn, seen)
        delivery = await delivery_latency(client)
        if stop:
            stop_workers(endpoints)  # the runs are admitted and wait, queued; nothing runs them
        admitted = await admission(client, dsn, ADMIT_EVENTS)
        info = await js.stream_info(EVENTS_STREAM)
    finally:
        await client.drain()
    p50_run, p50_delivery = statistics.median(to_run) * 1000, statistics.median(delivery) * 1000
    return {
        "benchmark": "events",
        "ingest_events_per_round": INGEST_EVENTS,
        "ingest_per_s_with_dedup": round(statistics.median(with_dedup)),
        "ingest_per_s_without_dedup": round(statistics.median(without)),
        "ingest_target_per_s": INGEST_TARGET,
        "latency_events": LATENCY_EVENTS,
        "event_to_run_p50_ms": round(p50_run, 2),
        "event_to_run_p95_ms": round(sorted(to_run)[int(len(to_run) * 0.95) - 1] * 1000, 2),
        "delivery_p50_ms": round(p50_delivery, 3),
        "latency_target_ms": LATENCY_TARGET_MS,
        "stream_messages": info.state.messages,
        "admission": admitted,
    }


def main() -> dict[str, Any]:
    with (
        TemporaryDirectory(prefix="fleet-bench-") as tmp,
        running_stack(Path(tmp) / "fleet", FLEET_POLICY_DIR=str(admission_policy(Path(tmp) / "policy"))) as (
            layout,
            endpoints,
        ),
    ):
        password = (layout.keys_dir / "postgres-password.secret").read_text().strip()
        dsn = f"postgresql://postgres:{password}@127.0.0.1:{endpoints['postgres_port']}/fleet"
        result = asyncio.run(measure(endpoints, dsn))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
