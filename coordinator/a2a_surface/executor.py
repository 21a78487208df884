"""The coordinator's A2A executor: plan the request, create the run (its id is the task id), hand it
to the workers, and relay the run's progress and result to the caller."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from a2a.helpers import (
    get_data_parts,
    get_text_parts,
    new_data_part,
    new_task_from_user_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events import EventQueue
from a2a.types import InternalError, InvalidParamsError, Message, Role, Task
from a2a.utils.errors import UnsupportedOperationError
from opentelemetry.trace import Span, SpanKind

from coordinator.a2a_surface.handler import follow
from coordinator.a2a_surface.task_events import TaskFold, event_id_of, initial_task
from coordinator.a2a_surface.task_store import PostgresTaskStore
from coordinator.control.signals import Signal, SignalDesk, parse_signal
from coordinator.control.streams import Streams, a2a_slot
from coordinator.engine.delegation import Delegator
from coordinator.engine.workflows import workflow_name
from coordinator.planning.plan import Planner, Step, plan_request
from coordinator.record import work
from coordinator.record.runs import PostgresRunStore, RunNotFound
from fleet import telemetry
from fleet.a2a_support import a2a_error, claims_of
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.retry import backoff_s
from fleet.tokens import Claims
from policy import PolicyEngine

log = logging.getLogger(__name__)

MAX_TEXT = 20_000  # the words of a run started through the run API


MAX_UNQUEUED = 10_000  # runs waiting to be queued again at once (beyond, the workers' sweep)
RESUBMIT_BACKOFF_S = 1.0
RESUBMIT_CAP_S = 8.0
RESUBMIT_FOR_S = 90.0  # then the sweep (which looks at runs stranded for 120 s)
_IDEMPOTENT_RUNS = uuid.UUID("6f1c2c1e-5b1a-4c52-9a44-5a0c8f3d2b71")
MAX_IDEMPOTENCY_KEY = 255


def idempotent_run_id(claims: Claims, key: str) -> str:
    """The run id of ``key`` for its caller: the same for the same tenant, subject and key, another
    for anyone else's (a key is the caller's own namespace). ``invalid_request`` unless the key is
    1-255 printable characters."""
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise FleetError(
            ErrorCode.INVALID_REQUEST, f"Idempotency-Key: 1 to {MAX_IDEMPOTENCY_KEY} printable characters"
        )
    return str(uuid.uuid5(_IDEMPOTENT_RUNS, "\n".join((claims.tenant, claims.sub, key))))


class RunNotGranted(FleetError):
    """The run could not be given its caller's authority (the token service refused or failed)."""


def _request_of(message: Message) -> dict[str, Any]:
    """What the run was asked to do, as recorded on the run, with the trace context of the request
    that asked (when traced), so a slice resumed much later can link back to it."""
    parts = list(message.parts)
    recorded: dict[str, Any] = {"text": " ".join(get_text_parts(parts)), "data": get_data_parts(parts)}
    trace_context = dict(telemetry.inject({}))
    if trace_context:
        recorded[work.TRACE_KEY] = trace_context
    return recorded


YES = frozenset({"approve", "approved", "yes", "ok"})
NO = frozenset({"reject", "rejected", "no", "deny"})


def signal_of_message(task_id: str, texts: list[str], data: list[Any], message_id: str = "") -> Signal:
    """The signal a follow-up message gives: a data part with an ``action`` is a signal as the run
    API takes it; other data is input; a text of ``approve``/``yes`` approves, ``reject``/``no``
    rejects, and any other text is input (``{"text": ...}``). The message id is the signal's id,
    so a client that sends the same message again (a retry) gets the first answer, and does not
    answer whatever the run waits for by then."""
    signal_id = f"a2a:{message_id}" if message_id else None
    objects = [d for d in data if isinstance(d, dict)]
    text = " ".join(texts).strip()
    for body in objects:
        if "action" in body:
            return parse_signal(task_id, body, "a2a", signal_id)
    if objects:
        merged: dict[str, Any] = {k: v for body in objects for k, v in body.items()}
        return parse_signal(task_id, {"action": "input", "input": merged, "note": text}, "a2a", signal_id)
    word = text.lower().rstrip(".!")
    if word in YES:
        return parse_signal(task_id, {"action": "approve"}, "a2a", signal_id)
    if word in NO:
        return parse_signal(task_id, {"action": "reject"}, "a2a", signal_id)
    if not text:
        raise FleetError(ErrorCode.INVALID_REQUEST, "a follow-up message needs text or data")
    return parse_signal(task_id, {"action": "input", "input": {"text": text}}, "a2a", signal_id)


