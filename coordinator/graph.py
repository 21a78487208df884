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

from coordinator.delegation import Delegator
from coordinator.plan import resolve_input
from fleet.errors import FleetError
from registry import AgentRecord


class RunState(TypedDict, total=False):
    run_id: str
    tenant: str
    steps: list[dict[str, Any]]
    cursor: int
    assignment: dict[str, Any] | None
    results: dict[str, Any]
    outcomes: Annotated[list[dict[str, Any]], operator.add]
    failure: dict[str, Any] | None


def _emit(text: str) -> None:
    get_stream_writer()({"text": text})


def _failure(step: dict[str, Any], exc: FleetError) -> dict[str, Any]:
    return {"step": step["id"], "skill": step["skill"], "code": str(exc.code), "message": exc.message}


def build_graph(
    delegator: Delegator, checkpointer: BaseCheckpointSaver[Any]
) -> CompiledStateGraph[Any, Any, Any, Any]:
    async def route(state: RunState) -> dict[str, Any]:
        step = state["steps"][state["cursor"]]
        try:
            agent = await delegator.assign(step["skill"])
        except FleetError as exc:
            return {"failure": _failure(step, exc)}
        _emit(f"step {step['id']}: {step['skill']} -> {agent.id}")
        return {"assignment": agent.model_dump(mode="json")}

    async def delegate(state: RunState) -> dict[str, Any]:
        step = state["steps"][state["cursor"]]
        agent = AgentRecord.model_validate(state["assignment"])

        async def progress(text: str) -> None:
            _emit(text)

        try:
            payload = resolve_input(step["input"], state.get("results", {}))
            result = await delegator.call(
                agent, step["skill"], payload, tenant=state["tenant"], progress=progress
            )
        except FleetError as exc:
            return {
                "failure": _failure(step, exc),
                "outcomes": [{"step": step["id"], "agent": agent.id, "status": "failed"}],
            }
        return {
            "results": {**state.get("results", {}), step["id"]: result},
            "cursor": state["cursor"] + 1,
            "assignment": None,
            "outcomes": [{"step": step["id"], "agent": agent.id, "status": "completed"}],
        }

    def after_route(state: RunState) -> str:
        return "finish" if state.get("failure") else "delegate"

    def after_delegate(state: RunState) -> str:
        if state.get("failure") or state["cursor"] >= len(state["steps"]):
            return "finish"
        return "route"

    async def finish(state: RunState) -> dict[str, Any]:
        return {}

    builder: StateGraph[RunState, Any, Any, Any] = StateGraph(RunState)
    builder.add_node("route", route)
    builder.add_node("delegate", delegate)
    builder.add_node("finish", finish)
    builder.add_edge(START, "route")
    builder.add_conditional_edges("route", after_route, ["delegate", "finish"])
    builder.add_conditional_edges("delegate", after_delegate, ["route", "finish"])
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=checkpointer)
