"""The run's vocabulary: every kind of event a run's log may hold, and every action a signal may ask.

These are the names on the wire (the run API's events, the A2A status updates, the debug bundle),
in the run store, and in policy: the Rego bundles read the signal actions from data generated from
:class:`SignalAction` (``policy/bundles/fleet/vocabulary/data.json``, written by
``python -m policy.vocabulary``, checked by a test), so a new action cannot be known to the code and
unknown to policy. The members are ``str``: ``EventType.RUN_FAILED == "run.failed"``, and they are stored
and sent as their value.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, NotRequired, Required  # pydantic needs these before 3.12

from pydantic import TypeAdapter, ValidationError
from typing_extensions import TypedDict


class EventType(StrEnum):
    """The type of a run event (``RunEvent.type``)."""

    # The run's state: one event per transition, ``run.<state>`` (``coordinator.record.runs.RunState``).
    RUN_SUBMITTED = "run.submitted"
    RUN_WORKING = "run.working"
    RUN_WAITING = "run.waiting"
    RUN_INPUT_REQUIRED = "run.input_required"
    RUN_COMPLETED = "run.completed"
    RUN_FAILED = "run.failed"
    RUN_CANCELED = "run.canceled"
    RUN_REJECTED = "run.rejected"
    # What happened to the run besides its state.
    RUN_CANCEL_REQUESTED = "run.cancel_requested"
    RUN_DEGRADED = "run.degraded"
    RUN_ESCALATED = "run.escalated"
    RUN_RESUMED = "run.resumed"
    # A plan step.
    STEP_STARTED = "step.started"
    STEP_PROGRESS = "step.progress"
    STEP_COMPLETED = "step.completed"
    STEP_FAILED = "step.failed"
    STEP_BLOCKED = "step.blocked"
    STEP_RENEWED = "step.renewed"
    STEP_REROUTED = "step.rerouted"
    # A wait (for a person, a timer, a batch or an event) and what ended it.
    WAIT_ANSWERED = "wait.answered"
    WAIT_EXTENDED = "wait.extended"
    WAIT_DEADLINE_NEAR = "wait.deadline_near"
    WAIT_EXPIRED = "wait.expired"
    APPROVAL_GRANTED = "approval.granted"
    APPROVAL_REJECTED = "approval.rejected"
    APPROVAL_ESCALATED = "approval.escalated"
    INPUT_PROVIDED = "input.provided"
    TIMER_DUE = "timer.due"
    TIMER_FIRED = "timer.fired"
    EVENT_DELIVERED = "event.delivered"
    EVENT_RECEIVED = "event.received"
    EVENT_TIMED_OUT = "event.timed_out"
    BATCH_PROGRESS = "batch.progress"
    BATCH_DUE = "batch.due"
    BATCH_CLOSE_REQUESTED = "batch.close_requested"
    BATCH_CLOSED = "batch.closed"
    # The run's budget.
    BUDGET_TRANCHE = "budget.tranche"
    BUDGET_EXHAUSTED = "budget.exhausted"
    BUDGET_EXPIRED = "budget.expired"
    # The operations ledger: a step's effect at a specialist.
    OPERATION_INTENT = "operation.intent"
    OPERATION_REDISPATCH = "operation.redispatch"
    OPERATION_RESOLVED = "operation.resolved"
    # An outcome recorded in the ledger, ``operation.<status>`` (``coordinator.record.operations.OpStatus``).
    OPERATION_SUCCEEDED = "operation.succeeded"
    OPERATION_FAILED = "operation.failed"
    OPERATION_NEEDS_HUMAN = "operation.needs_human"
    # The run's result (the last event before a completed run's end).
    ARTIFACT = "artifact"

    @classmethod
    def of_state(cls, state: str) -> EventType:
        """The event of a transition to ``state`` (a ``RunState`` value)."""
        return cls(f"run.{state}")

    @classmethod
    def of_operation(cls, status: str) -> EventType:
        """The event of an operation outcome ``status`` (an ``OpStatus`` value)."""
        return cls(f"operation.{status}")


# The events that end a run: after one of them the log holds nothing more.
ENDING = frozenset(
    {EventType.RUN_COMPLETED, EventType.RUN_FAILED, EventType.RUN_CANCELED, EventType.RUN_REJECTED}
)


class SignalAction(StrEnum):
    """What a signal to a run asks (``POST /v1/runs/{id}/signals``, ``fleet approve|reject``)."""

    APPROVE = "approve"
    REJECT = "reject"
    INPUT = "input"
    EXTEND = "extend"
    CANCEL = "cancel"


# The payloads of the events a reader acts on (the explain path, the A2A task fold, the CLI, the
# console): what each holds. Keys beyond these may be present (and are not checked); these have the
# types given. The graph builds its events with these types (mypy holds it to them), and the
# end-to-end tests check every event they read with payload_problems.


class StepStarted(TypedDict, total=False):
    """``step.started``: the step was sent to ``agent`` (a batch step: it has ``items`` items)."""

    step: Required[str]
    skill: str
    agent: str
    items: int


class StepCompleted(TypedDict, total=False):
    """``step.completed``: ``agent`` did the step (a batch step: ``items`` in ``calls`` calls)."""

    step: Required[str]
    agent: str
    items: int
    calls: int


class StepFailed(TypedDict):
    """``step.failed``: the error's code and message, and the error it wraps (an envelope of
    :meth:`fleet.errors.FleetError.to_dict`) from the agent or tool below."""

    step: str
    skill: str
    code: str
    message: str
    cause: NotRequired[dict[str, Any]]
    agent: NotRequired[str | None]
    done: NotRequired[int]  # a batch step: the items done before it failed


class StepBlocked(TypedDict):
    """``step.blocked``: operation ``op_id`` of the step needs a person to say what came of it."""

    step: str
    agent: str | None
    op_id: str
    why: str


class StepProgress(TypedDict):
    """``step.progress``: what the agent says it is doing."""

    step: str
    text: str


StepRerouted = TypedDict(
    "StepRerouted", {"step": str, "op_id": str, "from": str, "to": str, "why": str}, total=False
)
"""``step.rerouted``: the operation went from one agent to another, and why."""


class RunResumed(TypedDict):
    """``run.resumed``: a worker took the run up again, at these nodes of its graph."""

    at: list[str]


class RunDegraded(TypedDict):
    """``run.degraded``: the run stops early with its best result (``non_converging``, a budget)."""

    reason: str
    why: str


class RunEnded(TypedDict, total=False):
    """``run.completed``, ``run.failed``, ``run.canceled``, ``run.rejected``: the state and reason; a
    run that an error ended has ``error`` (its envelope) and ``text`` (the message), and one that a
    step's failure ended the ``failure`` too."""

    state: Required[str]
    reason: str | None
    text: str
    summary: str
    error: dict[str, Any]
    failure: StepFailed


