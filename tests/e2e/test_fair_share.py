"""Fair share between tenants on the stack's shared paths: one tenant at full tilt does not starve
another (memory scans, the work queue, token issuance, event ingest; see docs/limits.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import psycopg
import pytest
from a2a.types import TaskState

from coordinator.record import work
from fleet.errors import ErrorCode, FleetError
from fleet.events import DEAD_LETTER_STREAM, ensure_event_streams, publish_event
from fleet.natsconn import connect
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import (
    TWO_STEPS,
    Stack,
    bundle_with,
    clean_env,
    send,
    start_stack,
    stop_stack,
    user_message,
)
from fleetctl.testing.mcp import call, ok
from tests.e2e.a2a_helpers import fresh_tenant

MEMORY = ("memory:read", "memory:write")
TOKEN_FLOODER, EVENT_FLOODER, CAPPED = fresh_tenant(), fresh_tenant(), fresh_tenant()


@pytest.fixture(scope="module")
def limited_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of this module's own, started with a bundle that gives two tenants low rates."""
    root = tmp_path_factory.mktemp("limited")

    def limit(data: dict[str, Any]) -> None:
        fair = data["config"]["limits"]["fair"]
        fair["token_issue"]["tenants"] = {TOKEN_FLOODER: {"per_second": 0.01, "burst": 3}}
        fair["event_ingest"]["tenants"] = {EVENT_FLOODER: {"per_second": 1, "burst": 5}}
        # Its cap alone and while other tenants' tests have work (its share: tests/broker/test_work_caps.py).
        fair["work"]["tenants"] = {CAPPED: {"max_in_flight": 2, "shared_in_flight": 2}}

    bundle = bundle_with(root, limit)
    running = start_stack(root / "fleet", env=clean_env(FLEET_POLICY_DIR=str(bundle)))
    yield running
    stop_stack(running)


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
        outcomes = cast(list[dict[str, Any]], ok(await asyncio.wait_for(task, 600)))
        assert len(outcomes) == 64 and {o["status"] for o in outcomes} <= {"stored", "refused"}


async def queued_runs(stack: Stack, tenant: str) -> int:
    """How many runs of ``tenant`` no worker has taken up yet."""
    return await runs_of(stack, tenant, "submitted")


