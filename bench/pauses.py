"""Durable pauses: how many runs can wait at a gate, what a waiting run costs, and how fast an
approval gets a run going again.

On a real local stack (NATS JetStream, Postgres, the coordinator, two worker processes, the case desk
and its cases MCP server, the shipped bundle plus a trigger rule for refund events):

* scale (the scenario of ``fleetctl/testing/pauses.py``): ``RUNS`` refund runs pause at the approval
  gate; every worker process is stopped; the disk the paused runs take is measured over every table
  of the run schema they wrote to (their live rows' bytes; the tables compacted, with indexes and
  TOAST; and their growth before vacuum, all against before); ``RUNS`` approvals arrive over NATS
  with no worker alive (each with a signal grant, asked for as it is sent); workers start again and
  every run resumes; refunds are counted at the tool. Then ``SUBMITTED_RUNS`` refund runs submitted
  by a caller (which keep a context, a run grant and a task record too) park, for their disk.
  The scale part's tenant has its event ingest and token issue rates raised (the shipped 100 events
  a second per tenant would spread 10,000 events over 80 s by policy and dead-letter some as
  ``rate_limited``; its 10,000 approvals need a signal grant each, over the shipped 200 a second).
  Targets: every run resumes exactly once; disk per paused run <= 5 KB live.
* approval -> resumed step durable: one paused run at a time, an approval published on
  ``fleet.signals.<run>``, and the time until the resumed step's operation intent is committed (the
  run is going again, and the approval can no longer be lost), announced by Postgres ``NOTIFY``.
  Baseline: publish to delivery of a message to a plain core-NATS subscriber. Target: p50 <= 25 ms.

Run: ``.venv/bin/python -m bench.pauses [RUNS]`` (starts and stops its own stack).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import psycopg

from bench.events import delivery_latency
from coordinator.record.notifier import NOTIFY_CHANNEL
from fleet.events import Event, publish_event
from fleet.natsconn import connect
from fleet.signal_client import SIGNALS_PREFIX, sign_signal
from fleetctl.layout import StackLayout, stack_admin
from fleetctl.testing.pauses import (
    SUBJECT,
    TENANT,
    dsn,
    operator_signer,
    pause_and_resume,
    refund_policy,
    submitted_paused_disk,
)
from fleetctl.testing.stack import running_stack

RUNS = 10_000
LATENCY_RUNS = 60
# The scale part's tenant, whose event ingest rate the benchmark's policy raises: what is measured is
# the fleet's pace, not the shipped fairness cap of 100 events a second per tenant.
SCALE_TENANT = "bulk-scale"
SUBMITTED_RUNS = 200  # submitted by a caller, for their disk (with their context, grant and task record)
DISK_TARGET_BYTES = 5 * 1024
LATENCY_TARGET_MS = 25.0


async def _paused(url: str, run_id: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            cursor = await conn.execute("SELECT state FROM fleet_runs.runs WHERE run_id = %s", (run_id,))
            row = await cursor.fetchone()
            if row is not None and row[0] == "waiting":
                return
            await asyncio.sleep(0.02)


async def _approval_latency(layout: StackLayout, endpoints: dict[str, Any]) -> list[float]:
    """Seconds from publishing an approval to the commit of the resumed step's intent."""
    url = dsn(layout, endpoints, "fleet")
    client = await connect(endpoints["nats"], "bench-pauses", credentials=stack_admin(endpoints))
    latencies = []
    try:
        async with (
            httpx.AsyncClient(timeout=30) as http,
            await psycopg.AsyncConnection.connect(url, autocommit=True) as listener,
            await psycopg.AsyncConnection.connect(url, autocommit=True) as reader,
        ):
            signer = operator_signer(layout, endpoints, http)
            await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            for i in range(LATENCY_RUNS):
                event_id = f"latency-{uuid.uuid4().hex}"
                await publish_event(
                    client,
                    SUBJECT,
                    tenant=TENANT,
                    source="bench",
                    type_="refund.requested",
                    data={"subject": f"latency-{i}", "amount_cents": 30_000},
                    event_id=event_id,
                )
                run_id = Event(SUBJECT, event_id, "bench", "refund.requested", TENANT, "", {}).run_id()
                await asyncio.wait_for(_paused(url, run_id), 60)
                await asyncio.sleep(0.05)  # the worker's last writes of the park
                # The signal grant is asked for first: the time is from publishing, as before.
                payload, headers = await sign_signal(signer, run_id, {"action": "approve"}, tenant=TENANT)
                started = time.perf_counter()
                await client.jetstream().publish(SIGNALS_PREFIX + run_id, payload, headers=headers)
                async for note in listener.notifies(timeout=30):
                    if note.payload != run_id:
                        continue
                    cursor = await reader.execute(  # not the listener: it is busy with notifies
                        "SELECT 1 FROM fleet_runs.events WHERE run_id = %s AND type = 'operation.intent'"
                        " AND payload->>'step' = 'refund~1'",
                        (run_id,),
                    )
                    if await cursor.fetchone() is not None:
                        latencies.append(time.perf_counter() - started)
                        break
                await asyncio.sleep(0.2)  # let the run finish before the next one
    finally:
        await client.drain()
    return latencies


async def _delivery_floor(endpoints: dict[str, Any]) -> list[float]:
    client = await connect(endpoints["nats"], "bench-delivery", credentials=stack_admin(endpoints))
    try:
        return await delivery_latency(client, LATENCY_RUNS)
    finally:
        await client.drain()


def main(runs: int = RUNS) -> dict[str, Any]:
    with TemporaryDirectory(prefix="fleet-bench-") as tmp:
        bundle = refund_policy(Path(tmp), bulk_tenants=(SCALE_TENANT,))
        with running_stack(Path(tmp) / "fleet", FLEET_POLICY_DIR=str(bundle)) as (layout, endpoints):
            latency = asyncio.run(_approval_latency(layout, endpoints))
            delivery = asyncio.run(_delivery_floor(endpoints))
            # before the scale part, which ends with the stack's workers stopped
            submitted = asyncio.run(submitted_paused_disk(layout, endpoints, SUBMITTED_RUNS))
            scale = asyncio.run(
                pause_and_resume(layout, endpoints, runs, timeout_s=3600, tenant=SCALE_TENANT)
            )
    p50, floor = statistics.median(latency) * 1000, statistics.median(delivery) * 1000
    result = {
        "benchmark": "pauses",
        **scale,
        "per_run_events": [list(row) for row in scale["per_run_events"]],
        "disk_target_bytes": DISK_TARGET_BYTES,
        "disk_submitted_runs": SUBMITTED_RUNS,
        "disk_per_submitted_paused_run": submitted,
        "latency_runs": LATENCY_RUNS,
        "approval_to_resumed_p50_ms": round(p50, 2),
        "approval_to_resumed_p95_ms": round(sorted(latency)[int(len(latency) * 0.95) - 1] * 1000, 2),
        "delivery_p50_ms": round(floor, 3),
        "latency_target_ms": LATENCY_TARGET_MS,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else RUNS)
