"""The run store on a real Postgres: ids before work, gap-free event log, fenced writes, tenancy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.record.notifier import RunNotifier
from coordinator.record.runs import NewRun, PostgresRunStore, RunNotFound, RunState, StaleLease
from fleet.keys import SigningKey


@pytest.fixture
async def store(pg_dsn: str) -> AsyncIterator[PostgresRunStore]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=8, open=False, kwargs={"autocommit": True}
    )
    async with pool:
        store = PostgresRunStore(pool)
        await store.setup()
        await store.setup()  # idempotent
        yield store


async def test_run_exists_with_its_first_event_before_any_work(store: PostgresRunStore) -> None:
    run = await store.create_run("r1", "acme", "operator", {"text": "hi"})
    assert (run.state, run.last_seq) == (RunState.SUBMITTED, 1)
    events = await store.events_after("r1", "acme", 0)
    assert [(e.seq, e.type) for e in events] == [(1, "run.submitted")]


async def test_creating_the_same_run_twice_creates_it_once(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    again = await store.create_run("r1", "acme", "operator", {})
    assert again.last_seq == 1
    assert len(await store.events_after("r1", "acme", 0)) == 1


async def test_concurrent_appends_get_gap_free_sequence_numbers(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    lease = await store.acquire_lease("r1", "worker-a", ttl_s=30)
    assert lease is not None
    seqs = await asyncio.gather(*(store.append(lease, "step.progress", "w", {"i": i}) for i in range(40)))
    assert sorted(seqs) == list(range(2, 42))
    assert [e.seq for e in await store.events_after("r1", "acme", 0)] == list(range(1, 42))


async def test_only_one_worker_holds_a_live_lease(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    first = await store.acquire_lease("r1", "worker-a", ttl_s=30)
    assert first is not None
    assert await store.acquire_lease("r1", "worker-b", ttl_s=30) is None


async def test_a_stale_worker_cannot_write_after_its_lease_is_taken_over(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    stale = await store.acquire_lease("r1", "worker-a", ttl_s=0)
    assert stale is not None
    fresh = await store.acquire_lease("r1", "worker-b", ttl_s=30)
    assert fresh is not None and fresh.epoch == stale.epoch + 1
    with pytest.raises(StaleLease):
        await store.append(stale, "step.started", "worker-a", {})
    with pytest.raises(StaleLease):
        await store.transition(stale, RunState.COMPLETED, "worker-a", {})
    with pytest.raises(StaleLease):
        await store.renew_lease(stale, ttl_s=30)
    assert await store.append(fresh, "step.started", "worker-b", {}) == 2
    assert (await store.get_run("r1", "acme")).state == RunState.SUBMITTED


async def test_transition_changes_state_and_records_it(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    lease = await store.acquire_lease("r1", "w", ttl_s=30)
    assert lease is not None
    await store.transition(lease, RunState.FAILED, "w", {"message": "boom"}, reason="specialist_failed")
    run = await store.get_run("r1", "acme")
    assert (run.state, run.reason) == (RunState.FAILED, "specialist_failed")
    last = (await store.events_after("r1", "acme", 1))[-1]
    assert last.type == "run.failed"
    assert last.payload == {"state": "failed", "reason": "specialist_failed", "message": "boom"}


async def test_a_listing_takes_only_the_runs_in_a_state_newest_first(store: PostgresRunStore) -> None:
    for run_id in ("r1", "r2", "r3"):
        await store.create_run(run_id, "acme", "operator", {})
    lease = await store.acquire_lease("r2", "w", ttl_s=30)
    assert lease is not None
    await store.transition(lease, RunState.FAILED, "w", {}, reason="specialist_failed")
    assert [r.run_id for r in await store.list_runs("acme", state=RunState.FAILED)] == ["r2"]
    assert [r.run_id for r in await store.list_runs("acme", state=RunState.SUBMITTED)] == ["r3", "r1"]
    assert [r.run_id for r in await store.list_runs("acme", limit=1)] == ["r3"]


async def test_another_tenant_cannot_see_a_run_or_its_events(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    with pytest.raises(RunNotFound):
        await store.get_run("r1", "globex")
    assert await store.events_after("r1", "globex", 0) == []
    assert [r.run_id for r in await store.list_runs("acme")] == ["r1"]
    assert await store.list_runs("globex") == []


async def test_follow_replays_then_tails_until_the_run_ends(store: PostgresRunStore, pg_dsn: str) -> None:
    await store.create_run("r1", "acme", "operator", {})
    lease = await store.acquire_lease("r1", "w", ttl_s=30)
    assert lease is not None
    await store.append(lease, "plan", "w", {})
    seen: list[int] = []
    caught_up = asyncio.Event()

    async def read(notifier: RunNotifier) -> None:
        async for event in store.follow("r1", "acme", 1, notifier):
            seen.append(event.seq)
            caught_up.set()

    async with RunNotifier(pg_dsn) as notifier:
        reader = asyncio.create_task(read(notifier))
        async with asyncio.timeout(10):
            await caught_up.wait()
            await store.append(lease, "step.started", "w", {})
            await store.transition(lease, RunState.COMPLETED, "w", {})
            await reader
    assert seen == [2, 3, 4]


async def test_cancel_request_is_recorded_once_and_stops_the_next_write(store: PostgresRunStore) -> None:
    from coordinator.record.runs import CancelRequested

    await store.create_run("r1", "acme", "operator", {})
    lease = await store.acquire_lease("r1", "w", ttl_s=30)
    assert lease is not None
    assert (await store.request_cancel("r1", "acme", "operator")).cancel_requested
    await store.request_cancel("r1", "acme", "operator")  # idempotent
    assert await store.renew_lease(lease, ttl_s=30) is True
    with pytest.raises(CancelRequested):
        await store.append(lease, "step.progress", "w", {})
    await store.transition(lease, RunState.CANCELED, "w", {}, reason="canceled")
    types = [e.type for e in await store.events_after("r1", "acme", 0)]
    assert types == ["run.submitted", "run.cancel_requested", "step.progress", "run.canceled"]


async def test_cancel_of_a_run_no_worker_holds_ends_it_at_once(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    run = await store.request_cancel("r1", "acme", "operator")
    assert (run.state, run.reason) == (RunState.CANCELED, "canceled")
    types = [e.type for e in await store.events_after("r1", "acme", 0)]
    assert types == ["run.submitted", "run.cancel_requested", "run.canceled"]
    assert await store.acquire_lease("r1", "late-worker", ttl_s=30) is None


async def test_cancel_request_leaves_a_finished_run_alone(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    lease = await store.acquire_lease("r1", "w", ttl_s=30)
    assert lease is not None
    await store.transition(lease, RunState.COMPLETED, "w", {})
    run = await store.request_cancel("r1", "acme", "operator")
    assert (run.state, run.cancel_requested) == (RunState.COMPLETED, False)
    with pytest.raises(RunNotFound):
        await store.request_cancel("r1", "globex", "intruder")


async def test_nothing_is_written_after_a_terminal_state(store: PostgresRunStore) -> None:
    await store.create_run("r1", "acme", "operator", {})
    lease = await store.acquire_lease("r1", "w", ttl_s=30)
    assert lease is not None
    await store.transition(lease, RunState.COMPLETED, "w", {})
    with pytest.raises(StaleLease):
        await store.append(lease, "artifact", "w", {})
    with pytest.raises(StaleLease):
        await store.transition(lease, RunState.FAILED, "w", {})
    await store.release_lease(lease)
    assert await store.acquire_lease("r1", "late-worker", ttl_s=30) is None
    assert (await store.get_run("r1", "acme")).state == RunState.COMPLETED


async def test_stranded_runs_are_the_unfinished_unheld_and_still_ones(store: PostgresRunStore) -> None:
    for run_id in ("queued", "held", "done"):
        await store.create_run(run_id, "acme", "operator", {})
    held = await store.acquire_lease("held", "w", ttl_s=30)
    done = await store.acquire_lease("done", "w", ttl_s=30)
    assert held is not None and done is not None
    await store.transition(done, RunState.COMPLETED, "w", {})
    assert await store.stranded_runs(older_than_s=3600) == []
    assert await store.stranded_runs(older_than_s=0) == [("queued", 1)]


async def test_secrets_never_reach_the_event_log_or_the_recorded_request(store: PostgresRunStore) -> None:
    jwt = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXZhbHVl"
    plan = [{"id": "s1", "skill": "x", "input": {"api_key": "sk-live-1"}}]
    run = await store.create_run("r1", "acme", "operator", {"text": f"use Bearer {jwt}"}, plan)
    assert run.plan == plan  # the run executes with what it was given
    assert jwt not in str(run.request)
    lease = await store.acquire_lease("r1", "w1", 60)
    assert lease is not None
    await store.append(lease, "step.progress", "w1", {"text": f"token {jwt}", "password": "hunter2"})
    events = await store.events_after("r1", "acme", 0)
    logged = " ".join(str(e.payload) for e in events)
    assert "sk-live-1" not in logged and jwt not in logged and "hunter2" not in logged
    assert events[-1].payload["redacted"] == 2
    assert events[0].payload["steps"] == [{"id": "s1", "skill": "x"}]  # the plan's shape, not its inputs


async def test_many_runs_are_created_in_one_go_each_as_one_would_be(store: PostgresRunStore) -> None:
    jwt = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhbGljZSJ9.c2lnbmF0dXJlLXZhbHVl"
    plan = [{"id": "s1", "skill": "x", "input": {"n": 1}}]
    await store.create_run("b0", "acme", "operator", {}, plan)  # exists already: left as it is
    runs = [
        NewRun(f"b{i}", "acme", "event:billing", {"text": f"Bearer {jwt}", "i": i}, plan) for i in range(5)
    ]
    assert await store.create_runs(runs) == {"b1", "b2", "b3", "b4"}
    assert await store.create_runs(runs) == set()  # again: nothing new
    for i in range(1, 5):
        run = await store.get_run(f"b{i}", "acme")
        assert (run.state, run.last_seq, run.owner, run.plan) == (
            RunState.SUBMITTED,
            1,
            "event:billing",
            plan,
        )
        assert jwt not in str(run.request) and run.request["i"] == i
        events = await store.events_after(f"b{i}", "acme", 0)
        assert [(e.seq, e.type, e.payload["steps"]) for e in events] == [
            (1, "run.submitted", [{"id": "s1", "skill": "x"}])
        ]
    assert (await store.get_run("b0", "acme")).owner == "operator"


async def test_a_failure_creating_many_runs_creates_none(store: PostgresRunStore) -> None:
    plan = [{"id": "s1", "skill": "x", "input": {}}]
    runs = [NewRun("c1", "acme", "o", {}, plan), NewRun("c2", "acme", "o", {"bad": "\x00"}, plan)]
    with pytest.raises(Exception):  # noqa: B017 - Postgres refuses a NUL in text
        await store.create_runs(runs)
    with pytest.raises(RunNotFound):
        await store.get_run("c1", "acme")


async def test_the_runs_waiting_for_events_are_found_for_many_events_at_once(
    store: PostgresRunStore, pg_dsn: str
) -> None:
    closed = "fleet.events.invoices.closed"
    waits = {
        "w1": ("acme", {"type": "event", "awaited": "event:a", "detail": {"subject": closed}}),
        "w2": (
            "acme",
            {
                "type": "approval",
                "awaited": "gate:g",
                "detail": {
                    "others": [
                        {"type": "event", "awaited": "event:b", "subject": closed, "event_source": "erp"}
                    ]
                },
            },
        ),
        "w3": ("globex", {"type": "event", "awaited": "event:c", "detail": {"subject": closed}}),
        "w4": ("acme", {"type": "event", "awaited": "event:d", "detail": {"subject": "fleet.events.other"}}),
    }
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for run_id, (tenant, wait) in waits.items():
            await store.create_run(run_id, tenant, "operator", {})
            await conn.execute(
                "UPDATE fleet_runs.runs SET state = 'waiting', wait = %s WHERE run_id = %s",
                (Jsonb(wait), run_id),
            )
    from_erp = ("acme", closed, "invoices.closed", "erp")
    from_crm = ("acme", closed, "invoices.closed", "crm")
    found = await store.awaiting_events([from_erp, from_crm, ("globex", closed, "x", "erp"), from_erp])
    assert sorted(found[from_erp]) == [("w1", "event:a"), ("w2", "event:b")]
    assert found[from_crm] == [("w1", "event:a")]  # w2 waits for erp's alone
    assert found[("globex", closed, "x", "erp")] == [("w3", "event:c")]  # its tenant's runs only
    assert await store.awaiting_events([]) == {}


async def test_a_run_grant_is_stored_packed_and_read_back_whole(store: PostgresRunStore, pg_dsn: str) -> None:
    key = SigningKey.generate()
    grant = key.sign(
        {"sub": "alice", "run_id": "g1", "token_use": "run_grant", "tenant": "acme"}, typ="run-grant+jwt"
    )
    await store.create_run("g1", "acme", "alice", {}, grant=grant)
    assert await store.run_grant("g1") == grant
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        row = await (await conn.execute("SELECT grant_token FROM fleet_runs.run_grants")).fetchone()
    assert row is not None and len(row[0]) < 0.6 * len(grant) and grant.encode() not in row[0]
    assert await store.run_grant("nobody") is None


async def test_grants_stored_as_text_before_packing_are_read_after_the_upgrade(pg_dsn: str) -> None:
    key = SigningKey.generate()
    grant = key.sign({"sub": "alice", "run_id": "old"}, typ="run-grant+jwt")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(
            "CREATE SCHEMA fleet_runs;"
            " CREATE TABLE fleet_runs.runs (run_id text PRIMARY KEY, tenant text NOT NULL, owner text NOT NULL,"
            "  state text NOT NULL, reason text, request jsonb NOT NULL, plan jsonb, last_seq bigint NOT NULL DEFAULT 0,"
            "  lease_owner text, lease_epoch bigint NOT NULL DEFAULT 0, lease_expires_at timestamptz,"
            "  cancel_requested boolean NOT NULL DEFAULT false, created_at timestamptz NOT NULL DEFAULT now(),"
            "  updated_at timestamptz NOT NULL DEFAULT now());"
            " CREATE TABLE fleet_runs.run_grants (run_id text PRIMARY KEY"
            "  REFERENCES fleet_runs.runs (run_id) ON DELETE CASCADE, grant_token text NOT NULL);"
        )
        await conn.execute(
            "INSERT INTO fleet_runs.runs (run_id, tenant, owner, state, request) VALUES ('old', 'acme', 'alice', 'waiting', '{}')"
        )
        await conn.execute("INSERT INTO fleet_runs.run_grants VALUES ('old', %s)", (grant,))
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}
    )
    async with pool:
        store = PostgresRunStore(pool)
        await store.setup()
        await store.setup()
        assert await store.run_grant("old") == grant
        fresh = key.sign({"sub": "alice", "run_id": "new"}, typ="run-grant+jwt")
        await store.create_run("new", "acme", "alice", {}, grant=fresh)
        assert await store.run_grant("new") == fresh
