"""The run's vocabulary: every kind of event a run's log may hold, and every action a signal may ask.

These are the names on the wire (the run API's events, the A2A status updates, the debug bundle),
in the run store, and in policy: the Rego bundles read the signal actions from data generated from
:class:`SignalAction` (``policy/bundles/fleet/vocabulary/data.json``, written by
``python -m policy.vocabulary``, checked by a test), so a new action cannot be known to the code and
unknown to policy. The members are ``str``: ``EventType.RUN_FAILED == "run.failed"``, and they are stored
and sent as their value.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


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


def policy_data() -> dict[str, Any]:
    """The vocabulary as the Rego bundles read it (``data.vocabulary``)."""
    return {
        "signal_actions": [action.value for action in SignalAction],
        "run_events": [event.value for event in EventType],
    }


__all__ = ["ENDING", "EventType", "SignalAction", "policy_data"]
