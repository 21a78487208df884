"""The operations ledger on a real Postgres: intents bound to their arguments, fenced by the lease,
each change logged at the run's next sequence number, and a person's resolution."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from coordinator.record.operations import Ledger, OperationConflict, OpStatus, operation_id
from coordinator.record.runs import Lease, PostgresRunStore, RunState, StaleLease
from fleet.errors import FleetError


@pytest.fixture
async def stores(pg_dsn: str) -> AsyncIterator[tuple[PostgresRunStore, Ledger]]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=8, open=False, kwargs={"autocommit": True}
    )
    async with pool:
        store, ledger = PostgresRunStore(pool), Ledger(pool)
        await store.setup()
        await ledger.setup()
        await ledger.setup()  # idempotent
        yield store, ledger


async def leased_run(store: PostgresRunStore, run_id: str = "r1") -> Lease:
    await store.create_run(run_id, "acme", "operator", {}, [{"id": "s1", "skill": "x", "input": {}}])
    lease = await store.acquire_lease(run_id, "w1", 60)
    assert lease is not None
    return lease


async def types(store: PostgresRunStore, run_id: str = "r1") -> list[tuple[int, str]]:
    return [(e.seq, e.type) for e in await store.events_after(run_id, "acme", 0)]


ARGS = {"skill": "x", "input": {"n": 1}}


async def test_an_intent_is_recorded_once_and_bound_to_its_arguments(
    stores: tuple[PostgresRunStore, Ledger],
) -> None:
    store, ledger = stores
    lease = await leased_run(store)
    op, _ = await ledger.record_intent(lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS)
    assert (op.op_id, op.status, op.attempts) == (operation_id("r1", "s1"), OpStatus.PENDING, 1)
    again, created = await ledger.record_intent(
        lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS
    )
    assert (again.op_id, created) == (op.op_id, False)
    with pytest.raises(OperationConflict):
        await ledger.record_intent(
            lease, "w1", step_id="s1", kind="delegate", target="agent", args={**ARGS, "input": {"n": 2}}
        )
    assert await types(store) == [(1, "run.submitted"), (2, "operation.intent")]


async def test_a_stale_worker_can_neither_record_an_intent_nor_an_outcome(
    stores: tuple[PostgresRunStore, Ledger],
) -> None:
    store, ledger = stores
    lease = await leased_run(store)
    op, _ = await ledger.record_intent(lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS)
    await store.release_lease(lease)
    newer = await store.acquire_lease("r1", "w2", 60)
    assert newer is not None
    with pytest.raises(StaleLease):
        await ledger.record_intent(lease, "w1", step_id="s2", kind="delegate", target="agent", args=ARGS)
    with pytest.raises(StaleLease):
        await ledger.record_outcome(lease, "w1", op.op_id, OpStatus.SUCCEEDED, result={"ok": 1})
    with pytest.raises(StaleLease):  # not even the operation it recorded itself comes back
        await ledger.record_intent(lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS)
    assert await ledger.get(operation_id("r1", "s2")) is None
    assert (await ledger.get(op.op_id)).status == OpStatus.PENDING  # type: ignore[union-attr]
    await ledger.record_outcome(newer, "w2", op.op_id, OpStatus.SUCCEEDED, result={"ok": 1})
    done = await ledger.get(op.op_id)
    assert done is not None and (done.status, done.result) == (OpStatus.SUCCEEDED, {"ok": 1})
    assert [t for _, t in await types(store)][-1] == "operation.succeeded"
    seqs = [s for s, _ in await types(store)]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_a_person_resolves_an_operation_only_while_the_run_waits(
    stores: tuple[PostgresRunStore, Ledger],
) -> None:
    store, ledger = stores
    lease = await leased_run(store)
    op, _ = await ledger.record_intent(lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS)
    await ledger.record_outcome(
        lease, "w1", op.op_id, OpStatus.NEEDS_HUMAN, error={"code": "outcome_unknown"}
    )
    with pytest.raises(FleetError, match="not waiting"):
        await ledger.resolve("r1", "acme", op.op_id, "succeeded", "alice")
    await store.transition(
        lease, RunState.WAITING, "w1", {}, wait={"type": "needs_human", "awaited": op.op_id}
    )
    await store.release_lease(lease)
    with pytest.raises(FleetError, match="not waiting"):  # another tenant sees no such run
        await ledger.resolve("r1", "globex", op.op_id, "succeeded", "mallory")
    resolved, seq = await ledger.resolve(
        "r1", "acme", op.op_id, "succeeded", "alice", result={"v": 1}, note="seen"
    )
    assert (resolved.status, resolved.result) == (OpStatus.SUCCEEDED, {"v": 1})
    run = await store.get_run("r1", "acme")
    assert (run.state, run.wait, run.last_seq) == (RunState.SUBMITTED, None, seq)
    last = (await store.events_after("r1", "acme", seq - 1))[0]
    assert (last.type, last.actor, last.payload["note"]) == ("operation.resolved", "alice", "seen")
    with pytest.raises(FleetError):  # answered already
        await ledger.resolve("r1", "acme", op.op_id, "failed", "alice")
