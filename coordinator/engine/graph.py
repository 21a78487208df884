"""The coordinator's graph: schedule the steps whose inputs are ready, delegate them in parallel
(LangGraph ``Send``), fan in, and repeat until every step is done or one failed.

Every superstep is checkpointed in Postgres under the run id, so a run's progress is durable: after a
crash only the steps of the interrupted superstep that had not finished run again, and those find
their operation in the ledger (see :mod:`coordinator.engine.dispatch`) instead of sending it twice.
"""

from __future__ import annotations

import datetime as dt
import operator
from collections import Counter
from collections.abc import Mapping
from typing import Annotated, Any, NotRequired, TypedDict

from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send, interrupt
from psycopg_pool import AsyncConnectionPool

from coordinator.engine import spending
from coordinator.engine.delegation import Delegator
from coordinator.engine.dispatch import NeedsHuman, RunScope, StepDispatcher
from coordinator.engine.workflows import Workflow, run_workflow, workflow_name
from coordinator.planning.plan import RESERVED_INPUT, UNTRUSTED, dependencies, resolve_input
from coordinator.record.runs import CancelRequested, PlanStep, StaleLease
from fleet import pgpool
from fleet.approvals import POLICY_APPROVER, ApprovalRequest
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.operation_ext import args_hash
from fleet.vocabulary import (
    EventType,
    RunDegraded,
    StepBlocked,
    StepCompleted,
    StepFailed,
    StepProgress,
    StepStarted,
)
from registry import AgentRecord


def _merge(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any]:
    return {**(left or {}), **(right or {})}


def _first_failure(left: dict[str, Any] | None, right: dict[str, Any] | None) -> dict[str, Any] | None:
    return left or right


class GraphState(TypedDict, total=False):
    run_id: str
    tenant: str
    steps: list[PlanStep]
    results: Annotated[dict[str, Any], _merge]  # by step id; parallel steps each add theirs
    outcomes: Annotated[list[dict[str, Any]], operator.add]
    failure: Annotated[dict[str, Any] | None, _first_failure]
    # The mission budget and convergence limits, from policy when the run started (see budgets.rego),
    # and the accounting against them.
    limits: dict[str, Any]
    # {"number", "steps", "operations", "llm_tokens", "cost_usd", "started_at"} at the tranche's start
    tranche: dict[str, Any]
    # The plain steps the last turn sent, each with the tokens and dollars it reserved (see
    # coordinator.engine.spending); None: every ready step (a checkpoint from before reservations).
    admitted: dict[str, dict[str, float]] | None
    calls: Annotated[list[str], operator.add]  # hashes of the calls sent, in order
    stop: dict[str, Any] | None  # why the run stopped early: {"reason", "why"}
    batches: Annotated[dict[str, int], _merge]  # items done, by batch step, as of the last checkpoint
    finished: bool  # set by the last node only: a checkpoint without it and without tasks lost them


class StepTask(TypedDict):
    """What one parallel ``delegate`` gets: its step and the results it takes as input."""

    run_id: str
    tenant: str
    step: PlanStep
    results: dict[str, Any]
    offset: int  # for a batch step: the items done already
    batch: dict[str, int]  # for a batch step: call_size and checkpoint_every ({} for others)
    approval: dict[str, Any]  # the deadline policy of a gate on the step's skill, fixed at the run's start
    facts: dict[str, Any]  # what the run computed that a gate may go by (see computed_facts)
    budget: NotRequired[dict[str, Any]]  # a workflow step's: the run's limits its calls count against
    # a delegated step's: its agent loop's policy and the models' prices (from the run's limits), and
    # what it reserved from the tranche
    spend: NotRequired[dict[str, Any]]
    # a workflow step's: the deadline policy of gates on every skill, for its calls' own
    approvals: NotRequired[dict[str, Any]]


def _emit(event: EventType, payload: Mapping[str, Any], text: str = "") -> None:
    """Report progress to whoever runs the graph: it records the event and shows the text."""
    get_stream_writer()({"event": event, "payload": payload, "text": text})


def _failure(step: PlanStep, exc: FleetError) -> StepFailed:
    """A failed step, as its event and the run's state keep it: the step, its skill, the error's code
    and message, and the error it wraps from the layer below (an envelope), if any."""
    failure = StepFailed(step=step["id"], skill=step["skill"], code=str(exc.code), message=exc.message)
    if exc.cause is not None:
        failure["cause"] = exc.cause.to_dict()
    return failure


def checkpoint_pool(dsn: str, max_size: int) -> AsyncConnectionPool[Any]:
    """A connection pool of its own for the checkpointer (not yet opened): checkpoint saves run in
    the background and must not wait behind the run's other writes."""
    return pgpool.pool(dsn, max_size=max_size, kwargs={"autocommit": True})


def ready_steps(state: GraphState) -> list[PlanStep]:
    """Steps not yet done whose every dependency is done."""
    done = set(state.get("results", {}))
    return [s for s in state["steps"] if s["id"] not in done and dependencies(s) <= done]


def _call_hash(step: PlanStep, results: dict[str, Any], offset: int) -> str:
    try:
        payload = resolve_input(step["input"], results)
    except FleetError:
        payload = step["input"]  # the step will fail on it; the hash only has to be stable
    return args_hash({"skill": step["skill"], "input": payload, "offset": offset})


