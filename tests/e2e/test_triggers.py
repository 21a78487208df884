"""Ambient triggers: events on ``fleet.events.<tenant>.<source>.<name>...`` start runs through the
trigger policy, once per (tenant, source, id); the tenant and source are the subject's, never the
envelope's; malformed events go to the dead-letter subject without holding up the rest. Real NATS
JetStream, Postgres and the coordinator's ingest, with the shipped policy bundle (rule
``invoices-closed``). The stack's NATS is unauthenticated for now, so a test can publish as any
tenant's producer would (the per-identity permissions are what confine a real one to its subjects)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import uuid
from typing import Any

import httpx
import psycopg
import pytest
from nats.js.errors import ServerError

from coordinator.control.triggers import CONSUMER, batch_owner, batch_run_id
from fleet.events import (
    DEAD_LETTER_STREAM,
    EVENTS_DUPLICATE_WINDOW_S,
    EVENTS_STREAM,
    Event,
    ensure_event_streams,
    event_message,
    event_subject,
    publish_event,
    publish_message,
    publish_raw,
)
from fleet.natsconn import connect
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import Stack, all_events, fleet
from tests.e2e.a2a_helpers import fresh_tenant

pytestmark = pytest.mark.e2e

CLOSED = "fleet.events.invoices.closed"  # the logical subject of the rule invoices-closed
# Runs started by triggers are owned by event:<source>: reading them takes the tenant-admin scope.
ADMIN = ("agent:invoke", "runs:admin")


def on(tenant: str, source: str, subject: str = CLOSED) -> str:
    """The NATS subject of an event of ``tenant`` from ``source`` on the logical ``subject``."""
    return event_subject(subject, tenant=tenant, source=source)


def run_id_for(tenant: str, source: str, event_id: str) -> str:
    return Event(CLOSED, event_id, source, "invoices.closed", tenant, "", {}).run_id()


async def run_when(
    stack: Stack, run_id: str, states: tuple[str, ...], tenant: str = "acme"
) -> dict[str, Any]:
    token = stack.token("coordinator", tenant=tenant, scopes=ADMIN)  # triggers start them, not the operator
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


async def runs_among(stack: Stack, run_ids: list[str]) -> list[tuple[str, str, int]]:
    """(run id, tenant, how many times it was submitted by an event) of those of ``run_ids`` that exist."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
        cursor = await conn.execute(
            "SELECT r.run_id, r.tenant, count(e.seq) FROM fleet_runs.runs r LEFT JOIN fleet_runs.events e"
            " ON e.run_id = r.run_id AND e.type = 'run.submitted' WHERE r.run_id = ANY(%s)"
            " GROUP BY r.run_id, r.tenant",
            (run_ids,),
        )
        return sorted((str(r[0]), str(r[1]), int(r[2])) for r in await cursor.fetchall())


