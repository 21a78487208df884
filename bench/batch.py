"""A 10,000-item batch: checkpointing its progress every 50 items vs no checkpoints until the end,
and a SIGKILL of its worker in the middle, on a real local stack.

Each item is one effect: a review case opened through the case desk and the cases MCP server, with an
idempotency key per item, 50 items per call (each call a ledgered operation). Both sides are the
same batch run through the coordinator; only ``checkpoint_every`` differs (50, or 10,000: one
checkpoint at the end). Interleaved rounds, medians. Target (durable runs issue): <= 5% slower.

Then a run checkpointing every 50 has its worker SIGKILLed past the middle; after it completes on the
other worker, the tool's table says how many items were sent again (a repeated key counts an
attempt) and whether any effect happened twice (two rows for one item). Targets: <= 50 items
redone, 0 duplicated effects.

Run: ``.venv/bin/python -m bench.batch`` (starts and stops its own stack).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time
import uuid
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import psycopg

from bench.throughput import Fleet
from fleetctl.layout import StackLayout
from fleetctl.testing.stack import running_stack

ITEMS = 10_000
CALL_SIZE = 50
EVERY = 50
ROUNDS = 3
TARGET_SLOWDOWN = 0.05
MAX_REDONE = 50


def plan(every: int) -> dict[str, Any]:
    return {
        "steps": [
            {
                "id": "review",
                "skill": "open-review-cases",
                "for_each": [{"label": f"item-{i:05d}"} for i in range(ITEMS)],
                "items_as": "records",
                "input": {"label": "label", "reason": "nightly batch"},
                "batch": {"call_size": CALL_SIZE, "checkpoint_every": every},
            }
        ]
    }


async def timed(fleet: Fleet, every: int, tenant: str) -> float:
    started = time.perf_counter()
    await fleet.run(plan(every), tenant=tenant)
    return time.perf_counter() - started


async def kill_mid_batch(fleet: Fleet, tenant: str) -> dict[str, Any]:
    running = asyncio.create_task(fleet.run(plan(EVERY), tenant=tenant))
    run_id = await fleet.newest_run(tenant)
    progress = await fleet.first_event(
        run_id, "batch.progress", lambda e: e["payload"]["done"] >= ITEMS // 2, tenant=tenant
    )
    os.kill(fleet.endpoints["processes"][progress["actor"].split(":")[0]], signal.SIGKILL)
    killed_at = time.perf_counter()
    await running
    return {
        "killed_at_item": progress["payload"]["done"],
        "recovered_in_s": round(time.perf_counter() - killed_at, 1),
    }


async def effects(dsn: str, tenant: str) -> dict[str, int]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cursor = await conn.execute(
            "SELECT count(*), count(DISTINCT subject), count(*) FILTER (WHERE attempts > 1)"
            " FROM tenant_data.cases WHERE tenant_id = %s",
            (tenant,),
        )
        row = await cursor.fetchone()
    assert row is not None
    return {
        "cases": int(row[0]),
        "duplicated_effects": int(row[0]) - int(row[1]),
        "items_redone": int(row[2]),
    }


async def measure(layout: StackLayout, endpoints: dict[str, Any]) -> dict[str, Any]:
    password = (layout.keys_dir / "postgres-password.secret").read_text().strip()
    data_dsn = f"postgresql://postgres:{password}@127.0.0.1:{endpoints['postgres_port']}/fleet_data"
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=600.0)) as http:
        fleet = Fleet(layout, endpoints, http)
        await timed(fleet, ITEMS, f"warm-{uuid.uuid4().hex[:6]}")
        without, with_checkpoints = [], []
        for _ in range(ROUNDS):  # interleaved; each run in a tenant of its own
            without.append(await timed(fleet, ITEMS, f"b-{uuid.uuid4().hex[:8]}"))
            with_checkpoints.append(await timed(fleet, EVERY, f"b-{uuid.uuid4().hex[:8]}"))
        tenant = f"kill-{uuid.uuid4().hex[:8]}"
        crash = await kill_mid_batch(fleet, tenant)
        crash.update(await effects(data_dsn, tenant))
    base, ours = statistics.median(without), statistics.median(with_checkpoints)
    return {
        "benchmark": "batch",
        "items": ITEMS,
        "call_size": CALL_SIZE,
        "checkpoint_every": EVERY,
        "rounds": ROUNDS,
        "baseline": "the same batch with no checkpoint until the end",
        "baseline_s": round(base, 2),
        "fleet_s": round(ours, 2),
        "slowdown": round(ours / base - 1, 3),
        "target_slowdown": TARGET_SLOWDOWN,
        "crash": crash,
        "max_redone": MAX_REDONE,
    }


def main() -> dict[str, Any]:
    with (
        TemporaryDirectory(prefix="fleet-bench-") as tmp,
        running_stack(Path(tmp) / "fleet", FLEET_LEASE_TTL_S="3", FLEET_ACK_WAIT_S="6") as (
            layout,
            endpoints,
        ),
    ):
        result = asyncio.run(measure(layout, endpoints))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
