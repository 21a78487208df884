"""Coordinator workers: processes that advance runs taken from the work queue.

Any number of workers can run. For each message a worker takes the run's lease (so one worker at a
time advances a run, and a stale one cannot write), runs or resumes the run's graph from its Postgres
checkpoint, records every step in the event log, and acks the message only once the run has reached a
terminal state. A worker that dies holds no message for long: JetStream redelivers it after
``ack_wait`` and the next worker resumes the run once the dead worker's lease has expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

import httpx
import psycopg
from langchain_core.runnables import RunnableConfig
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, StateSnapshot
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext
from nats.js.errors import Error as JetStreamError
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette
from starlette.routing import Route

from coordinator.engine.delegation import Delegator
from coordinator.engine.dispatch import ActivityClock, RunScope, settle_pending
from coordinator.engine.graph import build_graph, checkpoint_pool
from coordinator.engine.memory_hook import RunMemory
from coordinator.engine.workflows import load_workflows
from coordinator.record import gates, work
from coordinator.record.checkpoints import CompactCheckpointer
from coordinator.record.operations import Ledger
from coordinator.record.runs import (
    ON_THE_WAIT,
    CancelRequested,
    Lease,
    PostgresRunStore,
    Run,
    RunNotFound,
    RunState,
    StaleLease,
)
from fleet import pgpool, telemetry, transport
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.natsconn import connect, service_credentials
from fleet.outbound import guarded_client
from fleet.retry import backoff_s
from fleet.service import Readiness, configure_logging, serve_app, start_in_background
from fleet.settings import ServiceSettings
from fleet.vocabulary import EventType
from policy import PolicyEngine, PolicyError
from policy.live import enforcing, live_policy
from registry import RegistryClient

log = logging.getLogger(__name__)

T = TypeVar("T")

# Events whose commit may return before the WAL flush: a specialist's progress chatter, and the step
# markers around an operation, whose durable records are the operation's own events (the intent is
# durable before anything is sent, the result before the run goes on; a durable commit also flushes
# every earlier one). A crash of Postgres itself can lose the last of these, never a transition, an
# operation or a gap.
RELAXED_EVENTS = frozenset({EventType.STEP_PROGRESS, EventType.STEP_STARTED, EventType.STEP_COMPLETED})
FETCH_RETRY_S = 0.5  # after a failed pull (the broker failing over), before the next
INFRA_RETRY_S = 1.0  # a run that hit infrastructure trouble is tried again after this, doubling
# A run whose work message comes back this often and still finds the control plane unavailable
# fails (with the delay between deliveries backing off to the lease's: about ten minutes at the default
# 15 s lease).
MAX_UNAVAILABLE_DELIVERIES = 40
DEFAULT_MAX_IN_FLIGHT = 4  # a tenant's runs advanced at once when policy names no cap
DEFAULT_SHARED_IN_FLIGHT = 2  # ... while another tenant has work, when policy names no share


def _deliveries(message: Msg) -> int:
    try:
        return int(message.metadata.num_delivered or 1)
    except (AttributeError, ValueError, TypeError):  # not a JetStream message
        return 1


class WorkerSettings(ServiceSettings):
    lease_ttl_s: float = 15.0
    ack_wait_s: float = 30.0
    concurrency: int = 4
    sweep_interval_s: float = 30.0
    stranded_after_s: float = 120.0


async def sweep_stranded(
    store: PostgresRunStore, client: NATS, settings: WorkerSettings, ready: asyncio.Event
) -> None:
    """Re-submit unfinished runs that nobody holds and that have not moved for a while, so that a
    lost work message never loses a run. A run that is merely queued gets a second message, which
    the terminal and lease checks make harmless."""
    await ready.wait()
    while True:
        await asyncio.sleep(settings.sweep_interval_s)
        try:
            for run_id, last_seq in await store.stranded_runs(settings.stranded_after_s):
                log.warning("re-submitting stranded run %s", run_id)
                await work.submit_run(client, run_id, attempt=f"sweep-{last_seq}")
        except Exception:  # the next sweep tries again
            log.warning("sweep for stranded runs failed", exc_info=True)


async def supervise_waits(
    store: PostgresRunStore, client: NATS, settings: WorkerSettings, ready: asyncio.Event
) -> None:
    """The supervisor of waits: warn once when a wait's deadline is near, and when it has passed,
    answer the wait with ``expired`` and hand the run back to the workers (its graph then does
    what policy says: end the run as ``approval_expired``, or close it with the best result so
    far). An expiry is never recorded as a denial. Every worker runs this; the store serialises
    them (one warning, one expiry)."""
    await ready.wait()
    while True:
        await asyncio.sleep(settings.sweep_interval_s)
        try:
            for run in await store.waits_due():
                wait = run.wait or {}
                if wait.get("deadline") and dt.datetime.fromisoformat(wait["deadline"]) <= dt.datetime.now(
                    dt.UTC
                ):
                    with contextlib.suppress(FleetError):  # answered or expired by someone else first
                        seq = await store.answer_wait(
                            run.run_id,
                            run.tenant,
                            str(wait.get("type")),
                            {"decision": "expired", "deadline": wait["deadline"]},
                            SUPERVISOR,
                            **_expiry_event(wait),
                            # The wait it read, and only if still due: another answer or an
                            # extension may have come in since the read.
                            awaited=wait.get("awaited"),
                            only_if_due=True,
                        )
                        await work.submit_run(client, run.run_id, f"expired-{seq}", run.tenant)
                else:
                    await store.warn_wait(run.run_id, SUPERVISOR)
        except Exception:  # the next sweep tries again
            log.warning("sweep of waits failed", exc_info=True)


SUPERVISOR = "supervisor"


class _Expiry(TypedDict):
    event: EventType
    text: str


def _expiry_event(wait: dict[str, Any]) -> _Expiry:
    """How the supervisor records a wait it answers at its deadline: a timer fires; anything else
    expires (never a denial)."""
    if wait.get("type") == "timer":
        return {"event": EventType.TIMER_DUE, "text": f"{wait.get('awaited')} is due ({wait['deadline']})"}
    if (wait.get("detail") or {}).get("on_expired") == "escalate":
        return {
            "event": EventType.APPROVAL_ESCALATED,
            "text": f"nobody answered {wait.get('awaited')} by {wait['deadline']}: escalated",
        }
    if wait.get("type") == "batch":
        return {
            "event": EventType.BATCH_DUE,
            "text": f"the batch window of {wait.get('awaited')} closed ({wait['deadline']})",
        }
    if wait.get("type") == "event":
        return {
            "event": EventType.WAIT_EXPIRED,
            "text": f"no event came for {wait.get('awaited')} by {wait['deadline']}",
        }
    return {
        "event": EventType.WAIT_EXPIRED,
        "text": f"nobody answered {wait.get('awaited')} by {wait['deadline']}",
    }


def slice_trace(
    sent: Mapping[str, str] | None, origin: Any
) -> tuple[Mapping[str, str] | None, Mapping[str, str] | None]:
    """The parent and the link of a worker's run slice: the span that submitted this work
    (``sent``, from the work message) is the parent, so a run's first slice continues the trace
    of the coordinator request that created it. A later slice (resumed after a pause, by an answer
    or a sweep) is a child of what re-submitted it (a follow-up request's span, or nothing: a new
    root) with a link to the run's first request (``origin``, kept in the run's record): a run that
    waits days for a person would otherwise be one days-long trace."""
    parent = sent or None
    if not isinstance(origin, dict) or not origin.get("traceparent"):
        return parent, None
    if parent is not None and parent.get("traceparent") == origin["traceparent"]:
        return parent, None  # the first slice, or its redelivery: already in that trace
    return parent, {k: str(v) for k, v in origin.items()}


def failure_error(failure: dict[str, Any]) -> FleetError:
    """The error a run that ``failure`` (a failed step, as the graph keeps it) ended is failed with."""
    message = f"step {failure['step']} ({failure['skill']}) failed: {failure['message']}"
    return FleetError.from_dict({"code": failure["code"], "message": message, "cause": failure.get("cause")})


def ended_by(error: FleetError, **payload: Any) -> dict[str, Any]:
    """The payload of a run's last transition when ``error`` ended it: the text a person reads
    (the message, never the code) and the error as data."""
    return {**payload, "text": error.message, "error": error.to_dict()}


class RunWorker:
    """Advances runs: one message, one run, under the run's lease."""

    def __init__(
        self,
        graph: CompiledStateGraph[Any, Any, Any, Any],
        store: PostgresRunStore,
        ledger: Ledger,
        delegator: Delegator,
        engine: PolicyEngine,
        worker_id: str,
        lease_ttl_s: float,
        memory: RunMemory | None = None,
    ) -> None:
        self._memory = memory
        self._delegator = delegator
        self._engine = engine
        self._graph = graph
        self._store = store
        self._ledger = ledger
        self._id = worker_id
        self._ttl = lease_ttl_s
        self.approvals: JetStreamContext | None = None  # where approval requests go, once connected

    async def consume(self, queues: work.TenantQueues, ready: asyncio.Event) -> None:
        """Take messages one at a time, the tenants in turn, until cancelled."""
        await ready.wait()
        failed = 0  # pulls failed in a row
        while True:
            try:
                message = await queues.next()
                failed = 0
            except (NatsError, JetStreamError) as exc:
                # The connection is moving to another node of the cluster: keep pulling once it has.
                failed += 1
                log.warning("could not pull work (%s); trying again", type(exc).__name__)
                await asyncio.sleep(backoff_s(failed, base_s=FETCH_RETRY_S, cap_s=5.0))
                continue
            if message is not None:
                try:
                    await self.handle(message)
                except Exception:  # infrastructure trouble: keep consuming, let the run be retried
                    log.exception("could not advance the run of message %r; retrying later", message.data)
                    # Soon at first (a database restarting, a node of the bus moving), backing off to
                    # the lease's life: a lease this worker could not release is waited out anyway.
                    delay = backoff_s(_deliveries(message), base_s=INFRA_RETRY_S, cap_s=self._ttl)
                    with contextlib.suppress(Exception):
                        await message.nak(delay=delay)

    async def handle(self, message: Msg) -> None:
        run_id = message.data.decode()
        try:
            run = await self._store.get_run_for_worker(run_id)
        except RunNotFound:
            log.warning("work for unknown run %s dropped", run_id)
            await message.ack()
            return
        if run.state.terminal:
            await self.prune(run_id)
            if run.state == RunState.COMPLETED:  # in case the worker that finished it died first
                await self.consolidate(run.tenant, run_id, message)
            await message.ack()
            return
        if run.state == RunState.WAITING:
            # Parked for a person: nothing to do until an answer re-submits it. Its approval
            # requests are published again (the stream drops a repeat), in case the worker that
            # parked it died before it could.
            await self.announce(run.run_id, run.tenant, run.wait or {})
            await message.ack()
            return
        lease = await self._store.acquire_lease(run_id, self._id, self._ttl)
        if lease is None:
            # Another worker holds a live lease: look again once it could have expired.
            await message.nak(delay=self._ttl)
            return
        telemetry.record_queue_lag(work.submitted_at(message), time.time())
        try:
            async with self._heartbeat(lease, message) as signals:
                await self.advance(run, lease, signals, sent=work.trace_context(message))
        except StaleLease:
            log.warning("lost the lease on run %s; leaving it to its new owner", run_id)
            return
        except DependencyUnavailable as exc:
            # The control plane has not answered for this run's last deliveries: not a failover
            # any more but an outage or a misconfiguration, which a person must see (the run ends
            # in the Errors lane with the reason) rather than a run retried forever.
            if _deliveries(message) < MAX_UNAVAILABLE_DELIVERIES:
                raise
            await self._store.transition(lease, RunState.FAILED, self._id, ended_by(exc), reason=exc.code)
        finally:
            await self._store.release_lease(lease)
        await self.prune(run_id)
        ended = await self._store.get_run_for_worker(run_id)
        if ended.state == RunState.COMPLETED:
            await self.consolidate(ended.tenant, run_id, message)
        await message.ack()

    async def consolidate(self, tenant: str, run_id: str, message: Msg) -> None:
        """Turn the finished run's episodes into facts and rules, through the memory gate (see
        :mod:`coordinator.engine.memory_hook`; it never fails the run). The work message is kept from
        redelivery meanwhile, however long the memory server (and its model) takes."""
        if self._memory is None:
            return

        async def keep_message() -> None:
            while True:
                await asyncio.sleep(max(1.0, self._ttl / 3))
                with contextlib.suppress(Exception):
                    await message.in_progress()

        keeper = asyncio.create_task(keep_message())
        try:
            await self._memory.consolidate(tenant, run_id)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    @contextlib.asynccontextmanager
    async def _heartbeat(self, lease: Lease, message: Msg) -> AsyncIterator[RunSignals]:
        """Keep the lease and the message alive while the run advances. The signals it yields say
        when a cancel request was seen or the lease was lost (the run must then stop at once)."""
        signals = RunSignals()

        async def beat() -> None:
            while True:
                await asyncio.sleep(self._ttl / 3)
                try:
                    if await self._store.renew_lease(lease, self._ttl):
                        signals.cancel.set()
                    await message.in_progress()
                except StaleLease:
                    signals.lost.set()
                    return
                except Exception:  # a transient failure: the next beat tries again
                    log.warning("heartbeat for run %s failed", lease.run_id, exc_info=True)

        task = asyncio.create_task(beat(), name=f"heartbeat-{lease.run_id}")
        try:
            yield signals
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def advance(
        self,
        run: Run,
        lease: Lease,
        signals: RunSignals | None = None,
        sent: Mapping[str, str] | None = None,
    ) -> None:
        """Run or resume the run's graph to its end and record the outcome; stop at a cancel request
        (seen at the next event the run writes, or by the heartbeat).

        ``sent``: the trace context of the work message (see :func:`slice_trace`)."""
        parent, linked = slice_trace(sent, run.request.get(work.TRACE_KEY))
        span = telemetry.invoke_agent_span(
            "coordinator",
            kind=SpanKind.INTERNAL,
            agent_id=self._id,
            run_id=run.run_id,
            tenant=run.tenant,
            parent=parent,
            linked=linked,
        )
        with span:
            await self._advance_or_cancel(run, lease, signals)

    async def _advance_or_cancel(self, run: Run, lease: Lease, signals: RunSignals | None) -> None:
        try:
            if run.cancel_requested:
                raise CancelRequested(run.run_id)
            await self._advance(run, lease, signals or RunSignals())
        except CancelRequested:
            await settle_pending(self._delegator, RunScope(self._ledger, lease, self._id), run.tenant)
            await self._store.transition(
                lease, RunState.CANCELED, self._id, {"text": "canceled on request"}, reason="canceled"
            )

    async def _advance(self, run: Run, lease: Lease, signals: RunSignals) -> None:
        config: RunnableConfig = {"configurable": {"thread_id": run.run_id}}
        snapshot = await self._graph.aget_state(config)
        graph_input: dict[str, Any] | Command[Any] | None = None
        if snapshot.interrupts:
            # Someone answered what the run waited for: resume every pending interrupt by its id
            # (parallel steps may each wait), each with the answer recorded for what it awaits
            # (a decision), or none (an operation's outcome, which the node reads from the ledger).
            # A node whose wait is still unanswered asks again.
            graph_input = Command(
                resume={i.id: _answer_for(i.value, run.answers, self._id) for i in snapshot.interrupts}
            )
            await self._store.append(lease, EventType.RUN_RESUMED, self._id, {"at": list(snapshot.next)})
        elif snapshot.next:
            # resume from the checkpoint: finished nodes are not redone
            await self._store.append(lease, EventType.RUN_RESUMED, self._id, {"at": list(snapshot.next)})
        elif snapshot.values and not snapshot.values.get("finished"):
            # A checkpoint whose fan-out was lost (its pending sends are saved after it, in the
            # background, and the worker died in between): schedule again from what is done. The
            # state's reducers keep the results; the ledger keeps every effect once.
            graph_input = {"run_id": run.run_id}
            await self._store.append(lease, EventType.RUN_RESUMED, self._id, {"at": ["schedule"]})
        elif not snapshot.values:
            try:
                limits = await run_limits(self._engine, run.tenant)
            except PolicyError as exc:  # fail closed, with the reason, rather than retry forever
                await self._store.transition(lease, RunState.FAILED, self._id, ended_by(exc), reason=exc.code)
                return
            graph_input = _initial_state(run, limits)
            if run.state != RunState.SUBMITTED:
                # Taken over before the first checkpoint was saved (LangGraph saves them in the
                # background while the next node runs): start over; the ledger keeps effects once.
                await self._store.append(lease, EventType.RUN_RESUMED, self._id, {"at": ["start"]})
        if run.state == RunState.SUBMITTED:
            await self._store.transition(lease, RunState.WORKING, self._id, {})
        started = graph_input.get("limits") if isinstance(graph_input, dict) else None
        scope = RunScope(
            self._ledger,
            lease,
            self._id,
            ActivityClock.of(started or snapshot.values.get("limits")),
            runs=self._store,
        )
        try:
            if snapshot.values.get("finished") and not snapshot.next:
                final = dict(snapshot.values)  # the graph finished before the outcome was recorded
            else:
                streamed = self._stream(graph_input, config, lease, scope)
                parked = await _unless(signals, streamed, run.run_id)
                if parked.interrupts:
                    await self._park(lease, run.tenant, [i.value for i in parked.interrupts])
                    return
                final = dict(parked.values)
        except (StaleLease, CancelRequested, psycopg.OperationalError, DependencyUnavailable):
            # Not the run's fault: lease lost, canceled, the database or the control plane (registry,
            # token service) unreachable for now. The message goes back to the queue; the run
            # resumes from its checkpoint, on whichever worker takes it.
            raise
        except Exception:
            log.exception("run %s crashed", run.run_id)
            await self._store.transition(
                lease,
                RunState.FAILED,
                self._id,
                ended_by(FleetError(ErrorCode.INTERNAL, "the run crashed")),
                reason=ErrorCode.INTERNAL,
            )
            return
        await self._record_outcome(final, lease)

    async def prune(self, run_id: str) -> None:
        """Keep only the latest checkpoint of a finished or parked run: storage stays bounded, the
        state stays readable (and resumable), and the event log keeps the history an audit needs.
        Called before the work message is acked, so a crash in between leads to a redelivery that
        prunes again (it is idempotent). A run that crashed keeps every checkpoint, for its debug
        bundle."""
        checkpointer = self._graph.checkpointer
        if not isinstance(checkpointer, CompactCheckpointer):
            return
        run = await self._store.get_run_for_worker(run_id)
        if run.reason == ErrorCode.INTERNAL:
            return
        try:
            await checkpointer.aprune([run_id], strategy="keep_latest")
        except Exception:  # pruning is housekeeping: never fail a finished run over it
            log.warning("could not prune the checkpoints of run %s", run_id, exc_info=True)

    async def _park(self, lease: Lease, tenant: str, awaiting: list[Any]) -> None:
        """Record that the run waits (what for, since when) and let go of it: no process waits.
        The wait record names the first thing awaited (what, until when) and its ``detail`` holds
        the rest of that request, with ``others`` when parallel steps wait too (see
        :func:`coordinator.record.runs.wait_requests`)."""
        requests = [
            dict(a) if isinstance(a, dict) else {"type": "input", "awaited": str(a)} for a in awaiting
        ]
        request = requests[0]
        detail = {k: v for k, v in request.items() if k not in ON_THE_WAIT}
        if len(requests) > 1:
            detail["others"] = requests[1:]
        wait = {
            "type": request.get("type", "input"),
            "awaited": request.get("awaited"),
            "since": dt.datetime.now(dt.UTC).isoformat(),
            "deadline": request.get("deadline"),
            "warn_at": request.get("warn_at"),
            "detail": detail,
        }
        text = f"waiting for a person: {request.get('why', wait['type'])}"
        await self._store.transition(lease, RunState.WAITING, self._id, {"text": text}, wait=wait)
        await self.announce(lease.run_id, tenant, wait)
        # A parked run resumes from its latest checkpoint (the pending interrupt is written there):
        # the older ones are dropped, so a run that waits for weeks costs only what it needs.
        await self.prune(lease.run_id)

    async def announce(self, run_id: str, tenant: str, wait: dict[str, Any]) -> None:
        """Publish the approval requests of a parked run on NATS (see :mod:`coordinator.control.signals`).
        Best effort: the wait is durable already, and a redelivered work message publishes again."""
        if self.approvals is None:
            return
        try:
            await gates.announce(self.approvals, run_id, tenant, wait)
        except Exception:
            log.warning("could not publish the approval requests of run %s", run_id, exc_info=True)

    async def _stream(
        self,
        graph_input: dict[str, Any] | Command[Any] | None,
        config: RunnableConfig,
        lease: Lease,
        scope: RunScope,
    ) -> StateSnapshot:
        # subgraphs: a workflow's graph runs inside a step (coordinator.engine.workflows); its steps
        # report through the same stream, from its namespace
        stream = self._graph.astream(
            graph_input, config, stream_mode="custom", version="v2", context=scope, subgraphs=True
        )
        # An async generator at run time (typed as an iterator): stopping early must stop the graph.
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for part in stream:
                if part["type"] != "custom":
                    continue
                report = part["data"]
                payload = {**report["payload"], **({"text": report["text"]} if report["text"] else {})}
                durable = report["event"] not in RELAXED_EVENTS
                await self._store.append(lease, report["event"], self._id, payload, durable=durable)
        return await self._graph.aget_state(config)

    async def _record_outcome(self, final: dict[str, Any], lease: Lease) -> None:
        failure = final.get("failure")
        if failure:
            payload = ended_by(failure_error(failure), failure=failure)
            # A person said no: the run is rejected (an expiry, nobody saying anything, is a failure).
            ended = RunState.REJECTED if failure["code"] == ErrorCode.APPROVAL_REJECTED else RunState.FAILED
            await self._store.transition(lease, ended, self._id, payload, reason=failure["code"])
            return
        results = final.get("results", {})
        done_by = {o["step"]: o["agent"] for o in final.get("outcomes", []) if o.get("status") == "completed"}
        summary = "; ".join(f"{step} by {agent}" for step, agent in done_by.items())
        text = f"completed {len(results)} steps: {summary}"
        stop = final.get("stop")
        if stop:  # graceful degradation: the best result so far, and what was not done and why
            skipped = [s["id"] for s in final.get("steps", []) if s["id"] not in results]
            text = f"stopped early ({stop['reason']}: {stop['why']}); {text}; not run: {', '.join(skipped)}"
        await self._store.append(
            lease, EventType.ARTIFACT, self._id, {"name": "result", "text": text, "steps": results}
        )
        reason = stop["reason"] if stop else None
        if stop and reason == ErrorCode.APPROVAL_EXPIRED:  # nobody decided in time: not a denial
            payload = ended_by(FleetError(ErrorCode.APPROVAL_EXPIRED, str(stop["why"])), summary=summary)
            await self._store.transition(lease, RunState.FAILED, self._id, payload, reason=reason)
            return
        await self._store.transition(lease, RunState.COMPLETED, self._id, {"summary": summary}, reason=reason)