def _as_admitted(state: GraphState, step: PlanStep) -> dict[str, Any]:
    """A ready step as the fan-out's admission reads it: a batch step with the calls of its next
    round, a workflow as a whole (its calls share what is left), any other as it is."""
    if step.get("for_each") is not None:
        return {**step, "_calls": _round_calls(state, step)}
    if workflow_name(step["skill"]) is not None:
        return {**step, "_whole": True}
    return dict(step)


def _round_calls(state: GraphState, step: PlanStep) -> int:
    """The calls a batch step's next round makes: one per ``call_size`` of the items left, up to
    ``checkpoint_every`` items (1 if its items cannot be read yet: the round will fail on them)."""
    batch = {**((state.get("limits") or {}).get("batch") or DEFAULT_BATCH), **(step.get("batch") or {})}
    try:
        items = resolve_input(step["for_each"], state.get("results", {}))
    except FleetError:
        return 1
    if not isinstance(items, list):
        return 1
    size = max(1, int(batch["call_size"]))
    left = min(len(items) - state.get("batches", {}).get(step["id"], 0), int(batch["checkpoint_every"]))
    return max(1, -(-left // size))


def _operations(state: GraphState) -> int:
    """Operations sent so far (a batch round reports how many calls it made)."""
    return sum(int(o.get("calls", 1)) for o in state.get("outcomes", []))


def check_budget(state: GraphState, now: dt.datetime) -> dict[str, Any]:
    """The update that the next turn needs: nothing, a new tranche, the hashes of the calls it
    sends, or a stop (budget exhausted, or not converging). Checked before every fan-out."""
    limits = state.get("limits") or {}
    ready = ready_steps(state)
    if not limits or not ready or state.get("failure") or state.get("stop"):
        return {}
    budget, convergence = limits["limits"], limits["convergence"]
    tranche = state["tranche"]
    models = spending.totals(state.get("outcomes", []))
    used = {
        "max_steps": len(state.get("results", {})) - tranche["steps"],
        "max_operations": _operations(state) - tranche["operations"],
        "max_seconds": (now - dt.datetime.fromisoformat(tranche["started_at"])).total_seconds(),
        "max_llm_tokens": models["llm_tokens"] - tranche.get("llm_tokens", 0),
        "max_cost_usd": models["cost_usd"] - tranche.get("cost_usd", 0.0),
    }
    spent = [
        f"{key} {budget[key]} reached"
        for key, value in used.items()
        if key in budget and value >= budget[key]
    ]
    if spent:
        update = _spent(state, budget, spent, now)
        if "tranche" not in update:
            return update
        # A new tranche: what this turn sends is admitted against it.
        return {**update, **check_budget({**state, **update}, now)}  # type: ignore[typeddict-item]
    if sum(step.get("wait") is None for step in ready) > convergence["max_calls_per_turn"]:
        why = f"{len(ready)} calls in one turn (more than {convergence['max_calls_per_turn']})"
        _emit(EventType.RUN_DEGRADED, RunDegraded(reason="non_converging", why=why), f"not converging: {why}")
        return {"stop": {"reason": "non_converging", "why": why}}
    results = state.get("results", {})
    batches = state.get("batches", {})
    # Before a fan-out, each plain step reserves what its task may spend; those that do not fit in
    # what is left of the tranche wait for the next turn (a fan-out cannot pass the budget).
    left = {
        "operations": budget["max_operations"] - used["max_operations"],
        "llm_tokens": budget["max_llm_tokens"] - used["max_llm_tokens"]
        if "max_llm_tokens" in budget
        else None,
        "cost_usd": budget["max_cost_usd"] - used["max_cost_usd"] if "max_cost_usd" in budget else None,
    }
    # A batch step's round makes a call per call_size items, up to checkpoint_every: each reserves.
    sent = [_as_admitted(state, step) for step in ready if step.get("wait") is None]
    admitted = spending.admit(sent, limits, left)
    calls = [
        step for step in ready if step["id"] in admitted
    ]  # a timer calls nobody; nor a step that waits its turn
    new = [_call_hash(step, results, batches.get(step["id"], 0)) for step in calls]
    counts = Counter([*state.get("calls", []), *new])
    repeated = [digest for digest, n in counts.items() if n >= convergence["repeat_limit"]]
    if repeated:
        why = f"the same call {convergence['repeat_limit']} times"
        _emit(EventType.RUN_DEGRADED, RunDegraded(reason="non_converging", why=why), f"not converging: {why}")
        return {"stop": {"reason": "non_converging", "why": why}}
    return {"calls": new, "admitted": admitted}


def _spent(state: GraphState, budget: dict[str, Any], spent: list[str], now: dt.datetime) -> dict[str, Any]:
    """The decision point of a spent budget: a new tranche, a person's decision, or a close with
    the best result so far (as the budget policy says)."""
    tranche, why = state["tranche"], ", ".join(spent)
    action = budget["on_exhausted"]
    if action == "tranche":
        if tranche["number"] < budget["max_tranches"]:
            _emit(
                EventType.BUDGET_TRANCHE,
                {"tranche": tranche["number"] + 1, "spent": spent},
                f"new budget tranche ({why})",
            )
            return {"tranche": _fresh_tranche(state, now)}
        action = budget.get("after_tranches", "summarize")
    if action == "ask":
        return _ask(state, budget, spent, now)
    _emit(EventType.BUDGET_EXHAUSTED, {"spent": spent}, f"budget exhausted: {why}")
    return {"stop": {"reason": "budget_exhausted", "why": why}}


def _fresh_tranche(state: GraphState, now: dt.datetime) -> dict[str, Any]:
    return {
        "number": state["tranche"]["number"] + 1,
        "steps": len(state.get("results", {})),
        "operations": _operations(state),
        **spending.totals(state.get("outcomes", [])),
        "started_at": now.isoformat(),
    }


BUDGET_DECISIONS = ("tranche", "close")


def _ask(state: GraphState, budget: dict[str, Any], spent: list[str], now: dt.datetime) -> dict[str, Any]:
    """Ask a person, and park the run until they answer (no process waits) or the deadline passes.
    The answer (recorded by the API, or ``expired`` by the supervisor) comes back as the resume
    value, keyed by what is awaited: one key per ask, so an old answer never answers a new ask."""
    ask, why = budget["ask"], ", ".join(spent)
    number = state["tranche"]["number"]
    deadline = now + dt.timedelta(seconds=float(ask["timeout_s"]))
    request = {
        "type": "budget",
        "awaited": f"budget:{number}",
        "why": f"budget exhausted: {why}; grant another tranche or close?",
        "spent": spent,
        "choices": list(BUDGET_DECISIONS),
        "deadline": deadline.isoformat(),
        "warn_at": (deadline - dt.timedelta(seconds=float(ask["warn_before_s"]))).isoformat(),
    }
    while True:  # resumed without an answer to this ask (another wait was answered): ask again
        answer = interrupt(request)
        decision = answer.get("decision") if isinstance(answer, dict) else None
        if decision in (*BUDGET_DECISIONS, "expired"):
            break
    by = str(answer.get("by", "supervisor"))
    if decision == "tranche":
        overrides = {k: v for k, v in (answer.get("limits") or {}).items() if k in TRANCHE_LIMITS}
        limits = {**state["limits"], "limits": {**budget, **overrides}}
        _emit(
            EventType.BUDGET_TRANCHE,
            {"tranche": number + 1, "spent": spent, "by": by, "limits": overrides},
            f"new budget tranche, granted by {by}",
        )
        return {"tranche": _fresh_tranche(state, now), "limits": limits}
    if decision == "expired" and ask["on_expired"] == "expire":
        deadline_was = answer.get("deadline", request["deadline"])  # as recorded when it was asked
        text = f"nobody decided on the spent budget ({why}) by {deadline_was}"
        _emit(EventType.BUDGET_EXPIRED, {"spent": spent, "deadline": deadline_was}, text)
        return {"stop": {"reason": "approval_expired", "why": text}}
    closed = "nobody answered in time" if decision == "expired" else f"closed by {by}"
    _emit(EventType.BUDGET_EXHAUSTED, {"spent": spent, "by": by}, f"budget exhausted: {why} ({closed})")
    return {"stop": {"reason": "budget_exhausted", "why": f"{why} ({closed})"}}


TRANCHE_LIMITS = ("max_steps", "max_operations", "max_seconds", "max_llm_tokens", "max_cost_usd")
DEFAULT_BATCH = {"call_size": 50, "checkpoint_every": 50}


async def _run_or_wait(
    dispatcher: StepDispatcher, step_id: str, prefer: AgentRecord | None = None
) -> dict[str, Any]:
    """The operation's result; if a person must say what happened, park the run until they have."""
    while True:
        try:
            return await dispatcher.run(prefer)
        except NeedsHuman as exc:
            blocked = StepBlocked(step=step_id, agent=dispatcher.agent_id, op_id=exc.op_id, why=exc.why)
            _emit(EventType.STEP_BLOCKED, blocked, f"step {step_id} needs a person: {exc.message}")
            # Parks the run (the checkpoint is durable, no process waits). When a person has given
            # the operation's outcome, the run resumes here and reads it from the ledger.
            interrupt({"type": "needs_human", "awaited": exc.op_id, "step": step_id, "why": exc.why})


def merge_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the results of a batch's calls: lists are concatenated in item order, other
    values are those of the last call."""
    merged: dict[str, Any] = {}
    for chunk in chunks:
        for key, value in chunk.items():
            if isinstance(value, list) and isinstance(merged.get(key, []), list):
                merged[key] = [*merged.get(key, []), *value]
            else:
                merged[key] = value
    return merged


async def run_batch(delegator: Delegator, task: StepTask, scope: RunScope) -> dict[str, Any]:
    """Advance a batch step by up to ``checkpoint_every`` items, in calls of ``call_size``, each
    call a ledgered operation of its own (op ids ``<step>@<offset>``). Returning ends the superstep,
    so the progress is checkpointed; a crash redoes at most the items since, and their calls find
    their operations in the ledger. The last round assembles the step's result from the ledger."""
    step = task["step"]
    call_size, every = task["batch"]["call_size"], task["batch"]["checkpoint_every"]
    try:
        items = resolve_input(step["for_each"], task["results"])
        if not isinstance(items, list):
            raise FleetError(ErrorCode.INVALID_REQUEST, f"step {step['id']}: for_each is not a list")
        shared = resolve_input(step["input"], task["results"])
    except FleetError as exc:
        _emit(EventType.STEP_FAILED, _failure(step, exc))
        return {"failure": _failure(step, exc)}
    offset, total = task["offset"], len(items)
    spend = task.get("spend")
    reserved = (spend or {}).get("reserved") or {}
    # The round's calls as the tranche admitted them (each with its reservation as its cap).
    most = int(reserved.get("calls") or 0) * call_size or every
    stop_at = min(total, offset + every, offset + most)
    limits = (lambda agent: spending.task_limits(spend, agent.id, reserved)) if spend is not None else None
    if offset == 0:
        _emit(EventType.STEP_STARTED, StepStarted(step=step["id"], skill=step["skill"], items=total))
    agent: AgentRecord | None = None  # every call of the batch goes to the agent of its first
    calls = 0
    dispatchers: list[StepDispatcher] = []
    try:
        while offset < stop_at:
            chunk = items[offset : min(offset + call_size, stop_at)]

            async def progress(text: str) -> None:
                _emit(EventType.STEP_PROGRESS, StepProgress(step=step["id"], text=text), text)

            dispatcher = StepDispatcher(
                delegator,
                scope,
                step_id=f"{step['id']}@{offset}",
                skill=step["skill"],
                payload={**shared, step["items_as"]: chunk},
                tenant=task["tenant"],
                progress=progress,
                named=step.get("agent"),
                limits=limits,
                models=(spend or {}).get("models"),
            )
            dispatchers.append(dispatcher)
            if agent is None:
                agent = await delegator.assign(step["skill"], tenant=task["tenant"], named=step.get("agent"))
            await _run_or_wait(dispatcher, step["id"], agent)
            agent = dispatcher.agent or agent  # the call may have moved to another agent
            offset += len(chunk)
            calls += 1
            _emit(
                EventType.BATCH_PROGRESS,
                {"step": step["id"], "done": offset, "total": total},
                f"{step['id']}: {offset}/{total}",
            )
    except (StaleLease, CancelRequested, DependencyUnavailable):
        raise  # not the step's failure: this worker must stop writing
    except FleetError as exc:
        _emit(EventType.STEP_FAILED, StepFailed(**_failure(step, exc), done=offset))
        return {"failure": {**_failure(step, exc), "done": offset}}
    outcome = {**_outcome(step, agent.id if agent else "", "completed", dispatchers, spend), "calls": calls}
    if offset < total:
        return {"batches": {step["id"]: offset}, "outcomes": [outcome]}
    prefix = f"{step['id']}@"
    chunks = sorted(
        (op for op in await scope.ledger.for_run(scope.lease.run_id) if op.step_id.startswith(prefix)),
        key=lambda op: int(op.step_id.removeprefix(prefix)),
    )
    result = {**merge_chunks([op.result or {} for op in chunks]), "items": total, "calls": len(chunks)}
    _emit(EventType.STEP_COMPLETED, StepCompleted(step=step["id"], items=total, calls=len(chunks)))
    return {"batches": {step["id"]: offset}, "results": {step["id"]: result}, "outcomes": [outcome]}


def wait_for_timer(step: PlanStep, now: dt.datetime) -> dict[str, Any]:
    """A timer step: park the run (no process waits) until the time is due; the wait supervisor
    answers the wait when it is, and the run goes on from here. A time already past fires at once."""
    wait = step["wait"]
    if "until" in wait:
        due = dt.datetime.fromisoformat(wait["until"])
    else:  # relative to when the step first ran (a crash before the run parked restarts the count)
        due = now + dt.timedelta(seconds=float(wait["for_s"]))
    if due > now:
        awaited = f"timer:{step['id']}"
        while True:  # resumed without this timer firing (another wait was answered): wait again
            answer = interrupt(
                {
                    "type": "timer",
                    "awaited": awaited,
                    "deadline": due.isoformat(),
                    "why": f"until {due.isoformat()}",
                }
            )
            if isinstance(answer, dict) and answer.get("decision") == "expired":
                break
        due = dt.datetime.fromisoformat(str(answer.get("deadline", due.isoformat())))
    fired = dt.datetime.now(dt.UTC)
    _emit(
        EventType.TIMER_FIRED, {"step": step["id"], "due": due.isoformat()}, f"step {step['id']}: timer fired"
    )
    result = {"due": due.isoformat(), "fired_at": fired.isoformat()}
    return {
        "results": {step["id"]: result},
        "outcomes": [{"step": step["id"], "agent": "timer", "status": "completed", "calls": 0}],
    }


async def collect_batch(step: PlanStep, scope: RunScope, now: dt.datetime) -> dict[str, Any]:
    """A batch trigger's collection: park the run (no process waits) while events add their items,
    until the window's close time (the wait supervisor answers) or a closing event (the trigger
    ingest answers); then close the batch, atomically with any item still arriving (which is
    refused and dead-lettered), and give its items, in the order they came, as the step's result."""
    wait = step["wait"]
    due = dt.datetime.fromisoformat(wait["until"])
    closed_by = "time"
    if due > now:
        request = {
            "type": "batch",
            "awaited": f"batch:{step['id']}",
            "deadline": due.isoformat(),
            "why": f"collecting the items of {wait['batch']} until {due.isoformat()}",
        }
        while True:  # resumed for another wait: wait again
            answer = interrupt(request)
            decision = answer.get("decision") if isinstance(answer, dict) else None
            if decision in ("expired", "closed"):
                closed_by = "time" if decision == "expired" else f"event {answer.get('event', '')}"
                break
    if scope.runs is None:
        raise FleetError(ErrorCode.INTERNAL, "a batch collection needs the run store")
    items = await scope.runs.close_batch(scope.lease.run_id)
    _emit(
        EventType.BATCH_CLOSED,
        {"step": step["id"], "items": len(items), "closed_by": closed_by},
        f"batch {wait['batch']}: {len(items)} items (closed by {closed_by})",
    )
    return {
        "results": {step["id"]: {"items": items, "count": len(items), "closed_by": closed_by}},
        "outcomes": [{"step": step["id"], "agent": "batch", "status": "completed", "calls": 0}],
    }


def wait_for_event(step: PlanStep, now: dt.datetime) -> dict[str, Any]:
    """An event wait: park the run until an event of the run's tenant on the logical subject (and of
    the type and from the source, if given) arrives (the trigger ingest answers the wait with it), or
    until ``timeout_s``."""
    wait = step["wait"]
    request: dict[str, Any] = {
        "type": "event",
        "awaited": f"event:{step['id']}",
        "subject": wait["event"],
        "event_type": wait.get("type"),
        "event_source": wait.get("source"),
        "why": f"an event on {wait['event']}",
    }
    if wait.get("timeout_s") is not None:
        request["deadline"] = (now + dt.timedelta(seconds=float(wait["timeout_s"]))).isoformat()
    while True:  # resumed without this wait answered (another wait was): wait again
        answer = interrupt(request)
        if isinstance(answer, dict) and answer.get("decision") in ("event", "expired"):
            break
    if answer["decision"] == "expired":
        _emit(
            EventType.EVENT_TIMED_OUT,
            {"step": step["id"]},
            f"step {step['id']}: no event on {wait['event']} in time",
        )
        result: dict[str, Any] = {"event": None, "expired": True}
    else:
        _emit(
            EventType.EVENT_RECEIVED,
            {"step": step["id"]},
            f"step {step['id']}: event {answer['event']['id']} arrived",
        )
        result = {"event": answer["event"], "expired": False}
    return {
        "results": {step["id"]: result},
        "outcomes": [{"step": step["id"], "agent": "event", "status": "completed", "calls": 0}],
    }


# The gate: a step's result that asks a person before the step can go on.
DEFAULT_APPROVAL_DEADLINE: dict[str, Any] = {
    "timeout_s": 86400.0,
    "warn_before_s": 3600.0,
    "on_expired": "expire",
    "escalate_for_s": 3600.0,
}


def gate_of(result: Any) -> dict[str, Any] | None:
    """What a step's result asks of a person before the step can go on, or None: a tool or skill
    result ``{"status": "pending_approval"}`` asks for an approval; ``{"user_input_required":
    true}``, or a specialist task that ended ``input-required`` or ``auth-required`` (the
    delegation reports it as ``{"status": "input_required"|"auth_required"}``), asks for input."""
    if not isinstance(result, dict):
        return None
    status = result.get("status")
    if status == "pending_approval":
        kind = "approval"
    elif result.get("user_input_required") is True or status in ("input_required", "auth_required"):
        kind = "input"
    else:
        return None
    said = next((k for k in ("why", "question", "message", "reason") if isinstance(result.get(k), str)), None)
    why = (
        str(result[said])
        if said
        else "the step needs approval"
        if kind == "approval"
        else "the step needs input"
    )
    # ``asked``: the rest of what the result says. The ledger keeps the result whole, and the run's
    # wait record does not keep this copy: it is derived again from there, by the same rule
    # (``fleet_runs.wait_of``), where the run is read.
    asked = {k: v for k, v in result.items() if k not in (said, "status", "user_input_required")}
    return {"type": kind, "why": why, "asked": asked}


def _completes(result: dict[str, Any]) -> bool:
    """Whether a call's result completes its step: not if it asks a person first (a gate)."""
    return gate_of(result) is None


def approval_deadline(approvals: dict[str, Any], skill: str) -> dict[str, Any]:
    """The deadline policy of a gate on ``skill`` (see approvals.rego), as fixed at the run's start."""
    found = (approvals.get("skills") or {}).get(skill) or approvals.get("default") or {}
    return {**DEFAULT_APPROVAL_DEADLINE, **found}


def await_gate(
    step: PlanStep,
    gate: dict[str, Any],
    number: int,
    dispatcher: StepDispatcher,
    policy: dict[str, Any],
) -> dict[str, Any]:
    """Park the run until a person answers the gate (no process waits) and return the answer:
    ``approve``, ``input`` (with ``input``), ``reject``, or ``expired``. The wait is keyed
    ``approval:<step>:<n>``: the answer is delivered to this gate and no other. Its deadline
    counts from when the asking result was recorded (the same on every replay). At the deadline,
    policy decides (``policy``, from :func:`approval_deadline`): expire, or escalate once (a new key,
    for escalate_for_s more) and then expire."""
    asked_at = dispatcher.settled_at or dt.datetime.now(dt.UTC)
    awaited = f"approval:{step['id']}:{number}"
    deadline = asked_at + dt.timedelta(seconds=float(policy["timeout_s"]))
    escalated = False
    while True:
        request = {
            "type": gate["type"],
            "awaited": awaited,
            "step": step["id"],
            "skill": step["skill"],
            "agent": dispatcher.agent_id,
            "op_id": dispatcher.op_id,
            "why": gate["why"],
            "asked": gate["asked"],
            "deadline": deadline.isoformat(),
            "warn_at": (deadline - dt.timedelta(seconds=float(policy["warn_before_s"]))).isoformat(),
            "on_expired": "escalate" if policy["on_expired"] == "escalate" and not escalated else "expire",
            **({"escalated": True} if escalated else {}),
        }
        answer = interrupt(request)
        decision = answer.get("decision") if isinstance(answer, dict) else None
        if decision in ("approve", "input", "reject"):
            return {**answer, "awaited": awaited}
        if decision == "expired":
            if request["on_expired"] != "escalate":
                return {**answer, "deadline": request["deadline"]}
            escalated = True
            awaited = f"{awaited}:escalated"
            # From the deadline as it stood when it passed (extensions included): the answer
            # records it, so every replay computes the same one.
            passed = dt.datetime.fromisoformat(str(answer.get("deadline") or request["deadline"]))
            deadline = passed + dt.timedelta(seconds=float(policy["escalate_for_s"]))
        # Otherwise the run was resumed for another wait (a parallel step's): ask again.


# The skills whose recorded results state an anomaly score for a report artifact the fleet made
# (``report_artifact``, ``max_score``): the computed facts a publication's gate goes by.
SCORING_SKILLS = ("score-anomalies",)


def computed_facts(state: GraphState) -> dict[str, Any]:
    """What the run itself computed that a gate may go by, read from the run's own state (the
    checkpoint), never from a step's input: ``report_scores``, the highest anomaly score that a
    scoring step of the run recorded for each report artifact it made."""
    results = state.get("results", {})
    scores: dict[str, float] = {}
    for step in state.get("steps", []):
        result = results.get(step["id"])
        if step["skill"] not in SCORING_SKILLS or not isinstance(result, dict) or UNTRUSTED in result:
            continue
        artifact, score = result.get("report_artifact"), result.get("max_score")
        if isinstance(artifact, str) and isinstance(score, int | float) and not isinstance(score, bool):
            scores[artifact] = max(float(score), scores.get(artifact, float(score)))
    return {"report_scores": scores} if scores else {}


def facts_for(request: ApprovalRequest, facts: dict[str, Any]) -> dict[str, Any]:
    """The computed facts that bear on one gated call: the score of the artifact it names."""
    artifact = request.arguments.get("artifact")
    scores = facts.get("report_scores") or {}
    return {"anomaly_score": scores[artifact]} if isinstance(artifact, str) and artifact in scores else {}


async def policy_approval(
    delegator: Delegator, task: StepTask, gate: dict[str, Any], op_id: str, number: int
) -> dict[str, Any] | None:
    """The answer policy gives a gate on its own (``fleet.approvals.auto``, on the facts the run
    computed), with its approval grant; None if a person must answer."""
    asked = gate["asked"].get("approval_request") if gate["type"] == "approval" and number == 0 else None
    request = ApprovalRequest.of(asked)
    if request is None:
        return None
    facts = facts_for(request, task.get("facts") or {})
    approved = await delegator.policy_approval(task["tenant"], task["run_id"], op_id, request, facts)
    if approved is None:
        return None
    grant, decision = approved
    why = "; ".join(decision.reasons)
    awaited = f"approval:{task['step']['id']}:{number}"
    _emit(
        EventType.APPROVAL_GRANTED,
        {"awaited": awaited, "by": POLICY_APPROVER, "decision_id": decision.decision_id, "facts": facts},
        f"policy approved {awaited}: {why} (decision {decision.decision_id})",
    )
    return {"decision": "approve", "by": POLICY_APPROVER, "note": why, "grant": grant, "awaited": awaited}


def answered(payload: dict[str, Any], answer: dict[str, Any], asked_op: str = "") -> dict[str, Any]:
    """The input of a gated step's next call: what it had, the approval (with its grant, for the
    tool, and the operation that first asked, which keyed the tool call), and the person's input."""
    approval = {"id": answer.get("awaited"), "by": answer.get("by"), "note": answer.get("note", "")}
    if isinstance(answer.get("grant"), str):
        approval["grant"] = answer["grant"]
    if asked_op:
        approval["op_id"] = asked_op
    update: dict[str, Any] = {"approval": approval}
    if answer.get("input") is not None:
        update["input"] = answer["input"]
    return {**payload, **update}


def _gate_closed(step: PlanStep, answer: dict[str, Any], agent_id: str) -> dict[str, Any]:
    """The step's end at a gate: rejected by a person, or nobody answered in time (never reported
    as a rejection)."""
    if answer["decision"] == "reject":
        note = f": {answer['note']}" if answer.get("note") else ""
        rejected = f"rejected by {answer.get('by')}{note}"
        failure = StepFailed(
            step=step["id"], skill=step["skill"], code=str(ErrorCode.APPROVAL_REJECTED), message=rejected
        )
    else:
        expired = f"nobody answered by {answer.get('deadline')}"
        failure = StepFailed(
            step=step["id"], skill=step["skill"], code=str(ErrorCode.APPROVAL_EXPIRED), message=expired
        )
    _emit(
        EventType.STEP_FAILED,
        StepFailed(**failure, agent=agent_id),
        f"step {step['id']}: {failure['message']}",
    )
    return {"failure": failure, "outcomes": [{"step": step["id"], "agent": agent_id, "status": "failed"}]}


def step_task(state: GraphState, step: PlanStep) -> StepTask:
    """What the step's task needs, and no more: the task is written into the checkpoint (a ``Send``)
    and stays there while the step waits at a gate."""
    results = state.get("results", {})
    limits = state.get("limits") or {}
    batch = {**(limits.get("batch") or DEFAULT_BATCH), **(step.get("batch") or {})}
    task = StepTask(
        run_id=state["run_id"],
        tenant=state["tenant"],
        step=step,
        results={d: results[d] for d in dependencies(step) if d in results},
        offset=state.get("batches", {}).get(step["id"], 0),
        batch=batch if step.get("for_each") is not None else {},
        approval=approval_deadline(limits.get("approvals") or {}, step["skill"]),
        facts=computed_facts(state),
    )
    if workflow_name(step["skill"]) is not None:
        task["approvals"] = limits.get("approvals") or {}
        if limits.get("limits"):
            task["budget"] = {"max_operations": limits["limits"].get("max_operations")}
    if "loop" in limits:
        # What the step's task may spend: a workflow's calls share its reservation between them.
        reserved = (state.get("admitted") or {}).get(step["id"])
        task["spend"] = {"loop": limits["loop"], "models": limits.get("models") or {}, "reserved": reserved}
    return task


async def schedule(state: GraphState) -> dict[str, Any]:
    return check_budget(state, dt.datetime.now(dt.UTC))


def fan_out(state: GraphState) -> list[Send | str] | str:
    if state.get("failure") or state.get("stop"):
        return "finish"
    ready = ready_steps(state)
    if not ready:
        return "finish"
    # Plain steps go to their own delegate task with what they need (the Send is checkpointed);
    # batch steps are advanced by the batch node, which reads the state instead, so that the
    # items are not written into every checkpoint.
    admitted = state.get("admitted")
    targets: list[Send | str] = [
        Send("delegate", step_task(state, step))
        for step in ready
        if step.get("for_each") is None
        and (admitted is None or step.get("wait") is not None or step["id"] in admitted)
    ]
    if any(
        step.get("for_each") is not None and (admitted is None or step["id"] in admitted) for step in ready
    ):
        targets.append("batch")
    return targets


async def finish(state: GraphState) -> dict[str, Any]:
    return {"finished": True}


class _Nodes:
    """The graph's nodes that call out (to specialists, through the delegator, or to a workflow's
    own graph, whose calls come back here)."""

    def __init__(self, delegator: Delegator, workflows: Mapping[str, Workflow] | None = None) -> None:
        self.delegator = delegator
        self.workflows = dict(workflows or {})

    async def batch(self, state: GraphState, runtime: Runtime[RunScope]) -> dict[str, Any]:
        update: dict[str, Any] = {"batches": {}, "results": {}, "outcomes": []}
        admitted = state.get("admitted")
        for step in ready_steps(state):
            if step.get("for_each") is None or (admitted is not None and step["id"] not in admitted):
                continue  # a batch step whose round the tranche does not cover waits for the next turn
            advanced = await run_batch(self.delegator, step_task(state, step), runtime.context)
            update["batches"].update(advanced.get("batches", {}))
            update["results"].update(advanced.get("results", {}))
            update["outcomes"].extend(advanced.get("outcomes", []))
            if advanced.get("failure"):
                update["failure"] = advanced["failure"]
                break
        return update

    async def delegate(self, task: StepTask, runtime: Runtime[RunScope]) -> dict[str, Any]:
        step = task["step"]
        if step.get("wait") is not None:
            if "event" in step["wait"]:
                return wait_for_event(step, dt.datetime.now(dt.UTC))
            if "batch" in step["wait"]:
                return await collect_batch(step, runtime.context, dt.datetime.now(dt.UTC))
            return wait_for_timer(step, dt.datetime.now(dt.UTC))
        try:
            payload = resolve_input(step["input"], task["results"])
            if RESERVED_INPUT in payload:  # e.g. from an earlier step's output: only a person approves
                raise FleetError(
                    ErrorCode.INVALID_REQUEST,
                    f"input.{RESERVED_INPUT} is reserved for approvals the fleet records",
                )
        except FleetError as exc:
            _emit(EventType.STEP_FAILED, _failure(step, exc))
            return {"failure": _failure(step, exc)}
        name = workflow_name(step["skill"])
        if name is not None:
            return await run_workflow(self, self.workflows.get(name), task, payload, runtime.context)
        return await self.call_step(task, payload, runtime.context)

    async def call_step(self, task: StepTask, payload: dict[str, Any], scope: RunScope) -> dict[str, Any]:
        """Send one step's call (``payload``, its input resolved) to an agent offering its skill,
        through the ledger, and wait for its result, asking policy or a person at every gate the
        result raises; the state update (``results`` or ``failure``, and its ``outcomes``)."""
        step = task["step"]
        # a call of a workflow: the policy of its own skill's gates, not the workflow's
        approvals = task.get("approvals")
        deadlines = approval_deadline(approvals, step["skill"]) if approvals is not None else task["approval"]

        async def progress(text: str) -> None:
            _emit(EventType.STEP_PROGRESS, StepProgress(step=step["id"], text=text), text)

        spend = task.get("spend")
        limits = (
            (lambda agent: spending.task_limits(spend, agent.id, spend.get("reserved")))
            if spend is not None
            else None
        )
        dispatcher = StepDispatcher(
            self.delegator,
            scope,
            step_id=step["id"],
            skill=step["skill"],
            payload=payload,
            tenant=task["tenant"],
            progress=progress,
            announce=True,  # started with the intent, completed with the result
            completes=_completes,
            named=step.get("agent"),
            limits=limits,
            models=(spend or {}).get("models"),
        )
        calls = [dispatcher]
        try:
            result = await _run_or_wait(dispatcher, step["id"])
            number = 0
            asked_op = dispatcher.op_id  # the call that first asked: it keyed the tool call
            while (gate := gate_of(result)) is not None:
                # The step asks first (approval, or input): policy, on what the run computed, or a
                # person. The answer goes into the step's next call, a new operation (its own id,
                # so the ledger sends it once).
                answer = await policy_approval(self.delegator, task, gate, dispatcher.op_id, number)
                if answer is None:
                    answer = await_gate(step, gate, number, dispatcher, deadlines)
                if answer["decision"] in ("reject", "expired"):
                    return _gate_closed(step, answer, dispatcher.agent_id)
                number += 1
                payload = answered(payload, answer, asked_op)
                asked = dispatcher.agent if dispatcher.agent and dispatcher.agent.url else None  # still there
                dispatcher = StepDispatcher(
                    self.delegator,
                    scope,
                    step_id=f"{step['id']}~{number}",
                    skill=step["skill"],
                    payload=payload,
                    tenant=task["tenant"],
                    progress=progress,
                    announce=True,
                    completes=_completes,
                    named=step.get("agent"),
                    limits=limits,
                    models=(spend or {}).get("models"),
                    resume_from=dispatcher.op_id,  # the call that asked: its loop's notes go on
                )
                calls.append(dispatcher)
                result = await _run_or_wait(dispatcher, step["id"], asked)
        except (StaleLease, CancelRequested, DependencyUnavailable):
            raise  # not the step's failure: this worker must stop writing
        except FleetError as exc:
            if not dispatcher.agent_id:  # it never got to an agent (none offers the skill)
                _emit(EventType.STEP_FAILED, _failure(step, exc))
                return {"failure": _failure(step, exc)}
            _emit(EventType.STEP_FAILED, StepFailed(**_failure(step, exc), agent=dispatcher.agent_id))
            return {
                "failure": _failure(step, exc),
                "outcomes": [_outcome(step, dispatcher.agent_id, "failed", calls, spend)],
            }
        return {
            "results": {step["id"]: result},
            "outcomes": [_outcome(step, dispatcher.agent_id, "completed", calls, spend)],
        }


def _outcome(
    step: PlanStep, agent: str, status: str, calls: list[StepDispatcher], spend: dict[str, Any] | None
) -> dict[str, Any]:
    """A step's outcome as the run's state keeps it, with what its calls said they spent, priced."""
    outcome: dict[str, Any] = {"step": step["id"], "agent": agent, "status": status}
    usage = spending.of_calls([call.usage for call in calls], (spend or {}).get("models") or {})
    if usage is not None:
        outcome["usage"] = usage
    return outcome


def build_graph(
    delegator: Delegator,
    checkpointer: BaseCheckpointSaver[Any],
    workflows: Mapping[str, Workflow] | None = None,
) -> CompiledStateGraph[Any, Any, Any, Any]:
    """The coordinator's graph: schedule the ready steps, delegate each (or advance a batch, or run
    a registered workflow's graph, ``workflows``), and finish when nothing is left to do or the run
    stopped."""
    nodes = _Nodes(delegator, workflows)
    builder: StateGraph[GraphState, RunScope, Any, Any] = StateGraph(GraphState, context_schema=RunScope)
    builder.add_node("schedule", schedule)
    builder.add_node("delegate", nodes.delegate)  # type: ignore[arg-type]  # its input is a StepTask (Send)
    builder.add_node("batch", nodes.batch)
    builder.add_node("finish", finish)
    builder.add_edge(START, "schedule")
    builder.add_conditional_edges("schedule", fan_out, ["delegate", "batch", "finish"])
    builder.add_edge("delegate", "schedule")
    builder.add_edge("batch", "schedule")
    builder.add_edge("finish", END)
    return builder.compile(checkpointer=checkpointer)
