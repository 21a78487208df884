"""Checkpoint overhead per step: the coordinator's run path vs a bare LangGraph graph.

Interleaved in one run:

* baseline: a bare LangGraph graph of the coordinator's shape (``schedule`` fans each ready step out to
  ``delegate`` with ``Send``; the state carries the plan and the results), with nothing around it, on
  LangGraph's own Postgres checkpointer (``AsyncPostgresSaver``): what a LangGraph user starts from;
* the same bare graph on the fleet's checkpointer (``coordinator.record.checkpoints``), to show what the
  checkpointer alone changes;
* fleet: the coordinator's graph driven by the real worker (``RunWorker.advance``) on the fleet's
  checkpointer: lease, the operations ledger (a durable intent before and a durable result after each
  step), a fenced event-log append per event, the budget check, the terminal transition and
  artifact; then pruning the run's checkpoints to the latest one.

The specialist call is the one thing replaced: both sides use a delegate that returns at once, so the
numbers isolate what the platform adds per step (checkpoints, ledger, events, fencing), not network
time to a specialist. Steps run one after another (each ``after`` the previous). Target (durable
runs issue): fleet <= 1.3x baseline per step.

Run: ``.venv/bin/python -m bench.checkpoint_overhead`` (starts its own Postgres).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from coordinator.engine.graph import build_graph, checkpoint_pool
from coordinator.engine.worker import RunWorker
from coordinator.record.checkpoints import CompactCheckpointer
from coordinator.record.operations import Ledger
from coordinator.record.runs import PlanStep, PostgresRunStore
from fleetctl.testing.postgres import embedded_postgres
from policy import RegorusEngine
from registry import AgentRecord

STEPS = 20
ROUNDS = 7
TARGET_RATIO = 1.3
STATS_SETTLE_S = 11.0


class _InstantDelegator:
    """Stands in for the specialist call on both sides (see the module docstring)."""

    def __init__(self) -> None:
        self._agent = AgentRecord(
            id="bench-agent",
            kind="specialist",
            card_url="http://127.0.0.1:1/.well-known/agent-card.json",
            url="http://127.0.0.1:1/a2a/jsonrpc",
            version="1",
            skills=[],
            card={},
            registered_at=0.0,
        )

    async def assign(self, skill: str, **_: Any) -> AgentRecord:
        return self._agent

    async def agent(self, agent_id: str) -> AgentRecord:
        return self._agent

    async def prepare(self, agent: AgentRecord, tenant: str, run_id: str) -> None:
        return None  # no token to get: the call is the stand-in's

    async def call(self, agent: AgentRecord, skill: str, payload: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"ok": True}


class _BareState(TypedDict, total=False):
    steps: list[dict[str, Any]]
    results: Annotated[dict[str, Any], _merge]


def _merge(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    return {**(left or {}), **(right or {})}


def bare_graph(saver: Any) -> Any:
    """The coordinator's shape in plain LangGraph: schedule, fan out ready steps, fan in, repeat."""

    async def schedule(state: _BareState) -> dict[str, Any]:
        return {}

    def fan_out(state: _BareState) -> list[Send] | str:
        done = state.get("results", {})
        ready = [s for s in state["steps"] if s["id"] not in done and set(s["after"]) <= set(done)]
        return [Send("delegate", step) for step in ready] or END

    async def delegate(step: dict[str, Any]) -> dict[str, Any]:
        return {"results": {step["id"]: {"ok": True}}}

    builder: StateGraph[_BareState, Any, Any, Any] = StateGraph(_BareState)
    builder.add_node("schedule", schedule)
    builder.add_node("delegate", delegate)  # type: ignore[arg-type]
    builder.add_edge(START, "schedule")
    builder.add_conditional_edges("schedule", fan_out, ["delegate", END])
    builder.add_edge("delegate", "schedule")
    return builder.compile(checkpointer=saver)


def _plan() -> list[PlanStep]:
    return [
        {"id": f"s{i}", "skill": "noop", "input": {"n": i}, "after": [f"s{i - 1}"] if i else []}
        for i in range(STEPS)
    ]


async def time_bare(graph: Any) -> float:
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    started = time.perf_counter()
    await graph.ainvoke({"steps": _plan(), "results": {}}, config)
    return (time.perf_counter() - started) / STEPS


