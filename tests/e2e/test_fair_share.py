"""Fair share between tenants on the stack's shared paths: one tenant at full tilt does not starve
another (memory scans, the work queue; see docs/limits.md)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from a2a.types import TaskState

from fleet.buskeys import stack_admin
from fleet.events import ensure_event_streams, publish_event
from fleet.natsconn import connect
from tests.e2e.a2a_helpers import fresh_tenant
from tests.e2e.conftest import TWO_STEPS, Stack, send, user_message
from tests.e2e.stack_helpers import call, ok

MEMORY = ("memory:read", "memory:write")

# A text the scanner takes long over (the phone-number windows), about 0.5 s here: 64 of them keep a
# scan thread busy past the 20 s after which a text that got no thread used to be refused.
SLOW = "1 " * 2000


async def test_a_tenant_flooding_the_memory_scanner_leaves_another_tenants_write_prompt(stack: Stack) -> None:
    acme = stack.token("mcp-memory", tenant="acme", scopes=MEMORY)
    globex = stack.token("mcp-memory", tenant="globex", scopes=MEMORY)
    started = time.monotonic()
    idle = await call(stack, "mcp-memory", globex, "remember", {"text": "fair-share baseline note of globex"})
    baseline_s = time.monotonic() - started
    assert not idle.is_error and idle.structured_content["status"] == "stored", idle.content

    items: list[dict[str, Any]] = [{"text": f"{SLOW}{i}", "tier": "episodic"} for i in range(64)]
    flood = [
        asyncio.create_task(call(stack, "mcp-memory", acme, "remember_many", {"items": items}, timeout_s=600))
        for _ in range(2)
    ]
    done, _ = await asyncio.wait(flood, timeout=3)  # the flood has both scan threads
    assert not done
    started = time.monotonic()
    write = await call(
        stack, "mcp-memory", globex, "remember", {"text": "fair-share note of globex under a flood"}
    )
    flooded_s = time.monotonic() - started
    assert not write.is_error and write.structured_content["status"] == "stored", write.content
    assert not all(task.done() for task in flood)  # it did not wait for the flood
    assert flooded_s < baseline_s + 15, (flooded_s, baseline_s)
    for task in flood:
        outcomes = ok(await asyncio.wait_for(task, 600))
        assert len(outcomes) == 64 and {o["status"] for o in outcomes} <= {"stored", "refused"}


async def queued_runs(stack: Stack, tenant: str) -> int:
    """How many runs of ``tenant`` no worker has taken up yet."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND state = 'submitted'", (tenant,)
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def timed_run(stack: Stack, tenant: str) -> float:
    """Seconds a run of ``tenant`` (the demo's two steps) takes from its request to its end."""
    started = time.monotonic()
    outcome = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator", tenant=tenant))
    assert outcome.state == TaskState.TASK_STATE_COMPLETED, outcome
    return time.monotonic() - started


async def test_one_tenants_thousand_triggered_runs_do_not_hold_up_another_tenants_run(
    own_stack: Stack,
) -> None:
    stack, flooder = own_stack, fresh_tenant()
    baseline_s = await timed_run(stack, "globex")
    client = await connect(stack.endpoints["nats"], "test-flood", credentials=stack_admin(stack.endpoints))
    try:
        await ensure_event_streams(client.jetstream())
        for i in range(1000):
            await publish_event(
                client,
                "fleet.events.invoices.closed",
                tenant=flooder,
                source="flood",
                type_="invoices.closed",
                data={"night": f"n{i}"},
                event_id=f"flood-{i}",
            )
    finally:
        await client.drain()
    async with asyncio.timeout(300):  # the trigger ingest has queued a backlog of the flooder's runs
        while True:
            if await queued_runs(stack, flooder) >= 300:
                break
            await asyncio.sleep(0.5)  # rows another process writes: nothing to wait on
    flooded_s = await timed_run(stack, "globex")
    left = await queued_runs(stack, flooder)
    # First come, first served, globex's run would have waited until every run queued before it had
    # a worker.
    assert left >= 100, (left, flooded_s, baseline_s)
    assert flooded_s < 3 * baseline_s + 30, (flooded_s, baseline_s)
