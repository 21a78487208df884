"""The run checkpoint store on a real Postgres: LangGraph's checkpointer contract (latest and by id,
history, pending writes as LangGraph's savers keep them, pruning), a real graph that pauses at an
interrupt and resumes from a fresh store, and damaged rows refused with a clear error."""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import Checkpoint, empty_checkpoint
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from psycopg_pool import AsyncConnectionPool

from coordinator.record.checkpoints import CompactCheckpointer, decode, encode
from fleet.errors import ErrorCode, FleetError


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
    )
    async with pool:
        yield pool


@pytest.fixture
async def saver(pool: AsyncConnectionPool[Any]) -> CompactCheckpointer:
    saver = CompactCheckpointer(pool)
    await saver.setup()
    await saver.setup()  # idempotent
    return saver


def config(thread: str, checkpoint_id: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ""}
    if checkpoint_id:
        configurable["checkpoint_id"] = checkpoint_id
    return {"configurable": configurable}


def checkpoint(values: dict[str, Any]) -> Checkpoint:
    made = empty_checkpoint()
    made["channel_values"] = values
    made["channel_versions"] = dict.fromkeys(values, 1)
    return made


async def rows(pool: AsyncConnectionPool[Any], thread: str) -> int:
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT count(*) FROM fleet_runs.checkpoints WHERE thread_id = %s", (thread,)
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_the_latest_checkpoint_and_any_by_id_come_back_whole(saver: CompactCheckpointer) -> None:
    first, second = checkpoint({"n": 1, "plan": [{"id": "s1"}]}), checkpoint({"n": 2, "plan": [{"id": "s1"}]})
    saved = await saver.aput(config("t1"), first, {"source": "input", "step": -1}, {})
    await saver.aput(saved, second, {"source": "loop", "step": 0}, {})
    latest = await saver.aget_tuple(config("t1"))
    assert latest is not None
    assert latest.checkpoint["channel_values"] == {"n": 2, "plan": [{"id": "s1"}]}
    assert latest.metadata["step"] == 0
    assert latest.parent_config == config("t1", first["id"])  # history is a chain
    older = await saver.aget_tuple(config("t1", first["id"]))
    assert older is not None and older.checkpoint["id"] == first["id"] and older.parent_config is None
    assert await saver.aget_tuple(config("t2")) is None
    assert await saver.aget_tuple(config("t1", "not-a-checkpoint-id")) is None


async def test_history_lists_newest_first_with_before_limit_and_filter(saver: CompactCheckpointer) -> None:
    saved, ids = config("t1"), []
    for step in range(4):
        made = checkpoint({"n": step})
        saved = await saver.aput(saved, made, {"source": "loop", "step": step}, {})
        ids.append(made["id"])
    listed = [t.checkpoint["id"] async for t in saver.alist(config("t1"))]
    assert listed == ids[::-1]
    assert [t.checkpoint["id"] async for t in saver.alist(config("t1"), limit=2)] == ids[:1:-1]
    before = [t.checkpoint["id"] async for t in saver.alist(config("t1"), before=config("t1", ids[2]))]
    assert before == [ids[1], ids[0]]
    assert [t.metadata["step"] async for t in saver.alist(config("t1"), filter={"step": 1})] == [1]
    with pytest.raises(FleetError) as refused:
        [t async for t in saver.alist(config("t1"), before=config("t1", "garbage"))]
    assert refused.value.code == ErrorCode.INVALID_REQUEST


async def test_writes_are_kept_as_langgraph_keeps_them(saver: CompactCheckpointer) -> None:
    made = checkpoint({"n": 0})
    # A task's writes can arrive before the checkpoint they belong to is saved.
    await saver.aput_writes(config("t1", made["id"]), [("results", {"b": 1})], "task-b", "~path, 2")
    assert await saver.aget_tuple(config("t1")) is None  # writes alone are no checkpoint
    saved = await saver.aput(config("t1"), made, {"source": "loop", "step": 0}, {})
    await saver.aput_writes(saved, [("results", {"a": 1}), ("calls", ["x"])], "task-a", "~path, 1")
    await saver.aput_writes(saved, [("results", {"a": "retry"})], "task-a", "~path, 1")  # the first stays
    await saver.aput_writes(saved, [("__interrupt__", "first ask")], "task-c", "~path, 3")
    await saver.aput_writes(saved, [("__interrupt__", "second ask")], "task-c", "~path, 3")  # replaces
    found = await saver.aget_tuple(config("t1"))
    assert found is not None
    assert found.pending_writes == [
        ("task-a", "results", {"a": 1}),
        ("task-a", "calls", ["x"]),
        ("task-b", "results", {"b": 1}),
        ("task-c", "__interrupt__", "second ask"),
    ]


