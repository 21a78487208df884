"""Ambient triggers: events on ``fleet.events.>`` start runs through the trigger policy, once per event
id; malformed events go to the dead-letter subject without holding up the rest. Real NATS JetStream,
Postgres and the coordinator's ingest, with the shipped policy bundle (rule ``invoices-closed``)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from coordinator.triggers import batch_owner, batch_run_id
from fleet.buskeys import stack_admin
from fleet.events import DEAD_LETTER_STREAM, Event, event_payload, publish_event, publish_raw
from fleet.natsconn import connect
from tests.e2e.a2a_helpers import fresh_tenant
from tests.e2e.conftest import Stack, all_events, fleet

pytestmark = pytest.mark.e2e

CLOSED = "fleet.events.invoices.closed"


def run_id_for(tenant: str, source: str, event_id: str) -> str:
    return Event(CLOSED, event_id, source, "invoices.closed", tenant, "", {}).run_id()


async def run_when(
    stack: Stack, run_id: str, states: tuple[str, ...], tenant: str = "acme"
) -> dict[str, Any]:
    token = stack.token("coordinator", tenant=tenant)
    async with httpx.AsyncClient(timeout=30) as http, asyncio.timeout(90):
        while True:
            response = await http.get(
                f"{stack.endpoints['coordinator']}/v1/runs/{run_id}",
                headers={"Authorization": f"Bearer {token}"},
            )
            if response.status_code == 200 and response.json()["state"] in states:
                run: dict[str, Any] = response.json()
                return run
            await asyncio.sleep(0.2)


async def runs_owned_by(stack: Stack, owner: str) -> int:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute("SELECT count(*) FROM fleet_runs.runs WHERE owner = %s", (owner,))
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_an_event_published_twice_with_one_id_makes_one_run(stack: Stack) -> None:
    event_id = f"close-{uuid.uuid4().hex[:8]}"
    args = ("events", "publish", "--data-dir", stack.data_dir, CLOSED, "--id", event_id, "--tenant", "acme")
    first = await asyncio.to_thread(fleet, *args, "--data", '{"night": "2026-11-28"}', timeout=60)
    assert first.returncode == 0, first.stderr
    assert "published" in first.stdout
    again = await asyncio.to_thread(fleet, *args, "--data", '{"night": "2026-11-28"}', timeout=60)
    assert again.returncode == 0, again.stderr
    assert "duplicate" in again.stdout  # dropped by the stream (Nats-Msg-Id)

    run_id = run_id_for("acme", "cli", event_id)
    run = await run_when(stack, run_id, ("completed", "failed"))
    assert run["state"] == "completed", run
    assert run["owner"] == "event:cli"

    # The same event again after the stream's de-duplication window (another message id): the run
    # id derives from the event, so it finds its run instead of making a second one.
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        assert await publish_raw(client, CLOSED, envelope(event_id, source="cli"), f"{event_id}-republished")
        sentinel = f"sentinel-{uuid.uuid4().hex[:8]}"
        await publish_raw(client, CLOSED, envelope(sentinel, source="cli"), sentinel)
    finally:
        await client.drain()
    await run_when(
        stack, run_id_for("acme", "cli", sentinel), ("submitted", "working", "completed", "failed")
    )
    await asyncio.sleep(1.0)
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM fleet_runs.events WHERE run_id = %s AND type = 'run.submitted'", (run_id,)
        )
        row = await cursor.fetchone()
    assert row is not None and row[0] == 1


def envelope(
    event_id: str, *, source: str = "test", tenant: str = "acme", data: dict[str, Any] | None = None
) -> bytes:
    return json.dumps(
        {"id": event_id, "source": source, "type": "invoices.closed", "tenant": tenant, "data": data or {}}
    ).encode()


async def dead_letters(stack: Stack) -> list[dict[str, Any]]:
    client = await connect(
        stack.endpoints["nats"], "test-dead-letters", credentials=stack_admin(stack.endpoints)
    )
    try:
        js = client.jetstream()
        info = await js.stream_info(DEAD_LETTER_STREAM)
        found = []
        if not info.state.messages:
            return found
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            message = await js.get_msg(DEAD_LETTER_STREAM, seq)
            if message.data:
                found.append(json.loads(message.data))
        return found
    finally:
        await client.drain()


async def test_a_malformed_event_is_dead_lettered_with_its_reason_and_the_rest_flow(stack: Stack) -> None:
    marker = uuid.uuid4().hex[:8]
    good = f"good-{marker}"
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        await publish_raw(client, CLOSED, b"this is not json " + marker.encode(), f"bad-{marker}")
        missing = json.dumps({"id": f"no-tenant-{marker}", "source": "test", "type": "t"}).encode()
        await publish_raw(client, CLOSED, missing, f"no-tenant-{marker}")
        await publish_raw(client, CLOSED, envelope(good), good)
    finally:
        await client.drain()
    run = await run_when(stack, run_id_for("acme", "test", good), ("completed", "failed"))
    assert run["state"] == "completed"
    async with asyncio.timeout(30):
        while True:
            mine = [d for d in await dead_letters(stack) if marker in d["payload"]]
            if len(mine) == 2:
                break
            await asyncio.sleep(0.3)
    reasons = sorted(d["reason"] for d in mine)
    assert "not JSON" in reasons[1] or "not JSON" in reasons[0]
    assert any("'tenant'" in r for r in reasons)
    assert all(d["subject"] == CLOSED for d in mine)


async def test_an_event_no_rule_matches_starts_nothing_and_distinct_events_start_one_run_each(
    stack: Stack,
) -> None:
    source = f"bulk-{uuid.uuid4().hex[:8]}"
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        _, kept = await publish_event(
            client,
            "fleet.events.weather.changed",
            tenant="acme",
            source=source,
            type_="weather.changed",
            data={},
        )
        assert kept
        ids = [f"{source}-{i}" for i in range(100)]
        for event_id in ids:
            await publish_raw(client, CLOSED, envelope(event_id, source=source, tenant="bulk"), event_id)
    finally:
        await client.drain()
    async with asyncio.timeout(120):
        while True:
            if await runs_owned_by(stack, f"event:{source}") >= len(ids):
                break
            await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)
    assert await runs_owned_by(stack, f"event:{source}") == len(ids)  # none for the weather event


async def test_a_run_waits_for_an_event_of_its_tenant_and_goes_on_with_it(stack: Stack) -> None:
    from tests.e2e.conftest import send, user_message

    subject = f"fleet.events.approvals.po{uuid.uuid4().hex[:8]}"
    plan = {
        "steps": [
            {"id": "gate", "wait": {"event": subject, "type": "po.approved", "timeout_s": 600}},
            {"id": "after", "skill": "sql-query", "input": {"sql": "SELECT 21 AS n"}, "after": ["gate"]},
        ]
    }
    token = stack.token("coordinator", tenant="acme")
    sending = asyncio.create_task(send(stack, user_message(data=plan), token=token))
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn, asyncio.timeout(60):
        while True:
            cursor = await conn.execute(
                "SELECT run_id FROM fleet_runs.runs WHERE state = 'waiting' AND wait->'detail'->>'subject' = %s",
                (subject,),
            )
            row = await cursor.fetchone()
            if row is not None:
                break
            await asyncio.sleep(0.1)
    run_id = str(row[0])
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        # Another tenant's event, and one of another type, on the same subject: not for this run.
        await publish_event(client, subject, tenant="globex", source="erp", type_="po.approved", data={})
        await publish_event(client, subject, tenant="acme", source="erp", type_="po.rejected", data={})
        await asyncio.sleep(1.5)
        assert (await run_when(stack, run_id, ("waiting",)))["state"] == "waiting"
        event_id, _ = await publish_event(
            client, subject, tenant="acme", source="erp", type_="po.approved", data={"po": "PO-9"}
        )
    finally:
        await client.drain()
    outcome = await sending
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
    gate = outcome.result["steps"]["gate"]
    assert gate["expired"] is False
    assert (gate["event"]["id"], gate["event"]["data"]) == (event_id, {"po": "PO-9"})
    assert set(outcome.result["steps"]) == {"gate", "after"}


RECEIVED = "fleet.events.invoices.received"


async def batch_count(stack: Stack, tenant: str) -> tuple[int, int]:
    """(batch runs, their items) of the tenant."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT count(DISTINCT r.run_id), count(i.event_id) FROM fleet_runs.runs r"
            " LEFT JOIN fleet_runs.batch_items i USING (run_id) WHERE r.tenant = %s AND r.owner = %s",
            (tenant, batch_owner("invoices-nightly")),
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def test_a_nights_invoices_gather_into_one_batch_run_that_a_closing_event_lets_go(stack: Stack) -> None:
    """1,000 invoice events of one tenant (and repeats) become one batch run of 1,000 items, which
    waits, holding no process, until the export-done event; it then reviews them in checkpointed
    calls, opening one case per invoice. An invoice after the close is dead-lettered, not lost."""
    tenant = fresh_tenant()
    count = 1000
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        js = client.jetstream()
        items = [
            event_payload(
                tenant=tenant,
                source="erp",
                type_="invoice.received",
                data={"invoice": f"INV-{i}", "amount_cents": 100 * i},
                event_id=f"inv-{tenant}-{i}",
            )
            for i in range(count)
        ]
        await asyncio.gather(*(js.publish(RECEIVED, p, headers={"Nats-Msg-Id": i}) for i, p in items))
        # The same events again under other message ids (past the stream's de-duplication): the
        # ingest keeps one item per event id.
        await asyncio.gather(
            *(js.publish(RECEIVED, p, headers={"Nats-Msg-Id": f"again-{i}"}) for i, p in items[:50])
        )
        async with asyncio.timeout(120):
            while True:
                if await batch_count(stack, tenant) == (1, count):
                    break
                await asyncio.sleep(0.3)
        # The run's id derives from the tenant, the rule and the window of the events' time.
        window = int(dt.datetime.fromisoformat(json.loads(items[0][1])["time"]).timestamp() // 86400)
        run_id = batch_run_id(tenant, "invoices-nightly", window)
        token = stack.token("coordinator", tenant=tenant)
        async with httpx.AsyncClient(timeout=30) as http:
            run = (
                await http.get(
                    f"{stack.endpoints['coordinator']}/v1/runs/{run_id}",
                    headers={"Authorization": f"Bearer {token}"},
                )
            ).json()
        assert run["state"] in ("submitted", "working", "waiting")

        _, done = event_payload(
            tenant=tenant, source="erp", type_="export.done", data={}, event_id=f"done-{tenant}"
        )
        await js.publish("fleet.events.invoices.export_done", done, headers={"Nats-Msg-Id": f"done-{tenant}"})
        finished = await run_when(stack, run_id, ("completed", "failed"), tenant=tenant)
        assert finished["state"] == "completed", finished

        # One case per invoice, each opened once (counted at the tool).
        async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn:
            cursor = await conn.execute(
                "SELECT count(*), count(DISTINCT subject), max(attempts) FROM tenant_data.cases WHERE tenant_id = %s",
                (tenant,),
            )
            cases = await cursor.fetchone()
        assert cases == (count, count, 1)
        events = await all_events(stack, run_id, token)
        closed = next(e for e in events if e["type"] == "batch.closed")
        assert closed["payload"]["items"] == count
        assert closed["payload"]["closed_by"] == f"event done-{tenant}"
        progress = [e for e in events if e["type"] == "batch.progress"]
        assert [e["payload"]["done"] for e in progress][-1] == count

        # A late invoice of the same night: its batch has closed; it is dead-lettered with the reason.
        late_id, late = event_payload(
            tenant=tenant,
            source="erp",
            type_="invoice.received",
            data={"invoice": "INV-late"},
            event_id=f"late-{tenant}",
        )
        await js.publish(RECEIVED, late, headers={"Nats-Msg-Id": late_id})
    finally:
        await client.drain()
    async with asyncio.timeout(30):
        while True:
            mine = [d for d in await dead_letters(stack) if f"late-{tenant}" in d["payload"]]
            if mine:
                break
            await asyncio.sleep(0.3)
    assert "closed" in mine[0]["reason"] and "too late" in mine[0]["reason"]
    assert await batch_count(stack, tenant) == (1, count)
