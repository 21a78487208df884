"""Workflows as code: a LangGraph graph of a user's own, registered by name, run as one step of a
run (skill ``workflow:NAME``) inside the coordinator's graph.

Its nodes call the fleet with :func:`delegate`::

    from typing import TypedDict

    from langgraph.graph import END, START, StateGraph

    from coordinator.engine.workflows import delegate


    class Ticket(TypedDict, total=False):
        message: str
        triage: dict


    async def triage(state: Ticket) -> Ticket:
        return {"triage": await delegate("triage-ticket", {"message": state["message"]})}


    def build() -> StateGraph:  # what the manifest names: [[workflows]] graph = "support_desk.flow:build"
        graph = StateGraph(Ticket)
        graph.add_node("triage", triage)
        graph.add_edge(START, "triage")
        graph.add_edge("triage", END)
        return graph

The workflow's graph runs as a subgraph of the run's own: it is checkpointed with the run (a worker
that dies mid-run hands it to another, which goes on from the last checkpoint), and every
:func:`delegate` is a step of the run like a plan's: an operation of the run's ledger, recorded
before it is sent, whose id is derived from where it is called (the node, the workflow's superstep
and the call's place in the node, or the ``id`` given), so that a node run again after a crash finds the operations it
sent and sends none twice. Gates (an approval, a question for a person) park the run as a plan's
steps do, holding no process; signals (cancel) and the run's budget of operations apply.

Replays must be deterministic: a node run again must make the same calls with the same inputs (a
call replayed with other arguments is taken to a person, ``needs_human``). Keep randomness, clocks
and reads of the outside world in skills, not in the workflow's nodes.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired, Protocol, TypedDict

from langgraph.config import get_config, get_stream_writer
from langgraph.errors import GraphBubbleUp
from langgraph.graph import StateGraph
from langgraph.graph.state import CompiledStateGraph

from coordinator.engine import spending
from coordinator.engine.dispatch import RunScope
from coordinator.planning.plan import RESERVED_INPUT, WORKFLOW_SKILL_PREFIX
from coordinator.record.runs import CancelRequested, PlanStep, StaleLease
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.vocabulary import EventType, StepCompleted, StepFailed, StepStarted

log = logging.getLogger(__name__)

Workflow = CompiledStateGraph[Any, Any, Any, Any]


def workflow_name(skill: str) -> str | None:
    """The workflow a step's skill names (``workflow:NAME``), or None for a specialist's skill."""
    return skill.removeprefix(WORKFLOW_SKILL_PREFIX) if skill.startswith(WORKFLOW_SKILL_PREFIX) else None


class _StepCaller(Protocol):
    """What runs one call of a workflow as a step of the run (the coordinator graph's nodes)."""

    async def call_step(self, task: Any, payload: dict[str, Any], scope: RunScope) -> dict[str, Any]: ...


class _Task(TypedDict):
    run_id: str
    tenant: str
    step: PlanStep
    results: dict[str, Any]
    offset: int
    batch: dict[str, int]
    approval: dict[str, Any]
    facts: dict[str, Any]
    spend: NotRequired[dict[str, Any]]  # what its calls may spend together (the step's reservation)


@dataclass
class _Running:
    """One execution of a workflow step: where its calls go, and how many each node task made."""

    caller: _StepCaller
    task: _Task
    scope: RunScope
    max_operations: int | None
    made: dict[str, int] = field(default_factory=dict)  # calls so far, by where they are made


_RUNNING: contextvars.ContextVar[_Running | None] = contextvars.ContextVar("fleet_workflow", default=None)
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


async def delegate(
    skill: str, payload: dict[str, Any], *, id: str | None = None, agent: str | None = None
) -> Any:
    """Run ``skill`` with ``payload`` on an agent of the fleet (``agent``: the one to use) as a step
    of the run, and return its result. A gate on the way (an approval, a person's input) parks the
    run until it is answered; a failure raises the step's :class:`~fleet.errors.FleetError`.

    ``id``: the call's name within the workflow (letters, digits, ``_`` and ``-``), unique per call;
    by default it is derived from the node calling, the workflow's superstep and the call's place in
    the node (the same on every replay of a deterministic workflow)."""
    if RESERVED_INPUT in payload:  # only the fleet sets it, after a person answered a gate
        raise FleetError(
            ErrorCode.INVALID_REQUEST, f"input.{RESERVED_INPUT} is reserved for approvals the fleet records"
        )
    running = _RUNNING.get()
    if running is None:
        raise FleetError(ErrorCode.INTERNAL, "delegate() is called from a node of a workflow the fleet runs")
    parent = running.task["step"]["id"]
    call_id = _call_id(running, id)
    step: PlanStep = {"id": f"{parent}.{call_id}", "skill": skill, "input": payload, "after": []}
    if agent is not None:
        step["agent"] = agent
    await _within_budget(running, step["id"])
    task = {**running.task, "step": step, "results": {}}
    spend = running.task.get("spend")
    if spend is not None and spend.get("reserved"):
        task["spend"] = {**spend, "reserved": await _reserved_left(running, spend, step["id"])}
    update = await running.caller.call_step(task, payload, running.scope)
    failure = update.get("failure")
    if failure:
        raise FleetError.from_dict(
            {"code": failure["code"], "message": failure["message"], "cause": failure.get("cause")}
        )
    return update["results"][step["id"]]


def _call_id(running: _Running, given: str | None) -> str:
    if given is not None:
        if not given or len(given) > 64 or not set(given) <= _ID_CHARS:
            raise FleetError(
                ErrorCode.INVALID_REQUEST, f"a call's id is 1-64 letters, digits, _ and -, not {given!r}"
            )
        return given
    metadata = get_config().get("metadata", {})
    node = str(metadata.get("langgraph_node", "node"))
    # Where the call is made, in terms that a replay reproduces, even one from the workflow's start
    # (its checkpoints lost): the node, the workflow's superstep and the task's path in it (a Send's
    # index). Not the task's id, which is new when the step's own task is scheduled again.
    where = f"{node}|{metadata.get('langgraph_step', 0)}|{metadata.get('langgraph_path', ())}"
    number = running.made.get(where, 0)
    running.made[where] = number + 1
    digest = hashlib.sha256(where.encode()).hexdigest()[:8]
    return f"{node}-{metadata.get('langgraph_step', 0)}-{digest}-{number}"


async def _within_budget(running: _Running, step_id: str) -> None:
    """Refuse a call past the run's budget of operations (each call of the workflow is one): counted
    in the ledger, so a node run again counts what it sent before."""
    if running.max_operations is None:
        return
    sent = await _calls_sent(running)
    if step_id not in sent and len(sent) >= running.max_operations:
        raise FleetError(
            ErrorCode.BUDGET_EXHAUSTED,
            f"the workflow made the {running.max_operations} calls its run's budget allows",
        )


async def _spent(running: _Running, models: Mapping[str, Any], besides: str = "") -> dict[str, Any] | None:
    """What the workflow step's calls said they spent, priced (``besides``: a call left out)."""
    prefix = running.task["step"]["id"] + "."
    said = [
        op.usage
        for op in await running.scope.ledger.for_run(running.scope.lease.run_id)
        if op.step_id.startswith(prefix) and op.step_id.split("~", 1)[0] != besides
    ]
    return spending.of_calls(said, models)


async def _reserved_left(running: _Running, spend: Mapping[str, Any], step_id: str) -> dict[str, float]:
    """What a call of the workflow may spend: what the step reserved (tokens, dollars) less what its
    other calls spent; ``budget_exhausted`` when nothing is left (a workflow's calls together spend no
    more than one step's reservation, as a fan-out's tasks do)."""
    reserved = dict(spend["reserved"])
    spent = await _spent(running, spend.get("models") or {}, besides=step_id) or {}
    for key, used in (("max_llm_tokens", "llm_tokens"), ("max_cost_usd", "cost_usd")):
        cap = float(reserved.get(key) or 0)
        if cap > 0:
            left = cap - float(spent.get(used) or 0)
            if left <= 0:
                raise FleetError(
                    ErrorCode.BUDGET_EXHAUSTED,
                    f"the workflow's calls spent the {cap:g} {used.replace('_', ' ')} the run reserved for it",
                    details={"reason": "tokens" if used == "llm_tokens" else "cost"},
                )
            reserved[key] = left
    return reserved


async def _calls_sent(running: _Running) -> set[str]:
    """The calls this workflow step has sent so far (operations in the run's ledger; a gate's
    answered call, ``<call>~N``, is its call's)."""
    prefix = running.task["step"]["id"] + "."
    return {
        op.step_id.split("~", 1)[0]
        for op in await running.scope.ledger.for_run(running.scope.lease.run_id)
        if op.step_id.startswith(prefix)
    }


async def run_workflow(
    caller: _StepCaller, graph: Workflow | None, task: Any, payload: dict[str, Any], scope: RunScope
) -> dict[str, Any]:
    """Run the workflow step ``task`` (its input ``payload``) through ``graph`` to its end; the
    step's state update: its result (the graph's final state), or its failure."""
    step = task["step"]
    if graph is None:
        return _failed(
            step, FleetError(ErrorCode.INVALID_REQUEST, f"no workflow {step['skill']} is registered")
        )
    budget = (task.get("budget") or {}).get("max_operations")
    running = _Running(caller, task, scope, int(budget) if isinstance(budget, int) else None)
    calls = await _calls_sent(running)
    if not calls:  # the step begins (not resumed after a gate, or by another worker)
        _emit(EventType.STEP_STARTED, StepStarted(step=step["id"], skill=step["skill"]))
    reset = _RUNNING.set(running)
    try:
        final = await graph.ainvoke(payload)
    except (StaleLease, CancelRequested, DependencyUnavailable, GraphBubbleUp):
        raise  # not the workflow's failure: the run parks, stops or goes back to the queue
    except FleetError as exc:
        return _failed(step, exc)
    except Exception as exc:  # a bug in the workflow's code: the step fails, the run with it
        log.exception("workflow %s of run %s raised", step["skill"], task["run_id"])
        return _failed(step, FleetError(ErrorCode.INTERNAL, f"the workflow raised {type(exc).__name__}"))
    finally:
        _RUNNING.reset(reset)
    sent = len(await _calls_sent(running))
    _emit(EventType.STEP_COMPLETED, StepCompleted(step=step["id"], agent=step["skill"], calls=sent))
    outcome: dict[str, Any] = {"step": step["id"], "agent": step["skill"], "status": "completed"}
    usage = await _spent(running, (task.get("spend") or {}).get("models") or {})
    if usage is not None:
        outcome["usage"] = usage  # the run's: its budget counts what the workflow's calls spent
    return {"results": {step["id"]: dict(final)}, "outcomes": [outcome]}


def _emit(event: EventType, payload: Mapping[str, Any]) -> None:
    """Report the workflow step's own events to whoever runs the graph (the worker records them)."""
    get_stream_writer()({"event": event, "payload": payload, "text": ""})


def _failed(step: PlanStep, exc: FleetError) -> dict[str, Any]:
    failure = _failure(step, exc)
    _emit(EventType.STEP_FAILED, failure)
    return {"failure": failure}


def _failure(step: PlanStep, exc: FleetError) -> StepFailed:
    failure: StepFailed = {
        "step": step["id"],
        "skill": step["skill"],
        "code": str(exc.code),
        "message": exc.message,
    }
    if exc.cause is not None:
        failure["cause"] = exc.cause.to_dict()
    return failure


def load_workflows(named: Mapping[str, str]) -> dict[str, Workflow]:
    """The workflows ``named`` (name -> ``module:function`` returning a LangGraph ``StateGraph``),
    compiled to run as subgraphs of a run (they are checkpointed with it). A workflow whose module,
    function or graph is wrong is refused here, with why (``invalid_request``)."""
    compiled: dict[str, Workflow] = {}
    for name, entry in named.items():
        module_name, _, function_name = entry.partition(":")
        try:
            build = getattr(importlib.import_module(module_name), function_name)
            graph = build()
            if not isinstance(graph, StateGraph):
                raise TypeError(f"{entry} returned {type(graph).__name__}, not a StateGraph")
            compiled[name] = graph.compile()
        except Exception as exc:
            raise FleetError(
                ErrorCode.INVALID_REQUEST, f"workflow {name} ({entry}) does not compile: {exc}"
            ) from exc
    return compiled


__all__ = ["WORKFLOW_SKILL_PREFIX", "Workflow", "delegate", "load_workflows", "run_workflow", "workflow_name"]