async def test_pruning_keeps_the_latest_checkpoint_and_its_writes(
    saver: CompactCheckpointer, pool: AsyncConnectionPool[Any]
) -> None:
    saved = config("t1")
    for step in range(3):
        saved = await saver.aput(saved, checkpoint({"n": step}), {"source": "loop", "step": step}, {})
        await saver.aput_writes(saved, [("results", {"step": step})], f"task-{step}", "")
    await saver.aput(config("other"), checkpoint({"n": 9}), {"source": "loop", "step": 0}, {})
    await saver.aprune(["t1"], strategy="keep_latest")
    await saver.aprune(["t1"], strategy="keep_latest")  # idempotent
    assert await rows(pool, "t1") == 1
    kept = await saver.aget_tuple(config("t1"))
    assert kept is not None and kept.checkpoint["id"] == saved["configurable"]["checkpoint_id"]
    assert kept.pending_writes == [("task-2", "results", {"step": 2})]
    assert await rows(pool, "other") == 1  # another thread is untouched
    with pytest.raises(ValueError):
        await saver.aprune(["t1"], strategy="keep_some")
    await saver.aprune(["t1"], strategy="delete")
    assert await rows(pool, "t1") == 0
    await saver.adelete_thread("other")
    assert await rows(pool, "other") == 0


class _Flow(TypedDict, total=False):
    asked: Annotated[list[str], operator.add]
    answer: str


def _gate_graph(saver: CompactCheckpointer) -> Any:
    async def ask(state: _Flow) -> dict[str, Any]:
        answer = interrupt({"type": "approval", "awaited": "approval:refund:0", "amount_cents": 20_000})
        return {"asked": ["refund"], "answer": answer}

    builder: StateGraph[_Flow, Any, Any, Any] = StateGraph(_Flow)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


async def test_a_graph_pauses_at_an_interrupt_and_a_fresh_store_resumes_it(
    pool: AsyncConnectionPool[Any], pg_dsn: str
) -> None:
    first = CompactCheckpointer(pool)
    await first.setup()
    run: RunnableConfig = {"configurable": {"thread_id": "paused-run"}}
    await _gate_graph(first).ainvoke({"asked": []}, run)
    await first.aprune(["paused-run"], strategy="keep_latest")  # as a worker does when a run parks
    assert await rows(pool, "paused-run") == 1  # the whole pause is one row

    # Another process: its own pool and store, nothing in memory from the first.
    other: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}
    )
    async with other:
        graph = _gate_graph(CompactCheckpointer(other))
        state = await graph.aget_state(run)
        [pending] = state.interrupts
        assert pending.value == {"type": "approval", "awaited": "approval:refund:0", "amount_cents": 20_000}
        done = await graph.ainvoke(Command(resume={pending.id: "approve"}), run)
        assert done == {"asked": ["refund"], "answer": "approve"}
        assert not (await graph.aget_state(run)).next  # finished


def test_a_stored_value_round_trips_and_damage_is_a_clear_error() -> None:
    for kind, data in (("msgpack", b"\x81\xa1a\x01"), ("json", b'{"a": 1}'), ("pickle", b"\x80\x04.")):
        assert decode(encode((kind, data))) == (kind, data)
    stored = encode(("msgpack", b"\x81\xa1a\x01" * 50))
    for damaged in (
        b"",
        b"\x07" + stored[1:],
        stored[:1] + b"\x42" + stored[2:],
        stored[:2] + b"\xff\xff\xff",
        stored[:-3],  # truncated
        stored[:-1] + bytes([stored[-1] ^ 1]),  # one bit off: the checksum says so
    ):
        with pytest.raises(FleetError) as refused:
            decode(damaged)
        assert refused.value.code == ErrorCode.INTERNAL
