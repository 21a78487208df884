"""The coordinator's graph: route -> delegate, once per step, then finish.

Every superstep is checkpointed in Postgres under the run id, so a run's progress is durable.
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.runtime import Runtime
from langgraph.types import interrupt
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from coordinator.delegation import Delegator
from coordinator.dispatch import NeedsHuman, RunScope, StepDispatcher
from coordinator.plan import resolve_input
from fleet.errors import FleetError


class GraphState(TypedDict, total=False):
    run_id: str
    tenant: str
    steps: list[dict[str, Any]]
    cursor: int
    assignment: str | None  # the id of the agent chosen for the current step
    results: dict[str, Any]
    outcomes: Annotated[list[dict[str, Any]], operator.add]
    failure: dict[str, Any] | None


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


def build_graph(
    delegator: Delegator, checkpointer: BaseCheckpointSaver[Any]
) -> CompiledStateGraph[Any, Any, Any, Any]:
    async def route(state: GraphState) -> dict[str, Any]:
        step = state["steps"][state["cursor"]]
        try:
            agent = await delegator.assign(step["skill"])
        except FleetError as exc:
            _emit("step.failed", _failure(step, exc))
            return {"failure": _failure(step, exc)}
        routed = {"step": step["id"], "skill": step["skill"], "agent": agent.id}
        _emit("step.routed", routed, f"step {step['id']}: {step['skill']} -> {agent.id}")
        return {"assignment": agent.id}

    async def delegate(state: GraphState, runtime: Runtime[RunScope]) -> dict[str, Any]:
        step = state["steps"][state["cursor"]]
        agent_id = state["assignment"]
        assert agent_id is not None
        try:
            agent = await delegator.agent(agent_id)
        except FleetError as exc:
            _emit("step.failed", _failure(step, exc))
            return {"failure": _failure(step, exc)}

        async def progress(text: str) -> None:
            _emit("step.progress", {"step": step["id"], "agent": agent.id, "text": text}, text)

        _emit("step.started", {"step": step["id"], "skill": step["skill"], "agent": agent.id})
        try:
            payload = resolve_input(step["input"], state.get("results", {}))
            dispatcher = StepDispatcher(
                delegator,
                runtime.context,
                step_id=step["id"],
                skill=step["skill"],
                payload=payload,
                tenant=state["tenant"],
                progress=progress,
            )
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
            "results": {**state.get("results", {}), step["id"]: result},
            "cursor": state["cursor"] + 1,
            "assignment": None,
            "outcomes": [{"step": step["id"], "agent": agent.id, "status": "completed"}],
        }

    def after_route(state: GraphState) -> str:
        return "finish" if state.get("failure") else "delegate"

    def after_delegate(state: GraphState) -> str:
        if state.get("failure") or state["cursor"] >= len(state["steps"]):
            return "finish"
        return "route"

    async def finish(state: GraphState) -> dict[str, Any]:
        return {}

    builder: StateGraph[GraphState, RunScope, Any, Any] = StateGraph(GraphState, context_schema=RunScope)
    builder.add_node("route", route)
    builder.add_node("delegate", delegate)
    builder.add_node("finish", finish)
    builder.add_edge(START, "route")
    builder.add_conditional_edges("route", after_route, ["delegate", "finish"])
    builder.add_conditional_edges("delegate", after_delegate, ["route", "finish"])
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=checkpointer)
