"""Checkpoint overhead per step: the coordinator's run path vs a bare LangGraph graph.

All sides run on the same Postgres checkpointer (``AsyncPostgresSaver``), interleaved in one run:

* baseline: the coordinator's graph (``coordinator.graph.build_graph``) run by LangGraph alone
  (``ainvoke``): checkpoints, no platform around it;
* fleet: the same graph driven by the real worker (``RunWorker.advance``: lease, a fenced event-log
  append per progress event, the terminal transition and artifact; then pruning the run's
  checkpoints to the latest one);
* for context, a minimal two-node graph with the same shape (route -> delegate per step) whose
  state is a single counter.

The specialist call is the one thing replaced: both sides use a delegate that returns at once, so the
numbers isolate what the platform adds per step (checkpoints, events, fencing), not network time to a
specialist. Target (durable runs issue): fleet <= 1.3x baseline per step.

Run: ``.venv/bin/python -m bench.checkpoint_overhead`` (starts its own Postgres).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from typing import Any, TypedDict

from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from psycopg_pool import AsyncConnectionPool

from bench._postgres import embedded_postgres
from coordinator.graph import build_graph, checkpoint_pool
from coordinator.operations import Ledger
from coordinator.runs import PostgresRunStore
from coordinator.worker import RunWorker
from policy import RegorusEngine
from registry import AgentRecord

STEPS = 20
ROUNDS = 7
TARGET_RATIO = 1.3


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

    async def assign(self, skill: str) -> AgentRecord:
        return self._agent

    async def agent(self, agent_id: str) -> AgentRecord:
        return self._agent

    async def call(self, agent: AgentRecord, skill: str, payload: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"ok": True}


class _BareState(TypedDict):
    cursor: int
    steps: int


def bare_graph(saver: AsyncPostgresSaver) -> Any:
    async def route(state: _BareState) -> dict[str, Any]:
        return {}

    async def delegate(state: _BareState) -> dict[str, Any]:
        return {"cursor": state["cursor"] + 1}

    def after(state: _BareState) -> str:
        return END if state["cursor"] >= state["steps"] else "route"

    builder: StateGraph[_BareState, Any, Any, Any] = StateGraph(_BareState)
    builder.add_node("route", route)
    builder.add_node("delegate", delegate)
    builder.add_edge(START, "route")
    builder.add_edge("route", "delegate")
    builder.add_conditional_edges("delegate", after, ["route", END])
    return builder.compile(checkpointer=saver)


async def time_bare(graph: Any) -> float:
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    started = time.perf_counter()
    await graph.ainvoke({"cursor": 0, "steps": STEPS}, config)
    return (time.perf_counter() - started) / STEPS


def _plan() -> list[dict[str, Any]]:
    return [{"id": f"s{i}", "skill": "noop", "input": {}} for i in range(STEPS)]


async def time_graph_alone(graph: Any) -> float:
    run_id = uuid.uuid4().hex
    state = {
        "run_id": run_id,
        "tenant": "bench",
        "steps": _plan(),
        "cursor": 0,
        "results": {},
        "assignment": None,
        "failure": None,
    }
    started = time.perf_counter()
    await graph.ainvoke(state, {"configurable": {"thread_id": run_id}})
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
    assert final.state.value == "completed", final
    return elapsed / STEPS, pruning


async def measure(dsn: str) -> dict[str, Any]:
    pool_for_checkpoints = checkpoint_pool(dsn, max_size=4)
    run_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, max_size=4, open=False, kwargs={"autocommit": True}
    )
    async with pool_for_checkpoints, run_pool:
        saver = AsyncPostgresSaver(pool_for_checkpoints)
        await saver.setup()
        store = PostgresRunStore(run_pool)
        await store.setup()
        bare = bare_graph(saver)
        delegator = _InstantDelegator()
        fleet_graph = build_graph(delegator, saver)  # type: ignore[arg-type]
        ledger = Ledger(run_pool)
        await ledger.setup()
        worker = RunWorker(
            fleet_graph,
            store,
            ledger,
            delegator,  # type: ignore[arg-type]
            RegorusEngine.from_dir(),
            "bench-worker",
            lease_ttl_s=60,
        )
        await time_bare(bare)  # warm up every path once
        await time_graph_alone(fleet_graph)
        await time_fleet(worker, store)
        minimal, alone, ours, prunes = [], [], [], []
        for _ in range(ROUNDS):  # interleaved, so drift on a noisy machine hits all alike
            minimal.append(await time_bare(bare))
            alone.append(await time_graph_alone(fleet_graph))
            per_step, pruning = await time_fleet(worker, store)
            ours.append(per_step)
            prunes.append(pruning)
    minimal_ms, base_ms, fleet_ms, prune_ms = (
        statistics.median(x) * 1000 for x in (minimal, alone, ours, prunes)
    )
    return {
        "benchmark": "checkpoint_overhead",
        "steps_per_run": STEPS,
        "rounds": ROUNDS,
        "baseline": "the same graph run by LangGraph alone, same checkpointer",
        "baseline_ms_per_step": round(base_ms, 3),
        "fleet_ms_per_step": round(fleet_ms, 3),
        "ratio": round(fleet_ms / base_ms, 2),
        "target_ratio": TARGET_RATIO,
        "prune_ms_per_run": round(prune_ms, 3),
        "ratio_without_pruning": round((fleet_ms - prune_ms / STEPS) / base_ms, 2),
        "minimal_graph_ms_per_step": round(minimal_ms, 3),
        "ratio_vs_minimal_graph": round(fleet_ms / minimal_ms, 2),
    }


def main() -> dict[str, Any]:
    with embedded_postgres() as dsn:
        result = asyncio.run(measure(dsn))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
