"""The operations ledger on a real Postgres: intents bound to their arguments, fenced by the lease,
each change logged at the run's next sequence number, and a person's resolution."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.engine.graph import gate_of
from coordinator.record.operations import Ledger, OperationConflict, OpStatus, operation_id
from coordinator.record.runs import Lease, PostgresRunStore, RunState, StaleLease, wait_requests
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


@pytest.mark.parametrize(
    "result",
    [
        {  # an approval: the why under "why", the request beside it
            "status": "pending_approval",
            "why": "refunds over 100 need a person",
            "approval_request": {"server": "mcp-cases", "tool": "refund", "args_sha256": "ab" * 32},
            "amount": 250.5,
        },
        {"user_input_required": True, "question": "which account?", "choices": ["a", "b"], "why": 3},
        {"status": "input_required", "details": [{"k": "v"}]},  # no why at all
    ],
)
async def test_what_a_gate_asked_is_kept_once_and_read_back_whole(
    stores: tuple[PostgresRunStore, Ledger], pg_dsn: str, result: dict[str, Any]
) -> None:
    """The run's wait record leaves out what the gated step asked (the ledger holds the result it
    came from) and every read of the run derives it again, by the same rule as the graph's gate."""
    store, ledger = stores
    lease = await leased_run(store)
    op, _ = await ledger.record_intent(
        lease, "w1", step_id="s1", kind="a2a", target="case-desk", args={"n": 1}
    )
    await ledger.record_outcome(lease, "w1", op.op_id, OpStatus.SUCCEEDED, result=result)
    gate = gate_of(result)
    assert gate is not None
    wait = {
        "type": gate["type"],
        "awaited": "approval:s1:0",
        "deadline": "2030-01-01T00:00:00+00:00",
        "detail": {"step": "s1", "op_id": op.op_id, "why": gate["why"], "asked": gate["asked"]},
    }
    await store.transition(lease, RunState.WAITING, "w1", {}, wait=wait)
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        row = await (await conn.execute("SELECT wait FROM fleet_runs.runs WHERE run_id = 'r1'")).fetchone()
    assert row is not None and "asked" not in row[0]["detail"]  # not stored twice
    read = (await store.get_run("r1", "acme")).wait
    assert read == wait
    assert (await store.list_runs("acme"))[0].wait == wait
    assert [r.get("asked") for r in wait_requests(read or {})] == [gate["asked"]]


async def test_a_wait_record_that_names_no_operation_is_kept_as_it_is(
    stores: tuple[PostgresRunStore, Ledger], pg_dsn: str
) -> None:
    """Old records (which hold what was asked) and waits of other kinds read as they were written."""
    store, _ = stores
    lease = await leased_run(store)
    wait = {"type": "approval", "awaited": "approval:s1:0", "detail": {"step": "s1", "asked": {"x": 1}}}
    await store.transition(lease, RunState.WAITING, "w1", {}, wait=wait)
    assert (await store.get_run("r1", "acme")).wait == wait
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        written = {"type": "approval", "awaited": "a", "detail": {"op_id": "op-x", "asked": {"y": 2}}}
        await conn.execute("UPDATE fleet_runs.runs SET wait = %s WHERE run_id = 'r1'", (Jsonb(written),))
    assert (await store.get_run("r1", "acme")).wait == written


async def test_a_wait_record_naming_another_runs_operation_reads_nothing_of_it(
    stores: tuple[PostgresRunStore, Ledger],
) -> None:
    """What an approver is shown (and the approval grant's argument hash) comes from the run's own
    ledger only: a wait record that names another run's operation gets nothing from it."""
    store, ledger = stores
    other = await leased_run(store, "r2")
    op, _ = await ledger.record_intent(
        other, "w1", step_id="s1", kind="a2a", target="case-desk", args={"n": 1}
    )
    asked = {"approval_request": {"server": "mcp-cases", "tool": "refund", "args_sha256": "cd" * 32}}
    await ledger.record_outcome(
        other, "w1", op.op_id, OpStatus.SUCCEEDED, result={"status": "pending_approval", **asked}
    )
    lease = await leased_run(store)
    wait = {
        "type": "approval",
        "awaited": "approval:s1:0",
        "detail": {"step": "s1", "op_id": op.op_id, "asked": asked},
    }
    await store.transition(lease, RunState.WAITING, "w1", {}, wait=wait)
    read = (await store.get_run("r1", "acme")).wait
    assert read is not None and read["detail"]["asked"] == {}


async def test_progress_notes_are_kept_only_from_the_agent_an_operation_went_to_while_it_is_pending(
    stores: tuple[PostgresRunStore, Ledger],
) -> None:
    store, ledger = stores
    lease = await leased_run(store)
    op, _ = await ledger.record_intent(lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS)
    notes = {"v": 1, "summary": "halfway", "calls": []}
    assert await ledger.record_progress("r1", op.op_id, "agent", notes)
    # Another agent cannot write the operation's notes, nor read them back as its own.
    assert not await ledger.record_progress("r1", op.op_id, "intruder", {"v": 1, "summary": "forged"})
    assert not await ledger.record_progress("r2", op.op_id, "agent", {"v": 1, "summary": "another run"})
    assert await ledger.progress_for(op.op_id, "agent") == notes
    assert await ledger.progress_for(op.op_id, "intruder") is None
    # Notes past the bound are not kept; the last ones stand.
    assert not await ledger.record_progress("r1", op.op_id, "agent", {"v": 1, "summary": "x" * 90_000})
    assert await ledger.progress_for(op.op_id, "agent") == notes
    # Once the operation has an outcome, its agent writes no more notes (the kept ones stay readable).
    await ledger.record_outcome(
        lease, "w1", op.op_id, OpStatus.SUCCEEDED, result={"ok": 1}, usage={"llm_tokens": 5}
    )
    assert not await ledger.record_progress("r1", op.op_id, "agent", {"v": 1, "summary": "late"})
    assert await ledger.progress_for(op.op_id, "agent") == notes
    recorded = await ledger.get(op.op_id)
    assert recorded is not None and recorded.usage == {"llm_tokens": 5}
    assert recorded.to_json()["usage"] == {"llm_tokens": 5}


async def test_a_failed_loops_last_request_is_kept_from_its_agent_only(
    stores: tuple[PostgresRunStore, Ledger],
) -> None:
    store, ledger = stores
    lease = await leased_run(store)
    op, _ = await ledger.record_intent(lease, "w1", step_id="s1", kind="delegate", target="agent", args=ARGS)
    request = {"messages": [{"role": "user", "content": "hello"}], "tools": ["a__b"]}
    await ledger.record_last_request("r1", op.op_id, "intruder", {"messages": [], "tools": ["forged"]})
    assert await ledger.last_requests("r1") == []
    await ledger.record_last_request("r1", op.op_id, "agent", request)
    await ledger.record_last_request("r1", op.op_id, "agent", {"messages": [{"content": "x" * 90_000}]})
    assert await ledger.last_requests("r1") == [
        {"op_id": op.op_id, "step_id": "s1", "target": "agent", "request": request}
    ]
