"""A run's event log seen as an A2A task: one deterministic mapping from run events to A2A updates.

The event log is the truth; the A2A task is a fold over it. The live relay, ``GetTask`` and
``ListTasks``, a resumed ``SubscribeToTask`` and push notifications all use :class:`TaskFold`, so
they can never disagree: a snapshot taken at event N followed by the updates of events N+1.. is the
same task as the live stream produced. Everything an update carries comes from the event (ids, text,
timestamps), never from the clock, so folding the same events twice gives the same task.

Every update carries the sequence number of the event it came from in its metadata, under the resume
extension's URI: ``{"https://agent-fleet.dev/ext/resume/v1": {"eventId": N}}``. A client that lost its
stream resubscribes with ``Last-Event-ID: N`` and gets exactly the updates it missed.
"""

from __future__ import annotations

from typing import Any

from a2a.helpers import new_data_part, new_text_part
from a2a.server.tasks.task_manager import append_artifact_to_task
from a2a.types import (
    Artifact,
    Message,
    Part,
    Role,
    Task,
    TaskArtifactUpdateEvent,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from google.protobuf.struct_pb2 import Struct

from coordinator.record.runs import RunEvent, RunState
from fleet.vocabulary import EventType

RESUME_EXTENSION = "https://agent-fleet.dev/ext/resume/v1"

TaskUpdate = TaskStatusUpdateEvent | TaskArtifactUpdateEvent

A2A_STATE: dict[RunState, TaskState] = {
    RunState.SUBMITTED: TaskState.TASK_STATE_SUBMITTED,
    RunState.WORKING: TaskState.TASK_STATE_WORKING,
    RunState.WAITING: TaskState.TASK_STATE_INPUT_REQUIRED,
    RunState.INPUT_REQUIRED: TaskState.TASK_STATE_INPUT_REQUIRED,
    RunState.COMPLETED: TaskState.TASK_STATE_COMPLETED,
    RunState.FAILED: TaskState.TASK_STATE_FAILED,
    RunState.CANCELED: TaskState.TASK_STATE_CANCELED,
    RunState.REJECTED: TaskState.TASK_STATE_REJECTED,
}
TERMINAL = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_FAILED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_REJECTED,
    }
)
# A stream ends here too: the task waits for someone, and the spec closes streams at such a state.
INTERRUPTED = frozenset({TaskState.TASK_STATE_INPUT_REQUIRED, TaskState.TASK_STATE_AUTH_REQUIRED})
_RUN_STATES = {state.value: state for state in RunState}


def initial_task(task_id: str, context_id: str, message: Message | None) -> Task:
    """The task as it stands before its first event: submitted, with the request in its history."""
    return Task(
        id=task_id,
        context_id=context_id,
        status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
        history=[message] if message is not None else [],
    )


def resume_metadata(**fields: Any) -> Struct:
    """Metadata carrying the resume extension's fields (``eventId`` and friends)."""
    metadata = Struct()
    metadata.update({RESUME_EXTENSION: fields})
    return metadata


def event_id_of(metadata: Struct) -> int | None:
    """The event sequence number an update or a task snapshot carries, if any."""
    if RESUME_EXTENSION not in metadata.fields:
        return None
    value = metadata.fields[RESUME_EXTENSION].struct_value.fields.get("eventId")
    return int(value.number_value) if value is not None else None


