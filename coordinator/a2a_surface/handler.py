"""The coordinator's A2A request handler: the SDK's, with cancel and subscribe answered from the runs.

The SDK keeps a task's live state in the process that runs its executor; here that state is the
run's event log in Postgres, which any coordinator process can read. So:

* ``CancelTask`` is a cancel signal (:meth:`coordinator.control.signals.SignalDesk.apply`, via ``a2a``): the
  same reach (``fleet.runs.access``) and the same ``fleet.approvals.decision`` as a cancel from the
  run API, the console, the CLI or NATS, recorded with the run's signals; a refusal is
  ``TaskNotCancelableError`` with the ``forbidden`` code. It then waits for the run's terminal
  event. The task then
  shows the one terminal state the run reached: ``canceled``, or, if the run completed (or failed)
  first, that state, with "not cancelable". Canceling a canceled task answers with the task.
* ``SubscribeToTask`` follows the event log, so it works after a restart and on any replica, and it
  resumes from a cursor (the resume extension): with ``Last-Event-ID: N`` the stream starts with the
  task as it stood at event N and goes on with exactly the updates after N. A cursor older than
  retention gets the current task, marked ``"resumed": "snapshot"``, then the updates after it.

Every call reaches only the tasks the caller's principal started, unless policy gives it the tenant's
(see :mod:`coordinator.record.access`); any other task is not found.

Closing a stream never cancels a run: only ``CancelTask`` does. A subscription takes a stream slot
(:mod:`coordinator.control.streams`) before its first event; over a cap it is a ``stream_limit`` JSON-RPC
error. Every follower here shares the process's one ``LISTEN`` connection (:mod:`coordinator.record.notifier`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.events import Event
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.types import CancelTaskRequest, SubscribeToTaskRequest, Task, TaskState
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.proto_utils import validate_proto_required_fields

from coordinator.a2a_surface.task_events import RESUME_EXTENSION, TERMINAL, TaskFold
from coordinator.a2a_surface.task_store import PostgresTaskStore
from coordinator.control.signals import Signal, SignalDesk
from coordinator.control.streams import Streams, a2a_slot
from coordinator.record.access import Reach, RunAction
from coordinator.record.notifier import RunNotifier
from coordinator.record.runs import PostgresRunStore
from fleet.a2a_support import a2a_error, claims_of
from fleet.errors import ErrorCode, FleetError
from fleet.vocabulary import SignalAction

CANCEL_TIMEOUT_S = 60.0
CURSOR_HEADER = "last-event-id"


def resume_cursor(context: ServerCallContext) -> int | None:
    """The ``Last-Event-ID`` service parameter (HTTP header) of a subscribe call, if any."""
    headers: dict[str, str] = context.state.get("headers", {})
    raw = headers.get(CURSOR_HEADER)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()):
        error = FleetError(ErrorCode.INVALID_REQUEST, "Last-Event-ID must be an event id (a whole number)")
        raise a2a_error(error, InvalidParamsError)
    return int(raw)


async def follow(
    fold: TaskFold,
    runs: PostgresRunStore,
    tasks: PostgresTaskStore,
    tenant: str,
    notifier: RunNotifier,
    *,
    owner: str | None = None,
) -> AsyncGenerator[Event]:
    """The updates of the events after ``fold.seq``, as they are committed, until the task ends or
    comes to wait for someone. If retention prunes events from under the reader, it sends the task as
    it is now instead and goes on after it. ``owner``: the reader's reach (see ``fold``)."""
    task_id = fold.task.id
    async for event in runs.follow(task_id, tenant, fold.seq, notifier, owner=owner):
        if event.seq <= fold.seq:
            continue  # already in a snapshot sent below
        if event.seq > fold.seq + 1:
            current = await tasks.fold(task_id, tenant, owner=owner)
            if current is not None and current.seq > fold.seq:
                fold = current
                yield _marked_snapshot(fold, f"events after {fold.base} were pruned while reading")
                if fold.final:
                    return
                continue
        before = fold.state
        update = fold.apply(event)
        if update is not None:
            yield update
        if fold.state in TERMINAL or (fold.final and fold.state != before):
            return


def _marked_snapshot(fold: TaskFold, reason: str) -> Task:
    task = fold.snapshot()
    task.metadata.update({RESUME_EXTENSION: {"eventId": fold.seq, "resumed": "snapshot", "reason": reason}})
    return task