@dataclass(frozen=True, slots=True)
class RunSignals:
    """Set by the heartbeat: a cancel was requested, or the lease was lost."""

    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    lost: asyncio.Event = field(default_factory=asyncio.Event)


async def _unless(signals: RunSignals, work: Awaitable[T], run_id: str) -> T:
    """Await ``work`` unless a signal comes first; then stop it and raise what the signal means."""
    job = asyncio.ensure_future(work)
    watchers = [asyncio.create_task(signals.cancel.wait()), asyncio.create_task(signals.lost.wait())]
    try:
        await asyncio.wait({job, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we are being cancelled ourselves (shutdown): stop everything, re-raise
        for task in (job, *watchers):
            task.cancel()
        await asyncio.gather(job, *watchers, return_exceptions=True)
        raise
    for watcher in watchers:
        watcher.cancel()
    if not job.done():
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        if signals.lost.is_set():
            raise StaleLease(run_id)
        raise CancelRequested(run_id)
    return job.result()


def _answer_for(awaiting: Any, answers: dict[str, Any], actor: str) -> dict[str, Any]:
    awaited = awaiting.get("awaited") if isinstance(awaiting, dict) else None
    answer = answers.get(str(awaited)) if awaited is not None else None
    return dict(answer) if isinstance(answer, dict) else {"resumed_by": actor}


def _initial_state(run: Run, limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "tenant": run.tenant,
        "steps": run.plan,
        "results": {},
        "failure": None,
        "limits": limits,
        "tranche": {"number": 0, "steps": 0, "operations": 0, "started_at": run.created_at.isoformat()},
        "stop": None,
    }


async def max_in_flight(engine: PolicyEngine, tenant: str) -> work.InFlight:
    """How many of ``tenant``'s runs the fleet advances at once (``fleet.limits.fair.work``:
    ``max_in_flight`` alone, ``shared_in_flight`` while another tenant has work); a policy that
    cannot answer keeps the defaults."""
    defaults = work.InFlight(DEFAULT_MAX_IN_FLIGHT, DEFAULT_SHARED_IN_FLIGHT)
    try:
        decision = await engine.decide("fleet.limits.fair.work", {"tenant": tenant})
    except PolicyError as exc:  # a pull must go on: the tenant keeps the defaults meanwhile
        log.warning("fleet.limits.fair.work for %s: %s", tenant, exc)
        return defaults
    result = decision.result if decision.allow and isinstance(decision.result, dict) else {}
    found = [result.get("max_in_flight"), result.get("shared_in_flight", result.get("max_in_flight"))]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in found):
        log.warning(
            "fleet.limits.fair.work gave no valid caps for %s (%s); %s it is", tenant, found, defaults
        )
        return defaults
    return work.InFlight(int(found[0]), int(found[1]))  # type: ignore[arg-type]


async def run_limits(engine: PolicyEngine, tenant: str) -> dict[str, Any]:
    """The run's budget and convergence limits and the deadlines of its approvals, decided by
    policy when the run starts; a policy
    that cannot be evaluated or is invalid fails the start (closed, with a clear reason)."""
    decision = await engine.decide("fleet.budgets.decision", {"tenant": tenant})
    if not decision.allow:
        raise PolicyError(f"the budget policy is invalid: {'; '.join(decision.reasons)}")
    approvals = await engine.decide("fleet.approvals.deadlines", {"tenant": tenant})
    if not approvals.allow:
        raise PolicyError(f"the approvals policy is invalid: {'; '.join(approvals.reasons)}")
    return {
        **{key: decision.result[key] for key in ("limits", "convergence", "batch", "loop", "models")},
        "approvals": {key: approvals.result[key] for key in ("default", "skills")},
        "decisions": {"budgets": decision.decision_id, "approvals": approvals.decision_id},
    }


def build_worker_app(settings: WorkerSettings) -> Starlette:
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), event_hooks=transport.hooks())
    registry = RegistryClient(settings, http)
    pool_for_checkpoints = checkpoint_pool(settings.pg_dsn, max_size=settings.concurrency + 2)
    run_pool = pgpool.pool(settings.pg_dsn, max_size=settings.concurrency + 2, kwargs={"autocommit": True})
    saver = CompactCheckpointer(pool_for_checkpoints)
    store = PostgresRunStore(run_pool)
    ledger = Ledger(run_pool)
    engine = live_policy(settings)
    outbound = guarded_client(
        "token_endpoint", engine, local=settings.local_stack, event_hooks=transport.hooks()
    )
    delegator = Delegator(registry, http, store.run_grant, engine, outbound)
    memory = RunMemory(registry)
    worker = RunWorker(
        build_graph(delegator, saver, load_workflows(settings.workflows)),
        store,
        ledger,
        delegator,
        engine,
        # Unique per process, wherever it runs: the pods of one worker Deployment share the service
        # id, and in a container every worker may be pid 1.
        worker_id=f"{settings.service_id}:{os.getpid()}:{secrets.token_hex(4)}",
        lease_ttl_s=settings.lease_ttl_s,
        memory=memory,
    )
    readiness = Readiness(settings.service_id, "worker")
    enrolled = asyncio.Event()

    async def start() -> None:
        await registry.join_as_worker()
        enrolled.set()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            await stack.enter_async_context(outbound)
            stack.push_async_callback(registry.aclose)
            stack.push_async_callback(memory.aclose)
            await stack.enter_async_context(pool_for_checkpoints)
            await stack.enter_async_context(run_pool)
            await saver.setup()
            await store.setup()
            await ledger.setup()
            await registry.ready_for_bus()
            nc = await connect(
                settings.nats_url,
                settings.service_id,
                replicas=settings.nats_replicas,
                credentials=service_credentials(settings),
            )
            stack.push_async_callback(nc.drain)
            await stack.enter_async_context(enforcing(engine, nc))
            worker.approvals = nc.jetstream()
            # Pull subscriptions of their own per consumer task: they must not share an inbox.
            cap = functools.partial(max_in_flight, engine)
            bell = work.WorkBell()  # idle consumer tasks wake when work is submitted
            await bell.follow(nc)
            shares = work.WorkShares()  # the tenants with work, as all of this process's pulls see them
            queues = [
                work.TenantQueues(nc, settings.ack_wait_s, cap, bell, shares=shares)
                for _ in range(settings.concurrency)
            ]
            await work.subscribe(nc, settings.ack_wait_s)  # the untenanted consumer, before work comes
            consumers = [
                asyncio.create_task(worker.consume(queue, enrolled), name=f"consumer-{i}")
                for i, queue in enumerate(queues)
            ]
            consumers.append(
                asyncio.create_task(sweep_stranded(store, nc, settings, enrolled), name="sweeper")
            )
            consumers.append(
                asyncio.create_task(supervise_waits(store, nc, settings, enrolled), name="wait-supervisor")
            )

            async def stop_consumers() -> None:
                # Runs in flight stop here; their messages are redelivered and resumed elsewhere.
                for task in consumers:
                    task.cancel()
                await asyncio.gather(*consumers, return_exceptions=True)
                for queue in queues:
                    await queue.close()

            stack.push_async_callback(stop_consumers)
            await stack.enter_async_context(start_in_background(readiness, start))
            yield

    return Starlette(routes=[Route("/healthz", readiness.endpoint)], lifespan=lifespan)


async def main(settings: ServiceSettings) -> None:
    worker_settings = WorkerSettings.from_env(settings.service_id)
    configure_logging(worker_settings.service_id, worker_settings.log_level)
    await serve_app(build_worker_app(worker_settings), worker_settings)