class TaskFold:
    """Folds a run's events, in order, into its A2A task, and says which update each event makes.

    ``seq`` is the last event folded in; the task's metadata carries it too, so a ``GetTask`` tells a
    client where to resume from. ``base`` is the event the fold started after: events up to it are
    no longer in the log (retention), so nobody can resume from before it."""

    def __init__(self, task: Task, seq: int = 0) -> None:
        self.task = task
        self.seq = seq
        self.base = seq
        self._stamp()

    @property
    def state(self) -> TaskState:
        return self.task.status.state

    @property
    def final(self) -> bool:
        """Whether the task is terminal or waits for someone (a stream stops here)."""
        return self.state in TERMINAL or self.state in INTERRUPTED

    def snapshot(self) -> Task:
        """A copy of the task as folded so far (the fold keeps going; the copy does not change)."""
        copy = Task()
        copy.CopyFrom(self.task)
        return copy

    def apply(self, event: RunEvent) -> TaskUpdate | None:
        """Fold ``event`` in; return the A2A update it makes, or None if it changes nothing a client
        sees (the event still advances ``seq``)."""
        update = self._update_for(event)
        if isinstance(update, TaskStatusUpdateEvent):
            if self.task.status.HasField("message"):
                self.task.history.append(self.task.status.message)
            self.task.status.CopyFrom(update.status)
        elif isinstance(update, TaskArtifactUpdateEvent):
            append_artifact_to_task(self.task, update)
        self.seq = event.seq
        self._stamp()
        return update

    def _stamp(self) -> None:
        self.task.metadata.update({RESUME_EXTENSION: {"eventId": self.seq}})

    def _update_for(self, event: RunEvent) -> TaskUpdate | None:
        if event.type == EventType.ARTIFACT:
            return self._artifact(event)
        run_state = _run_state_of(event)
        state = A2A_STATE[run_state] if run_state is not None else self.state
        if run_state == RunState.WAITING and (event.payload.get("wait") or {}).get("type") in (
            "timer",
            "event",
            "batch",
        ):
            state = TaskState.TASK_STATE_WORKING  # it waits for a time or events, not for anyone
        parts = _message_parts(event)
        if state == self.state and not parts:
            return None  # nothing a client would see: not a transition, no text
        status = TaskStatus(state=state)
        status.timestamp.FromDatetime(event.ts)
        if parts:
            status.message.CopyFrom(
                Message(
                    role=Role.ROLE_AGENT,
                    message_id=f"{self.task.id}.{event.seq}",
                    task_id=self.task.id,
                    context_id=self.task.context_id,
                    parts=parts,
                )
            )
        return TaskStatusUpdateEvent(
            task_id=self.task.id,
            context_id=self.task.context_id,
            status=status,
            metadata=resume_metadata(eventId=event.seq),
        )

    def _artifact(self, event: RunEvent) -> TaskArtifactUpdateEvent:
        payload = event.payload
        data = {k: v for k, v in payload.items() if k not in ("name", "text")}
        parts: list[Part] = [new_text_part(str(payload.get("text", "")))]
        if data:
            parts.append(new_data_part(data))
        return TaskArtifactUpdateEvent(
            task_id=self.task.id,
            context_id=self.task.context_id,
            artifact=Artifact(
                artifact_id=f"{self.task.id}.{event.seq}",
                name=str(payload.get("name", "result")),
                parts=parts,
            ),
            last_chunk=True,
            metadata=resume_metadata(eventId=event.seq),
        )


def _run_state_of(event: RunEvent) -> RunState | None:
    """The state the run moved to with this event, if it moved: every writer that changes the run's
    state records it in the payload (``run.<state>`` transitions, a person's resolution, ...)."""
    named = event.payload.get("state")
    if isinstance(named, str) and named in _RUN_STATES:
        return _RUN_STATES[named]
    return _RUN_STATES.get(event.type.removeprefix("run.")) if event.type.startswith("run.") else None


def _said(event: RunEvent) -> str:
    """The text of an event that the log keeps without one (it would only repeat the payload)."""
    payload = event.payload
    if event.type == EventType.STEP_STARTED and payload.get("agent"):
        return f"step {payload.get('step')}: {payload.get('skill')} -> {payload['agent']}"
    if event.type == EventType.STEP_REROUTED:
        return f"step {payload.get('step')}: rerouted {payload.get('from')} -> {payload.get('to')} ({payload.get('why')})"
    return ""


def _message_parts(event: RunEvent) -> list[Part]:
    """What a person should read about this event: its text, and a failure's details."""
    if event.type in (EventType.RUN_SUBMITTED, "plan") and event.payload.get("steps"):  # the run's plan
        skills = " -> ".join(str(step.get("skill")) for step in event.payload.get("steps", []))
        return [new_text_part(f"plan: {skills}")] if skills else []
    text = event.payload.get("text") or _said(event)
    if not text:
        return []
    parts = [new_text_part(str(text))]
    if event.type == EventType.RUN_FAILED and "failure" in event.payload:
        parts.append(new_data_part({"failure": event.payload["failure"]}))
    if isinstance(event.payload.get("error"), dict):  # a run ended by an error: the error as data
        parts.append(new_data_part({"error": event.payload["error"]}))
    return parts


__all__ = [
    "RESUME_EXTENSION",
    "TERMINAL",
    "TaskFold",
    "TaskUpdate",
    "event_id_of",
    "initial_task",
    "resume_metadata",
]