PAYLOADS: Mapping[EventType, Any] = {
    EventType.STEP_STARTED: StepStarted,
    EventType.STEP_COMPLETED: StepCompleted,
    EventType.STEP_FAILED: StepFailed,
    EventType.STEP_BLOCKED: StepBlocked,
    EventType.STEP_PROGRESS: StepProgress,
    EventType.STEP_REROUTED: StepRerouted,
    EventType.RUN_RESUMED: RunResumed,
    EventType.RUN_DEGRADED: RunDegraded,
    **{ending: RunEnded for ending in ENDING},
}


@functools.cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def payload_problems(event_type: str, payload: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``payload`` as the payload of an event of ``event_type`` (nothing for a
    type without a declared payload): missing keys and values of the wrong type."""
    kind = PAYLOADS.get(event_type)  # type: ignore[call-overload]  # a str is looked up by value
    if kind is None:
        return []
    try:
        _adapter(kind).validate_python(dict(payload), strict=True)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


def policy_data() -> dict[str, Any]:
    """The vocabulary as the Rego bundles read it (``data.vocabulary``)."""
    return {
        "signal_actions": [action.value for action in SignalAction],
        "run_events": [event.value for event in EventType],
    }


__all__ = [
    "ENDING",
    "PAYLOADS",
    "EventType",
    "RunDegraded",
    "RunEnded",
    "RunResumed",
    "SignalAction",
    "StepBlocked",
    "StepCompleted",
    "StepFailed",
    "StepProgress",
    "StepRerouted",
    "StepStarted",
    "payload_problems",
    "policy_data",
]