async def publish(stack: Stack, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> int:
    """Publish bytes on a NATS subject as any producer could; the stream sequence they got."""
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        js = client.jetstream()
        await ensure_event_streams(js)
        ack = await js.publish(subject, payload, headers=headers)
    finally:
        await client.drain()
    return int(ack.seq)


async def settled(stack: Stack, seq: int) -> None:
    """Wait until the trigger ingest has settled (acked: started, ignored or dead-lettered) every
    event of the stream up to ``seq``."""
    client = await connect(stack.endpoints["nats"], "test-settled", credentials=stack_admin(stack.endpoints))
    try:
        js = client.jetstream()
        async with asyncio.timeout(90):
            while True:
                info = await js.consumer_info(EVENTS_STREAM, CONSUMER)
                if info.ack_floor is not None and info.ack_floor.stream_seq >= seq:
                    return
                await asyncio.sleep(0.1)
    finally:
        await client.drain()


async def test_an_event_published_twice_with_one_id_makes_one_run(stack: Stack) -> None:
    event_id = f"close-{uuid.uuid4().hex[:8]}"
    args = ("events", "publish", "--data-dir", stack.data_dir, CLOSED, "--id", event_id, "--tenant", "acme")
    first = await asyncio.to_thread(fleet, *args, "--data", '{"night": "2026-11-28"}', "--json", timeout=60)
    assert first.returncode == 0, first.stderr
    said = json.loads(first.stdout)
    assert said["published"] and said["nats_subject"] == "fleet.events.acme.cli.invoices.closed"
    again = await asyncio.to_thread(fleet, *args, "--data", '{"night": "2026-11-28"}', timeout=60)
    assert again.returncode == 0, again.stderr  # kept or dropped by the stream: either way one run

    run_id = run_id_for("acme", "cli", event_id)
    run = await run_when(stack, run_id, ("completed", "failed"))
    assert run["state"] == "completed", run
    assert run["owner"] == "event:cli"

    # The same event again under another message id (as after the stream's short de-duplication
    # window): the run id derives from the tenant, source and event id, so it finds its run.
    seq = await publish(stack, on("acme", "cli"), envelope(event_id), {"Nats-Msg-Id": "republished"})
    await settled(stack, seq)
    assert await runs_among(stack, [run_id]) == [(run_id, "acme", 1)]


def envelope(event_id: str, *, data: dict[str, Any] | None = None, **claims: str) -> bytes:
    """A structured-mode envelope; ``claims`` (``tenant``, ``source``) are what it says of itself."""
    return json.dumps({"id": event_id, "type": "invoices.closed", "data": data or {}, **claims}).encode()


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


async def dead_letters_of(stack: Stack, marker: str, count: int) -> list[dict[str, Any]]:
    """The ``count`` dead letters whose payload holds ``marker``, once they are all there."""
    async with asyncio.timeout(30):
        while True:
            mine = [d for d in await dead_letters(stack) if marker in d["payload"]]
            if len(mine) >= count:
                return mine
            await asyncio.sleep(0.3)


async def test_a_malformed_event_is_dead_lettered_with_its_reason_and_the_rest_flow(stack: Stack) -> None:
    marker = uuid.uuid4().hex[:8]
    good = f"good-{marker}"
    await publish(stack, on("acme", "test"), b"this is not json " + marker.encode())
    await publish(stack, on("acme", "test"), json.dumps({"id": f"no-type-{marker}"}).encode())
    # The layout before tenants and sources were in the subject: no name token left.
    await publish(stack, CLOSED, envelope(f"old-{marker}", tenant="acme", source="test"))
    await publish(stack, on("acme", "test"), envelope(good))
    run = await run_when(stack, run_id_for("acme", "test", good), ("completed", "failed"))
    assert run["state"] == "completed"
    mine = await dead_letters_of(stack, marker, 3)
    reasons = {d["subject"]: d["reason"] for d in mine if "not JSON" not in d["reason"]}
    assert any("not JSON" in d["reason"] for d in mine)
    assert "'type'" in reasons[on("acme", "test")]
    assert "fleet.events.<tenant>.<source>.<name>" in reasons[CLOSED]


async def test_an_envelope_claiming_another_tenant_than_its_subject_is_dead_lettered_and_starts_nothing(
    stack: Stack,
) -> None:
    """A producer allowed only on tenant mallory's subjects claims acme in the envelope: refused."""
    forged = f"forged-{uuid.uuid4().hex[:8]}"
    seq = await publish(stack, on("mallory", "erp"), envelope(forged, tenant="acme", source="erp"))
    await settled(stack, seq)
    (letter,) = await dead_letters_of(stack, forged, 1)
    assert letter["subject"] == on("mallory", "erp")
    assert "names tenant 'acme' but its subject's tenant is 'mallory'" in letter["reason"]
    assert await runs_among(stack, [run_id_for(t, "erp", forged) for t in ("acme", "mallory")]) == []


async def test_the_same_event_id_from_two_tenants_or_two_sources_makes_a_run_each_and_from_one_twice_one(
    stack: Stack,
) -> None:
    event_id = f"shared-{uuid.uuid4().hex[:8]}"
    producers = [("acme", "erp"), ("globex", "erp"), ("acme", "crm")]
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        for tenant, source in producers:
            _, kept = await publish_event(
                client,
                CLOSED,
                tenant=tenant,
                source=source,
                type_="invoices.closed",
                data={},
                event_id=event_id,
            )
            assert kept  # the stream's message id holds tenant and source: nothing is dropped
        # The first producer again, with the fleet's own message id and with another one.
        message = event_message(
            CLOSED, tenant="acme", source="erp", type_="invoices.closed", data={}, event_id=event_id
        )
        await publish_message(client, message)
        await publish_raw(client, message.subject, message.payload, "another-message-id")
    finally:
        await client.drain()
    seq = await publish(stack, on("acme", "erp"), envelope(f"sentinel-{event_id}"))
    await settled(stack, seq)
    expected = sorted((run_id_for(t, s, event_id), t, 1) for t, s in producers)
    assert await runs_among(stack, [r for r, _, _ in expected]) == expected


async def test_a_binary_mode_event_starts_a_run(stack: Stack) -> None:
    event_id = f"binary-{uuid.uuid4().hex[:8]}"
    headers = {
        "ce-specversion": "1.0",
        "ce-id": event_id,
        "ce-source": "ledger",
        "ce-type": "invoices.closed",
        "ce-time": dt.datetime.now(dt.UTC).isoformat(),
        "ce-subject": "night-2026-11-28",
        "content-type": "application/json",
        "Nats-Msg-Id": f"acme/ledger/{event_id}",
    }
    await publish(stack, on("acme", "ledger"), b'{"night": "2026-11-28"}', headers)
    run = await run_when(stack, run_id_for("acme", "ledger", event_id), ("completed", "failed"))
    assert run["state"] == "completed", run
    assert run["owner"] == "event:ledger"


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
            await publish_raw(client, on("bulk", source), envelope(event_id), event_id)
    finally:
        await client.drain()
    async with asyncio.timeout(120):
        while True:
            if await runs_owned_by(stack, f"event:{source}") >= len(ids):
                break
            await asyncio.sleep(0.5)
    await settled(stack, await publish(stack, on("bulk", source), envelope(f"{source}-last")))
    assert await runs_owned_by(stack, f"event:{source}") == len(ids) + 1  # none for the weather event


async def test_an_event_whose_run_cannot_be_stored_is_dead_lettered_at_once_and_its_burst_still_starts(
    stack: Stack,
) -> None:
    """The ingest creates a fetch's runs in one transaction: one event that Postgres refuses (a NUL
    character in its data, which JSON allows and jsonb does not) must fail alone, at once, with its
    reason, not take the others of its transaction with it nor come back five times."""
    source = f"burst-{uuid.uuid4().hex[:8]}"
    ids = [f"{source}-{i}" for i in range(30)]
    poison = f"{source}-nul"
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        for event_id in ids[:15]:
            await publish_raw(client, on("bulk", source), envelope(event_id), event_id)
        await publish_raw(client, on("bulk", source), envelope(poison, data={"note": "a\u0000b"}), poison)
        for event_id in ids[15:]:
            await publish_raw(client, on("bulk", source), envelope(event_id), event_id)
    finally:
        await client.drain()
    (letter,) = await dead_letters_of(stack, poison, 1)
    assert letter["error"]["code"] == "invalid_request", letter
    assert "cannot be stored" in letter["reason"]
    assert letter["deliveries"] == 1  # refused at once: what it holds fails every time
    started = [run_id_for("bulk", source, event_id) for event_id in ids]
    async with asyncio.timeout(60):
        while True:
            if len(await runs_among(stack, started)) == len(ids):
                break
            await asyncio.sleep(0.3)
    assert await runs_among(stack, started) == sorted((run_id, "bulk", 1) for run_id in started)
    assert await runs_among(stack, [run_id_for("bulk", source, poison)]) == []


async def test_a_run_waits_for_an_event_of_its_tenant_and_source_and_goes_on_with_it(stack: Stack) -> None:
    from fleetctl.testing.e2e import send, user_message

    name = f"approvals.po{uuid.uuid4().hex[:8]}"
    subject = f"fleet.events.{name}"
    plan = {
        "steps": [
            {
                "id": "gate",
                "wait": {"event": subject, "type": "po.approved", "source": "erp", "timeout_s": 600},
            },
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
    approved = {"type": "po.approved", "data": {"po": "PO-9"}}
    # Not for this run: another tenant's event (claiming acme in its envelope, or not), one of
    # another type, and one of acme from another source than the gate names.
    await publish(stack, on("globex", "erp", subject), json.dumps({"id": "x1", **approved}).encode())
    await publish(
        stack, on("globex", "erp", subject), json.dumps({"id": "x2", "tenant": "acme", **approved}).encode()
    )
    await publish(stack, on("acme", "erp", subject), json.dumps({"id": "x3", "type": "po.rejected"}).encode())
    seq = await publish(stack, on("acme", "crm", subject), json.dumps({"id": "x4", **approved}).encode())
    await settled(stack, seq)
    assert (await run_when(stack, run_id, ("waiting",)))["state"] == "waiting"
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
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
    assert (gate["event"]["tenant"], gate["event"]["source"]) == ("acme", "erp")
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
            event_message(
                RECEIVED,
                tenant=tenant,
                source="erp",
                type_="invoice.received",
                data={"invoice": f"INV-{i}", "amount_cents": 100 * i},
                event_id=f"inv-{tenant}-{i}",
            )
            for i in range(count)
        ]
        await asyncio.gather(*(js.publish(m.subject, m.payload, headers=m.headers) for m in items))
        # The same events again under other message ids (past the stream's de-duplication): the
        # ingest keeps one item per (source, event id).
        await asyncio.gather(
            *(js.publish(m.subject, m.payload, headers={"Nats-Msg-Id": f"again-{m.id}"}) for m in items[:50])
        )
        async with asyncio.timeout(120):
            while True:
                if await batch_count(stack, tenant) == (1, count):
                    break
                await asyncio.sleep(0.3)
        # The run's id derives from the tenant, the rule and the window of the events' time.
        window = int(dt.datetime.fromisoformat(json.loads(items[0].payload)["time"]).timestamp() // 86400)
        run_id = batch_run_id(tenant, "invoices-nightly", window)
        token = stack.token("coordinator", tenant=tenant, scopes=ADMIN)
        async with httpx.AsyncClient(timeout=30) as http:
            run = (
                await http.get(
                    f"{stack.endpoints['coordinator']}/v1/runs/{run_id}",
                    headers={"Authorization": f"Bearer {token}"},
                )
            ).json()
        assert run["state"] in ("submitted", "working", "waiting")

        done = event_message(
            "fleet.events.invoices.export_done",
            tenant=tenant,
            source="erp",
            type_="export.done",
            data={},
            event_id=f"done-{tenant}",
        )
        await publish_message(client, done)
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
        late = event_message(
            RECEIVED,
            tenant=tenant,
            source="erp",
            type_="invoice.received",
            data={"invoice": "INV-late"},
            event_id=f"late-{tenant}",
        )
        await publish_message(client, late)
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


async def test_the_same_item_id_from_two_sources_is_two_items_of_the_tenants_batch(stack: Stack) -> None:
    tenant = fresh_tenant()
    client = await connect(stack.endpoints["nats"], "test-producer", credentials=stack_admin(stack.endpoints))
    try:
        for source in ("erp", "erp", "crm"):  # erp twice: one item
            message = event_message(
                RECEIVED,
                tenant=tenant,
                source=source,
                type_="invoice.received",
                data={"invoice": "INV-1"},
                event_id="inv-1",
            )
            await publish_raw(client, message.subject, message.payload, f"{source}-{uuid.uuid4().hex}")
    finally:
        await client.drain()
    await settled(
        stack, await publish(stack, on(tenant, "erp", "fleet.events.nothing.matches"), envelope("s"))
    )
    assert await batch_count(stack, tenant) == (1, 2)


async def test_the_events_stream_de_duplicates_only_for_the_100_ms_nats_server_allows(stack: Stack) -> None:
    """The broker's de-duplication is not trusted across producers, so its window is the smallest
    nats-server takes; a stream made by an earlier version (an hour) is narrowed when opened."""
    client = await connect(stack.endpoints["nats"], "test-streams", credentials=stack_admin(stack.endpoints))
    try:
        js = client.jetstream()
        config = (await js.stream_info(EVENTS_STREAM)).config
        assert config.duplicate_window == EVENTS_DUPLICATE_WINDOW_S == 0.1
        with pytest.raises(ServerError) as refused:
            await js.update_stream(dataclasses.replace(config, duplicate_window=0.099))
        assert refused.value.err_code == 10052  # "duplicates window needs to be >= 100ms"
        await js.update_stream(dataclasses.replace(config, duplicate_window=3600.0))
        await ensure_event_streams(js)
        assert (await js.stream_info(EVENTS_STREAM)).config.duplicate_window == 0.1
    finally:
        await client.drain()