async def time_fleet(worker: RunWorker, store: PostgresRunStore) -> tuple[float, float]:
    """(seconds per step including retention, seconds of retention for the run)."""
    run_id = uuid.uuid4().hex
    run = await store.create_run(run_id, "bench", "bench", {}, _plan())
    lease = await store.acquire_lease(run_id, "bench-worker", ttl_s=60)
    assert lease is not None
    started = time.perf_counter()
    await worker.advance(run, lease)
    advanced = time.perf_counter()
    await worker.prune(run_id)  # part of the worker's cost per run, though after the client sees the end
    elapsed = time.perf_counter() - started
    pruning = time.perf_counter() - advanced
    await store.release_lease(lease)
    final = await store.get_run(run_id, "bench")
    assert final.state.value == "completed" and final.reason is None, final  # all steps ran
    return elapsed / STEPS, pruning


async def _wal_counters(pool: AsyncConnectionPool[Any]) -> tuple[int, int]:
    """(commits in this database, WAL fsyncs by every process) so far: what a step costs on disk
    (Postgres 18 counts WAL I/O in ``pg_stat_io``)."""
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),"
            " (SELECT COALESCE(sum(fsyncs), 0) FROM pg_stat_io WHERE object = 'wal')"
        )
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def _counted(pool: AsyncConnectionPool[Any], work: Any) -> tuple[Any, float, float]:
    """``work``'s result, and the commits and WAL flushes per step it caused. Backends report
    their statistics when idle, at most every 10 s: read after longer pauses than that."""
    await asyncio.sleep(STATS_SETTLE_S)
    commits, syncs = await _wal_counters(pool)
    result = await work
    await asyncio.sleep(STATS_SETTLE_S)
    commits_after, syncs_after = await _wal_counters(pool)
    # Each reading commits one transaction of its own; it is not the step's.
    return result, (commits_after - commits - 1) / STEPS, (syncs_after - syncs) / STEPS


async def measure(dsn: str) -> dict[str, Any]:
    pool_for_checkpoints = checkpoint_pool(dsn, max_size=4)
    stock_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        max_size=4,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    run_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, max_size=4, open=False, kwargs={"autocommit": True}
    )
    async with pool_for_checkpoints, stock_pool, run_pool:
        stock = AsyncPostgresSaver(stock_pool)
        await stock.setup()
        saver = CompactCheckpointer(pool_for_checkpoints)
        await saver.setup()
        store = PostgresRunStore(run_pool)
        await store.setup()
        ledger = Ledger(run_pool)
        await ledger.setup()
        bare, bare_compact = bare_graph(stock), bare_graph(saver)
        delegator = _InstantDelegator()
        worker = RunWorker(
            build_graph(delegator, saver),  # type: ignore[arg-type]
            store,
            ledger,
            delegator,  # type: ignore[arg-type]
            RegorusEngine.from_dir(),
            "bench-worker",
            lease_ttl_s=60,
        )
        await time_bare(bare)  # warm up every path once
        await time_bare(bare_compact)
        await time_fleet(worker, store)
        _, bare_commits, bare_syncs = await _counted(run_pool, time_bare(bare))
        _, fleet_commits, fleet_syncs = await _counted(run_pool, time_fleet(worker, store))
        bases, compacts, ours, prunes = [], [], [], []
        for _ in range(ROUNDS):  # interleaved, so drift on a noisy machine hits all alike
            bases.append(await time_bare(bare))
            compacts.append(await time_bare(bare_compact))
            per_step, pruning = await time_fleet(worker, store)
            ours.append(per_step)
            prunes.append(pruning)
    base_ms, compact_ms, fleet_ms, prune_ms = (
        statistics.median(x) * 1000 for x in (bases, compacts, ours, prunes)
    )
    return {
        "benchmark": "checkpoint_overhead",
        "steps_per_run": STEPS,
        "rounds": ROUNDS,
        "baseline": "a bare LangGraph graph of the same shape on LangGraph's AsyncPostgresSaver",
        "baseline_ms_per_step": round(base_ms, 3),
        "bare_on_fleet_checkpointer_ms_per_step": round(compact_ms, 3),
        "fleet_ms_per_step": round(fleet_ms, 3),
        "ratio": round(fleet_ms / base_ms, 2),
        "target_ratio": TARGET_RATIO,
        "prune_ms_per_run": round(prune_ms, 3),
        "ratio_without_pruning": round((fleet_ms - prune_ms / STEPS) / base_ms, 2),
        "per_step": {
            "baseline_commits": round(bare_commits, 1),
            "baseline_wal_flushes": round(bare_syncs, 1),
            "fleet_commits": round(fleet_commits, 1),
            "fleet_wal_flushes": round(fleet_syncs, 1),
        },
    }


def main() -> dict[str, Any]:
    with embedded_postgres() as dsn:
        result = asyncio.run(measure(dsn))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
