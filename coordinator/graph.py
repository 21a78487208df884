"""The coordinator's graph: schedule the steps whose inputs are ready, delegate them in parallel
(LangGraph ``Send``), fan in, and repeat until every step is done or one failed.

Every superstep is checkpointed in Postgres under the run id, so a run's progress is durable: after a
crash only the steps of the interrupted superstep that had not finished run again, and those find
their operation in the ledger (see :mod:`coordinator.dispatch`) instead of sending it twice.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send, interrupt
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from coordinator.delegation import Delegator
from coordinator.dispatch import NeedsHuman, RunScope, StepDispatcher
from coordinator.plan import dependencies, resolve_input
from fleet.errors import FleetError


def _merge(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    return {**(left or {}), **(right or {})}


def _first_failure(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any] | None:
    return left or right


class GraphState(TypedDict, total=False):
    run_id: str
    tenant: str
    steps: list[dict[str, Any]]
    results: Annotated[dict[str, Any], _merge]  # by step id; parallel steps each add theirs
    outcomes: Annotated[list[dict[str, Any]], operator.add]
    failure: Annotated[dict[str, Any] | None, _first_failure]


class StepTask(TypedDict):
    """What one parallel ``delegate`` gets: its step and the results it takes as input."""

    run_id: str
    tenant: str
    step: dict[str, Any]
    results: dict[str, Any]


def _emit(event: str, payload: dict[str, Any], text: str = "") -> None:
    """Report progress to whoever runs the graph: it records the event and shows the text."""
    get_stream_writer()({"event": event, "payload": payload, "text": text})


def _failure(step: dict[str, Any], exc: FleetError) -> dict[str, Any]:
    return {"step": step["id"], "skill": step["skill"], "code": str(exc.code), "message": exc.message}


def checkpoint_pool(dsn: str, max_size: int) -> AsyncConnectionPool[Any]:
    """A connection pool configured as ``AsyncPostgresSaver`` requires (not yet opened)."""
    return AsyncConnectionPool(
        dsn,
        max_size=max_size,
        open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )


def ready_steps(state: GraphState) -> list[dict[str, Any]]:
    """Steps not yet done whose every dependency is done."""
    done = set(state.get("results", {}))
    return [s for s in state["steps"] if s["id"] not in done and dependencies(s) <= done]


def build_graph(
    delegator: Delegator, checkpointer: BaseCheckpointSaver[Any]
) -> CompiledStateGraph[Any, Any, Any, Any]:
    async def schedule(state: GraphState) -> dict[str, Any]:
        return {}

    def fan_out(state: GraphState) -> list[Send] | str:
        if state.get("failure"):
            return "finish"
        ready = ready_steps(state)
        if not ready:
            return "finish"
        results = state.get("results", {})
        return [
            Send(
                "delegate",
                StepTask(
                    run_id=state["run_id"],
                    tenant=state["tenant"],
                    step=step,
                    results={d: results[d] for d in dependencies(step) if d in results},
                ),
            )
            for step in ready
        ]

    async def delegate(task: StepTask, runtime: Runtime[RunScope]) -> dict[str, Any]:
        step = task["step"]

        async def progress(text: str) -> None:
            _emit("step.progress", {"step": step["id"], "text": text}, text)

        try:
            payload = resolve_input(step["input"], task["results"])
            dispatcher = StepDispatcher(
                delegator,
                runtime.context,
                step_id=step["id"],
                skill=step["skill"],
                payload=payload,
                tenant=task["tenant"],
                progress=progress,
            )
            agent = await dispatcher.agent()
        except FleetError as exc:
            _emit("step.failed", _failure(step, exc))
            return {"failure": _failure(step, exc)}
        _emit(
            "step.routed",
            {"step": step["id"], "skill": step["skill"], "agent": agent.id},
            f"step {step['id']}: {step['skill']} -> {agent.id}",
        )
        _emit("step.started", {"step": step["id"], "skill": step["skill"], "agent": agent.id})
        try:
            while True:
                try:
                    result = await dispatcher.run(agent)
                    break
                except NeedsHuman as exc:
                    blocked = {"step": step["id"], "agent": agent.id, "op_id": exc.op_id, "why": exc.why}
                    _emit("step.blocked", blocked, f"step {step['id']} needs a person: {exc.message}")
                    # Parks the run (the checkpoint is durable, no process waits). When a person has
                    # given the operation's outcome, the run resumes here and reads it from the ledger.
                    interrupt(
                        {"type": "needs_human", "awaited": exc.op_id, "step": step["id"], "why": exc.why}
                    )
        except FleetError as exc:
            _emit("step.failed", {**_failure(step, exc), "agent": agent.id})
            return {
                "failure": _failure(step, exc),
                "outcomes": [{"step": step["id"], "agent": agent.id, "status": "failed"}],
            }
        _emit("step.completed", {"step": step["id"], "agent": agent.id})
        return {
            "results": {step["id"]: result},
            "outcomes": [{"step": step["id"], "agent": agent.id, "status": "completed"}],
        }

    async def finish(state: GraphState) -> dict[str, Any]:
        return {}

    builder: StateGraph[GraphState, RunScope, Any, Any] = StateGraph(GraphState, context_schema=RunScope)
    builder.add_node("schedule", schedule)
    builder.add_node("delegate", delegate)  # type: ignore[arg-type]  # its input is a StepTask (Send)
    builder.add_node("finish", finish)
    builder.add_edge(START, "schedule")
    builder.add_conditional_edges("schedule", fan_out, ["delegate", "finish"])
    builder.add_edge("delegate", "schedule")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=checkpointer)