class CoordinatorRequestHandler(DefaultRequestHandler):
    """Cancel and subscribe from the run store (see the module docstring); everything else as the
    SDK does it, over :class:`~coordinator.a2a_surface.task_store.PostgresTaskStore`."""

    def __init__(
        self,
        *,
        tasks: PostgresTaskStore,
        runs: PostgresRunStore,
        desk: SignalDesk,
        streams: Streams,
        cancel_timeout_s: float = CANCEL_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(task_store=tasks, **kwargs)
        self._tasks = tasks
        self._runs = runs
        self._desk = desk
        self._streams = streams
        self._cancel_timeout_s = cancel_timeout_s

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task | None:
        validate_proto_required_fields(params)
        reach = await self._tasks.reach(context, RunAction.CANCEL)
        fold = await self._tasks.fold(params.id, reach.tenant, owner=reach.owner)
        if fold is None:
            raise TaskNotFoundError
        if fold.state not in TERMINAL:
            signal = Signal(params.id, SignalAction.CANCEL, f"a2a-cancel-{uuid.uuid4().hex}", "a2a")
            try:
                await self._desk.apply(signal, claims_of(context))
            except FleetError as exc:
                if exc.code == ErrorCode.NOT_FOUND:
                    raise TaskNotFoundError from exc
                raise a2a_error(exc, TaskNotCancelableError) from exc
            fold = await self._until_ended(fold, reach)
        if fold.state in TERMINAL and fold.state != TaskState.TASK_STATE_CANCELED:
            raise TaskNotCancelableError(
                message=f"the task already ended {TaskState.Name(fold.state).removeprefix('TASK_STATE_')}"
            )
        # Canceled (also by an earlier request), or still stopping after the timeout: it will end
        # canceled, since the run refuses every write but its end once a cancel is recorded.
        return fold.task

    async def _until_ended(self, fold: TaskFold, reach: Reach) -> TaskFold:
        try:
            async with asyncio.timeout(self._cancel_timeout_s):
                async for event in self._runs.follow(
                    fold.task.id, reach.tenant, fold.seq, self._streams.notifier, owner=reach.owner
                ):
                    fold.apply(event)
        except TimeoutError:
            pass
        return fold

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        validate_proto_required_fields(params)
        reach = await self._tasks.reach(context)
        tenant, owner = reach.tenant, reach.owner
        cursor = resume_cursor(context)
        fold = await self._tasks.fold(params.id, tenant, upto=cursor, owner=owner)
        if fold is None:
            raise TaskNotFoundError
        # Before the first event: the SDK fetches it eagerly, so a refusal is a plain JSON-RPC error.
        slot = await a2a_slot(self._streams.slots, claims_of(context), "SubscribeToTask")
        try:
            async for update in self._subscribed(params.id, fold, cursor, reach):
                yield update
        finally:
            slot.release()

    async def _subscribed(
        self, task_id: str, fold: TaskFold, cursor: int | None, reach: Reach
    ) -> AsyncGenerator[Event]:
        tenant, owner = reach.tenant, reach.owner
        if cursor is None:
            if fold.state in TERMINAL:
                raise UnsupportedOperationError(
                    message=f"task {task_id} has ended; GetTask shows it, or resubscribe with "
                    "Last-Event-ID to get the updates after an event"
                )
            yield fold.snapshot()
        elif cursor < fold.base:
            current = await self._tasks.fold(task_id, tenant, owner=owner)
            if current is None:
                raise TaskNotFoundError
            fold = current
            yield _marked_snapshot(
                fold, f"event {cursor} is older than retention (events up to {fold.base} were pruned)"
            )
        elif fold.seq < cursor:
            beyond = f"Last-Event-ID {cursor} is beyond the task's last event {fold.seq}"
            raise a2a_error(FleetError(ErrorCode.INVALID_REQUEST, beyond), InvalidParamsError)
        else:
            yield fold.snapshot()
        if fold.state in TERMINAL:
            return
        async for update in follow(
            fold, self._runs, self._tasks, tenant, self._streams.notifier, owner=owner
        ):
            yield update


__all__ = ["CURSOR_HEADER", "CoordinatorRequestHandler", "follow", "resume_cursor"]