async def runs_of(stack: Stack, tenant: str, state: str = "") -> int:
    """How many runs ``tenant`` has (in ``state``, if given)."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM fleet_runs.runs WHERE tenant = %s AND (%s = '' OR state = %s)",
            (tenant, state, state),
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def publish_closings(stack: Stack, tenant: str, count: int) -> None:
    """``count`` events of ``tenant`` that each start a run (the trigger rule invoices-closed)."""
    client = await connect(stack.endpoints["nats"], "test-flood", credentials=stack_admin(stack.endpoints))
    try:
        await ensure_event_streams(client.jetstream())
        for i in range(count):
            await publish_event(
                client,
                "fleet.events.invoices.closed",
                tenant=tenant,
                source="flood",
                type_="invoices.closed",
                data={"night": f"n{i}"},
                event_id=f"flood-{i}",
            )
    finally:
        await client.drain()


async def timed_run(stack: Stack, tenant: str) -> float:
    """Seconds a run of ``tenant`` (the demo's two steps) takes from its request to its end."""
    started = time.monotonic()
    outcome = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator", tenant=tenant))
    assert outcome.state == TaskState.TASK_STATE_COMPLETED, outcome
    return time.monotonic() - started


async def operator_token(stack: Stack, tenant: str, seen: list[httpx.Response]) -> str:
    """A new token for the operator (no cached one), the token endpoint's answers kept in ``seen``."""

    async def keep(response: httpx.Response) -> None:
        seen.append(response)

    async with httpx.AsyncClient(event_hooks={"response": [keep]}) as http:
        client = operator_token_client(stack.layout, stack.endpoints["registry"] + "/oauth/token", http)
        return await client.token("coordinator", tenant, ["agent:invoke"])


async def test_a_tenant_over_its_token_rate_is_refused_429_with_retry_after_and_others_are_not(
    limited_stack: Stack,
) -> None:
    seen: list[httpx.Response] = []
    for _ in range(3):  # its burst
        assert await operator_token(limited_stack, TOKEN_FLOODER, seen)
    with pytest.raises(FleetError) as refused:
        await operator_token(limited_stack, TOKEN_FLOODER, seen)
    assert refused.value.code == ErrorCode.RATE_LIMITED and refused.value.retryable
    assert seen[-1].status_code == 429 and int(seen[-1].headers["Retry-After"]) >= 1
    assert seen[-1].json()["error"] == "rate_limited"
    assert await operator_token(limited_stack, "globex", seen)  # another tenant is served
    assert seen[-1].status_code == 200


async def dead_letters(stack: Stack) -> list[dict[str, Any]]:
    client = await connect(stack.endpoints["nats"], "test-dead", credentials=stack_admin(stack.endpoints))
    try:
        js = client.jetstream()
        info = await js.stream_info(DEAD_LETTER_STREAM)
        found: list[dict[str, Any]] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
            message = await js.get_msg(DEAD_LETTER_STREAM, seq)
            if message.data:
                found.append(json.loads(message.data))
        return found
    finally:
        await client.drain()


async def test_a_tenant_over_its_event_rate_waits_its_turn_and_loses_no_event(limited_stack: Stack) -> None:
    stack, other = limited_stack, fresh_tenant()
    started = time.monotonic()
    await publish_closings(stack, EVENT_FLOODER, 30)
    await publish_closings(stack, other, 1)
    async with asyncio.timeout(60):  # the other tenant's event is taken while the flood waits
        while True:
            if await runs_of(stack, other) == 1:
                break
            await asyncio.sleep(0.2)  # rows another process writes: nothing to wait on
    elapsed_s = time.monotonic() - started
    taken = await runs_of(stack, EVENT_FLOODER)
    assert taken <= 5 + elapsed_s * 1 + 3, (taken, elapsed_s)  # its burst and rate, and a margin
    # Every event of the flood becomes a run in its turn, or a dead letter that says why: none is lost.
    async with asyncio.timeout(180):
        while True:
            refused = [
                d
                for d in await dead_letters(stack)
                if f".{EVENT_FLOODER}." in d["subject"] and d["error"]["code"] == "rate_limited"
            ]
            if await runs_of(stack, EVENT_FLOODER) + len(refused) == 30:
                break
            await asyncio.sleep(1)


async def test_a_tenant_has_at_most_its_cap_of_runs_in_flight_over_all_workers(limited_stack: Stack) -> None:
    stack, count = limited_stack, 12
    await publish_closings(stack, CAPPED, count)
    client = await connect(stack.endpoints["nats"], "test-cap", credentials=stack_admin(stack.endpoints))
    in_flight: list[int] = []  # the tenant's runs being advanced, sampled
    try:
        async with asyncio.timeout(240):  # until every run of the tenant reached a stopping point
            while True:
                in_flight.append(await runs_of(stack, CAPPED, "working"))
                settled = in_flight[-1] == 0 and await queued_runs(stack, CAPPED) == 0
                if settled and await runs_of(stack, CAPPED) == count:
                    break
                await asyncio.sleep(0.05)
        consumer = await client.jetstream().consumer_info(work.STREAM, f"{work.CONSUMER}-{CAPPED}")
    finally:
        await client.drain()
    assert consumer.config.max_ack_pending == 2
    # Two workers of four consumer tasks each would have taken up to eight at once.
    assert max(in_flight) == 2, in_flight


async def test_one_tenants_thousand_triggered_runs_do_not_hold_up_another_tenants_run(
    limited_stack: Stack,
) -> None:
    # Last of the module: the flood's runs are still being worked off when it ends.
    stack, flooder = limited_stack, fresh_tenant()
    baseline_s = await timed_run(stack, "globex")
    await publish_closings(stack, flooder, 1000)
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