class CoordinatorExecutor(AgentExecutor):
    """The A2A side of a run: plan, create the run, hand it to the workers, and relay its event log
    to the caller until the task ends or waits for someone. The run itself is advanced by a worker,
    so it outlives this process and this connection: closing the stream never cancels it."""

    def __init__(
        self,
        delegator: Delegator,
        engine: PolicyEngine,
        runs: PostgresRunStore,
        tasks: PostgresTaskStore,
        submit: Callable[[str, str, str], Awaitable[None]],
        streams: Streams,
        desk: SignalDesk,
        *,
        planner: Planner | None = None,
        workflows: frozenset[str] = frozenset(),
    ) -> None:
        """``planner``: plans a text no routing rule matches (an LLM's, see
        :func:`coordinator.planning.llm_planner.llm_planner`); without one such a text is refused."""
        self._delegator = delegator
        self._engine = engine
        self._runs = runs
        self._tasks = tasks
        self._submit = submit
        self._streams = streams
        self._desk = desk
        self._planner = planner
        self._workflows = workflows  # the registered workflows' names
        # Runs made while their work message could not be queued (the bus cut off): queued again
        # soon by resubmit_forever, rather than by the workers' sweep for stranded runs minutes later.
        self._unqueued: asyncio.Queue[tuple[str, str, float]] = asyncio.Queue(MAX_UNQUEUED)

    async def _plan(self, message: Message, tenant: str) -> list[Step]:
        """Plan and check that every skill has a specialist (or workflow), before the run is
        accepted; a :class:`FleetError` why not."""
        parts = list(message.parts)
        steps = await plan_request(
            get_data_parts(parts),
            " ".join(get_text_parts(parts)),
            self._engine,
            tenant,
            planner=self._planner,
        )
        for step in steps:  # each step has an agent routing may give it (no_specialist_for_skill)
            workflow = workflow_name(step.skill)
            if workflow is not None:
                if workflow not in self._workflows:
                    known = ", ".join(sorted(self._workflows)) or "none"
                    raise FleetError(
                        ErrorCode.NO_SPECIALIST,
                        f"no workflow {workflow} is registered (there are: {known})",
                    )
            elif step.wait is None:
                await self._delegator.assign(step.skill, tenant=tenant, named=step.agent)
        return steps

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Start a run, or pass a follow-up to one, under the request's SERVER span: the trace a
        caller's ``traceparent`` names, or a new one. The work message carries that span's context,
        so the worker's slice is its child."""
        claims = claims_of(context.call_context)
        headers = context.call_context.state.get("headers") if context.call_context else None
        span = telemetry.invoke_agent_span(
            "coordinator",
            kind=SpanKind.SERVER,
            run_id=context.current_task.id if context.current_task is not None else "",
            tenant=claims.tenant,
            parent=headers if isinstance(headers, dict) else None,
        )
        # A relay is a stream: it takes a slot before anything is done (a refused request changes nothing).
        with span as current, await a2a_slot(self._streams.slots, claims, "SendMessage"):
            if context.current_task is not None:
                await self._follow_up(context, context.current_task, event_queue)
            else:
                await self._start(context, event_queue, claims, current)

    async def admit(self, message: Message, claims: Claims, call: ServerCallContext) -> Task:
        """Plan ``message`` for the caller ``claims``, create its run (its id is the task's) and hand
        it to the workers: the task as accepted. A :class:`FleetError` if it is not (a plan refused,
        a skill or workflow nobody offers, a context of another principal's: ``RunNotGranted``
        when the run could not be given its caller's authority)."""
        steps = await self._plan(message, claims.tenant)
        task = new_task_from_user_message(message)
        plan = [s.to_dict() for s in steps]
        # the context is the caller's own, or new: never another principal's or tenant's
        await self._tasks.claim_context(task.context_id, claims.tenant, claims.sub)
        try:  # the caller's authority, for the run's life (see coordinator.engine.delegation)
            grant = await self._delegator.run_grant(claims, task.id)
        except FleetError as exc:
            log.warning("no run grant for %s's request: %s", claims.sub, exc)
            why = f"the run could not be given its caller's authority: {exc.message}"
            raise RunNotGranted(
                exc.code, why, retryable=exc.retryable, retry_after_s=exc.retry_after_s
            ) from exc
        await self._runs.create_run(task.id, claims.tenant, claims.sub, _request_of(message), plan, grant)
        await self._tasks.save(task, call)  # its context id, before the task is shown to anyone
        try:
            await self._submit(task.id, "", claims.tenant)
        except Exception:  # the run is durable already: queued again soon (or by the workers' sweep)
            log.warning("could not submit run %s; trying again shortly", task.id, exc_info=True)
            with contextlib.suppress(asyncio.QueueFull):  # full: the stranded-run sweep takes it
                self._unqueued.put_nowait((task.id, claims.tenant, time.monotonic()))
        return task

    async def resubmit_forever(self) -> None:
        """Queue again the work of runs made while the bus did not take it, backing off from a
        second, for ``RESUBMIT_FOR_S`` each; after that the workers' sweep for stranded runs does
        (a run of a partitioned coordinator waited minutes for it, seen across hosts)."""
        while True:
            run_id, tenant, since = await self._unqueued.get()
            tries = 0
            while True:
                tries += 1
                await asyncio.sleep(backoff_s(tries, base_s=RESUBMIT_BACKOFF_S, cap_s=RESUBMIT_CAP_S))
                try:
                    await self._submit(run_id, "", tenant)
                    log.info("run %s queued after %d tries", run_id, tries)
                    break
                except Exception as exc:
                    if time.monotonic() - since > RESUBMIT_FOR_S:
                        log.warning("run %s still not queued (%s); the stranded-run sweep will", run_id, exc)
                        break

    async def start_from_api(
        self, body: dict[str, Any], claims: Claims, idempotency_key: str | None = None
    ) -> tuple[str, bool]:
        """A run the run API was asked for (``POST /v1/runs``: ``{"steps": [...]}``, ``{"workflow",
        "input"}`` or ``{"text"}``), admitted as an A2A request is: its id, and whether it was made
        now. With ``idempotency_key`` the run's id is derived from the caller (tenant, subject) and
        the key, so a request sent again (a client that lost the answer) gets the run the first one
        made, and only one run is ever made for it (:func:`idempotent_run_id`)."""
        run_id = idempotent_run_id(claims, idempotency_key) if idempotency_key is not None else None
        if run_id is not None:
            try:
                return (await self._runs.get_run(run_id, claims.tenant, owner=claims.sub)).run_id, False
            except RunNotFound:
                pass
        text = body.get("text", "")
        if not isinstance(text, str) or len(text) > MAX_TEXT:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"text is a string of at most {MAX_TEXT} characters")
        data = {k: v for k, v in body.items() if k in ("steps", "workflow", "input")}
        parts = ([new_text_part(text)] if text else []) + ([new_data_part(data)] if data else [])
        if not parts:
            raise FleetError(
                ErrorCode.INVALID_REQUEST,
                'send {"steps": [...]}, {"workflow": NAME, "input": {...}} or {"text": ...}',
            )
        message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=parts, task_id=run_id or "")
        task = await self.admit(message, claims, ServerCallContext(state={"claims": claims}))
        return str(task.id), True

    async def _start(
        self, context: RequestContext, event_queue: EventQueue, claims: Claims, span: Span
    ) -> None:
        assert context.message is not None and context.call_context is not None
        try:
            task = await self.admit(context.message, claims, context.call_context)
        except (DependencyUnavailable, RunNotGranted) as exc:  # for a while: send it again
            raise a2a_error(exc, InternalError) from exc
        except FleetError as exc:
            raise a2a_error(exc, InvalidParamsError) from exc
        span.set_attributes({"fleet.run_id": task.id, "gen_ai.conversation.id": task.id})
        await event_queue.enqueue_event(task)
        fold = TaskFold(initial_task(task.id, task.context_id, context.message))
        async for update in follow(fold, self._runs, self._tasks, claims.tenant, self._streams.notifier):
            await event_queue.enqueue_event(update)

    async def _follow_up(self, context: RequestContext, task: Task, event_queue: EventQueue) -> None:
        """A follow-up message on a task: a signal for its run (an approval, a rejection, or
        input for what it waits for), then the relay of what happens from here on."""
        claims = claims_of(context.call_context)
        parts = list(context.message.parts) if context.message else []
        try:
            message_id = context.message.message_id if context.message else ""
            signal = signal_of_message(task.id, get_text_parts(parts), get_data_parts(parts), message_id)
            outcome = await self._desk.apply(signal, claims)
        except FleetError as exc:
            raise a2a_error(exc, InvalidParamsError) from exc
        log.info("follow-up on task %s: %s %s", task.id, signal.action, outcome.outcome)
        current = Task()  # on a copy: the SDK owns `task`
        current.CopyFrom(task)
        fold = TaskFold(current, event_id_of(task.metadata) or 0)
        async for update in follow(fold, self._runs, self._tasks, claims.tenant, self._streams.notifier):
            await event_queue.enqueue_event(update)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Never called: :class:`~coordinator.a2a_surface.handler.CoordinatorRequestHandler` cancels through the
        run store, so that the task shows the one terminal state its run reached."""
        raise UnsupportedOperationError(message="cancel goes through the run store")
