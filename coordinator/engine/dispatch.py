"""Delegating a step as a ledgered operation: intent, dispatch, result; and, for an operation that a
crashed worker left pending, reconciliation with the agent before anything is sent again.

The rules, in order of precedence:

- an operation whose outcome is recorded is never sent again (a replay returns the recorded result);
- a pending operation is first asked about (by its id, with the agent that received it);
- it is sent again only when the agent says it never received it, or that it was interrupted (the
  agent then runs it again only if its skill is declared safe to repeat, and says ``uncertain`` if not);
- an outcome nobody can establish makes the operation ``needs_human``, and the run waits for a person.

While a call is in flight, an activity lease runs beside it: every event the agent sends renews it
(kit specialists send a heartbeat while a skill works). When it expires, the call is not killed; a
supervisor wakes and asks the agent about the operation. ``running``: the lease is renewed, and after
``max_renewals`` renewals the supervisor does what policy says (``escalate``: record a
``run.escalated`` event and keep waiting; ``ask``: a person decides, and the run waits without a
process). Anything else (finished, never received, unreachable): the call is abandoned and the
operation reconciled as after a crash.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from langgraph.config import get_stream_writer

from coordinator.engine import spending
from coordinator.engine.delegation import (
    CallInterrupted,
    Delegator,
    Progress,
    TaskLimits,
    skill_is_idempotent,
)
from coordinator.record.operations import Event, Ledger, Operation, OperationConflict, OpStatus
from coordinator.record.runs import Lease, PostgresRunStore
from fleet import telemetry
from fleet.crashpoints import crash_point
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.operation_ext import MAX_WAIT_S, args_hash
from fleet.vocabulary import EventType, StepCompleted, StepStarted
from registry import AgentRecord

log = logging.getLogger(__name__)

RECONCILE_ATTEMPTS = 5  # tries to reach (or find) an agent that is down before a person is asked
RECONCILE_BACKOFF_S = 2.0
MAX_REDISPATCHES = 3  # sends of one operation in one attempt before a person is asked
MAX_RUNNING_WAIT_S = 3600.0  # an agent "still running" it for longer: a person is asked
MAX_REROUTES = 2  # moves of one operation to another agent offering its skill


@dataclass(frozen=True, slots=True)
class ActivityClock:
    """The activity lease of a call in flight (``activity`` in the budget policy)."""

    quiet_after_s: float = 120.0  # no event from the agent for this long: the supervisor wakes
    max_renewals: int = 30  # renewals (the agent says it is still running) before ``on_stuck``
    on_stuck: str = "escalate"  # or "ask": a person decides

    @classmethod
    def of(cls, limits: dict[str, Any] | None) -> ActivityClock:
        found = ((limits or {}).get("limits") or {}).get("activity") or {}
        return cls(
            quiet_after_s=float(found.get("quiet_after_s", 120.0)),
            max_renewals=int(found.get("max_renewals", 30)),
            on_stuck=str(found.get("on_stuck", "escalate")),
        )


@dataclass(frozen=True, slots=True)
class RunScope:
    """What the graph's nodes need from the worker advancing the run (never checkpointed)."""

    ledger: Ledger
    lease: Lease
    actor: str
    activity: ActivityClock = ActivityClock()
    runs: PostgresRunStore | None = None  # for what a node reads of its run (a batch's items)


class NeedsHuman(FleetError):
    """An operation's outcome cannot be established: a person has to say what happened."""

    def __init__(self, op_id: str, why: str) -> None:
        super().__init__(ErrorCode.NEEDS_HUMAN, f"operation {op_id}: {why}")
        self.op_id = op_id
        self.why = why


def _emit(event: EventType, payload: Mapping[str, Any], text: str) -> None:
    """Record an event in the run's log (through the graph's stream, like every step event)."""
    get_stream_writer()({"event": event, "payload": payload, "text": text})


def _announce(events: list[Event]) -> None:
    """Log events of a replayed step through the graph's stream (a fresh step logs them with its
    ledger entries instead)."""
    for type_, payload in events:
        _emit(type_, {k: v for k, v in payload.items() if k != "text"}, str(payload.get("text", "")))


def _departed(agent_id: str) -> AgentRecord:
    """A stand-in for an agent that left the registry after its operation was settled."""
    return AgentRecord(
        id=agent_id,
        kind="specialist",
        card_url="",
        url="",
        version="",
        skills=[],
        card={},
        registered_at=0.0,
        status="departed",
    )


class StepDispatcher:
    """Runs one step of one run through the ledger."""

    def __init__(
        self,
        delegator: Delegator,
        scope: RunScope,
        *,
        step_id: str,
        skill: str,
        payload: dict[str, Any],
        tenant: str,
        progress: Progress,
        announce: bool = False,
        completes: Callable[[dict[str, Any]], bool] | None = None,
        named: str | None = None,
        limits: Callable[[AgentRecord], TaskLimits] | None = None,
        models: Mapping[str, Any] | None = None,
        resume_from: str = "",
    ) -> None:
        """``announce``: log the step's ``step.started`` (with where it went) and ``step.completed``
        (a plain step; a batch's calls are announced by the batch). ``completes``: whether a result
        completes the step (one that asks a person first does not: no ``step.completed`` yet).
        ``named``: the agent the plan names for the step (see :meth:`Delegator.assign`).
        ``limits``: what a task sent to an agent may spend, and what its loop does at a limit;
        ``models``: the prices what it spent is counted at (``fleet_agent_*`` metrics);
        ``resume_from``: the operation of the step's call that asked a person (a gate), whose
        progress notes this call goes on from, when its agent wrote them."""
        self._delegator = delegator
        self._ledger = scope.ledger
        self._lease = scope.lease
        self._actor = scope.actor
        self._step_id = step_id
        self._skill = skill
        self._payload = payload
        self._tenant = tenant
        self._progress = progress
        self._activity = scope.activity
        self._announce = announce
        self._completes = completes
        self._named_agent = named
        self._limits = limits
        self._models = models or {}
        self._resume_from = resume_from
        # What the agent said the operation spent (fleet.usage), once it said, as it said it.
        self.usage: dict[str, Any] | None = None
        self._resend = False  # whether the operation is being sent again (after a crash, or moved)
        self._redispatches = 0
        self._tried: set[str] = set()  # agents this operation went to, in this attempt
        self._known: Operation | None = None
        self._agent: AgentRecord | None = None
        # When the operation's outcome was recorded (as the ledger says, for a replay): a stable
        # time for what follows from it, such as the deadline of an approval it asks for.
        self.settled_at: dt.datetime | None = None
        self.op_id = ""  # the operation's id, once recorded

    @property
    def agent(self) -> AgentRecord | None:
        """The agent the step went to, once known."""
        return self._agent

    @property
    def _args(self) -> dict[str, Any]:
        """What the ledger records of the call, and binds its id to: the input without an approval
        grant (a credential, not kept at rest; a replay may carry a fresh one for the same call)."""
        approval = self._payload.get("approval")
        if isinstance(approval, dict) and "grant" in approval:
            without = {k: v for k, v in approval.items() if k != "grant"}
            return {"skill": self._skill, "input": {**self._payload, "approval": without}}
        return {"skill": self._skill, "input": self._payload}

    @property
    def agent_id(self) -> str:
        """The agent the step went to, once known ("" before)."""
        return self._agent.id if self._agent is not None else ""

    def _opening(self, agent: AgentRecord) -> list[Event]:
        if not self._announce:
            return []
        # (its text, "step <id>: <skill> -> <agent>", is made where it is shown: task_events)
        return [(EventType.STEP_STARTED, StepStarted(step=self._step_id, skill=self._skill, agent=agent.id))]

    def _closing(self, result: dict[str, Any]) -> list[Event]:
        if not self._announce or (self._completes is not None and not self._completes(result)):
            return []
        return [(EventType.STEP_COMPLETED, StepCompleted(step=self._step_id, agent=self.agent_id))]

    async def run(self, prefer: AgentRecord | None = None) -> dict[str, Any]:
        """The step's result, sending it at most as often as the rules above allow: to ``prefer``
        or an agent chosen by skill if it was never sent, else to the agent that got it (a replay
        must reconcile with that one, whatever routing would pick today). A plain step's start
        and completion are logged with its intent and its result (one statement each)."""
        op, self._known = self._known, None  # read once: after a wait for a person, read it again
        if op is None:
            agent = prefer or await self._delegator.assign(
                self._skill, tenant=self._tenant, named=self._named_agent
            )
            await self._delegator.prepare(agent, self._tenant, self._lease.run_id)
            crash_point("worker.before_intent", self._skill)
            try:
                op, created = await self._ledger.record_intent(
                    self._lease,
                    self._actor,
                    step_id=self._step_id,
                    kind="delegate",
                    target=agent.id,
                    args=self._args,
                    before=self._opening(agent),
                )
            except OperationConflict as exc:
                conflicting = await self._ledger.get(exc.op_id)
                assert conflicting is not None
                self._agent = await self._named(conflicting)
                await self._needs_human(
                    conflicting, "the step was replayed with other arguments than were sent"
                )
                raise  # not reached: _needs_human raises
            crash_point("worker.after_intent", self._skill)
            self.op_id = op.op_id
            if created:
                self._agent = agent
                return await self._dispatch(op, agent)
        # A replay: the operation was recorded by an earlier attempt.
        self.op_id = op.op_id
        self._agent = await (self._named(op) if op.status != OpStatus.PENDING else self._find(op))
        _announce(self._opening(self._agent))
        if op.args_hash != args_hash(self._args):
            await self._needs_human(op, "the step was replayed with other arguments than were sent")
        self.usage = op.usage
        if op.status == OpStatus.SUCCEEDED:
            result = dict(op.result or {})
            _announce(self._closing(result))
            self.settled_at = op.updated_at
            return result
        if op.status == OpStatus.FAILED:
            raise FleetError.from_dict(op.error or {}, fallback=ErrorCode.SPECIALIST_FAILED)
        if op.status == OpStatus.NEEDS_HUMAN:
            raise NeedsHuman(op.op_id, str((op.error or {}).get("message", "its outcome is unknown")))
        # Pending: a worker died between sending it and recording what came of it. Only the agent
        # that received it can say.
        return await self._reconcile(op, self._agent)

    async def _named(self, op: Operation) -> AgentRecord:
        """The agent that got a settled operation: only named, never called again."""
        try:
            return await self._delegator.agent(op.target)
        except DependencyUnavailable:
            raise  # the registry is away, not the agent: a replay later finds it again
        except FleetError:
            return _departed(op.target)

    async def _find(self, op: Operation) -> AgentRecord:
        """The agent that received ``op``, as the registry knows it; if it cannot be found after a
        few tries (it left the registry, or the registry is down), a person has to say."""
        for attempt in range(RECONCILE_ATTEMPTS + 1):
            try:
                return await self._delegator.agent(op.target)
            except FleetError as exc:
                if attempt == RECONCILE_ATTEMPTS and isinstance(exc, DependencyUnavailable):
                    raise  # the registry is down, not the agent gone: the run is retried later
                if attempt == RECONCILE_ATTEMPTS:
                    await self._needs_human(
                        op, f"{op.target}, which received it, cannot be found: {exc.message}"
                    )
                await asyncio.sleep(RECONCILE_BACKOFF_S * (attempt + 1))
        raise AssertionError("unreachable")

    async def _dispatch(self, op: Operation, agent: AgentRecord) -> dict[str, Any]:
        self._tried.add(agent.id)
        try:
            result = await self._supervised(op, agent)
        except CallInterrupted:
            return await self._reconcile(op, agent)
        except NeedsHuman:
            raise  # recorded as such by the supervisor
        except DependencyUnavailable:
            # The control plane (a token, a registry lookup), not the agent: the operation stays
            # pending, the run goes back to the queue, and its next slice reconciles it first.
            raise
        except FleetError as exc:
            if exc.code == ErrorCode.OUTCOME_UNKNOWN:
                await self._needs_human(op, exc.message)
            other = await self._reroutable(agent, exc)
            if other is not None:
                return await self._reroute(op, agent, other, exc.message)
            await self._record(op, OpStatus.FAILED, error=exc.to_dict())
            raise
        crash_point("worker.before_result", self._skill)
        crash_point("worker.before_result", self._step_id)  # one call of a step (e.g. after a gate)
        await self._record(op, OpStatus.SUCCEEDED, result=result, after=self._closing(result))
        self.settled_at = dt.datetime.now(dt.UTC)
        return result

    async def _supervised(self, op: Operation, agent: AgentRecord) -> dict[str, Any]:
        """The call, under its activity lease (see the module's doc)."""
        clock = self._activity
        loop = asyncio.get_running_loop()
        last = loop.time()

        def touched() -> None:
            nonlocal last
            last = loop.time()

        def spent(said: dict[str, Any]) -> None:
            self.usage = said

        async def noted(notes: dict[str, Any]) -> None:
            if not await self._ledger.record_progress(self._lease.run_id, op.op_id, agent.id, notes):
                log.warning(
                    "operation %s: progress notes from %s not kept (not pending there, or too large)",
                    op.op_id,
                    agent.id,
                )

        async def failed_with(request: dict[str, Any]) -> None:
            await self._ledger.record_last_request(self._lease.run_id, op.op_id, agent.id, request)

        # Sent again to the agent that wrote notes for it: they go back, and its loop goes on from them.
        # After a gate, the call that asked left its notes: the answer goes on from them.
        earlier = op.op_id if self._resend else self._resume_from
        resume = await self._ledger.progress_for(earlier, agent.id) if earlier else None

        call = asyncio.ensure_future(
            self._delegator.call(
                agent,
                self._skill,
                self._payload,
                tenant=self._tenant,
                progress=self._progress,
                operation_id=op.op_id,
                activity=touched,
                run_id=self._lease.run_id,
                step=self._step_id,
                limits=self._limits(agent) if self._limits is not None else None,
                usage=spent,
                notes=noted,
                resume=resume,
                last_request=failed_with,
            )
        )
        renewals = 0
        try:
            while True:
                quiet_for = loop.time() - last
                if quiet_for < clock.quiet_after_s:
                    await asyncio.wait({call}, timeout=clock.quiet_after_s - quiet_for)
                    if call.done():
                        return call.result()
                    continue
                answer = await self._still_running(op, agent, quiet_for)
                if answer is None:
                    raise CallInterrupted(agent.id)  # abandon the call; reconcile
                renewals += 1
                touched()
                _emit(
                    EventType.STEP_RENEWED,
                    {
                        "op_id": op.op_id,
                        "step": self._step_id,
                        "quiet_s": round(quiet_for),
                        "renewals": renewals,
                    },
                    f"{agent.id} quiet for {quiet_for:.0f}s, {answer}: waiting on",
                )
                if renewals == clock.max_renewals:
                    why = f"{agent.id} has been quiet for {quiet_for:.0f}s, {renewals} times over"
                    if clock.on_stuck == "ask":
                        await self._needs_human(op, f"{why}: keep waiting, or resolve it")
                    await self._escalate(op, agent, why)
        finally:
            if not call.done():
                call.cancel()
            await asyncio.gather(call, return_exceptions=True)

    async def _still_running(self, op: Operation, agent: AgentRecord, quiet_for: float) -> str | None:
        """The supervisor's question when an activity lease expires: is the agent still at it?
        Why the call may go on, or None if it should be abandoned and the operation reconciled."""
        try:
            status = await self._delegator.operation_status(agent, op.op_id, tenant=self._tenant, wait_s=0)
        except FleetError as exc:
            log.warning(
                "operation %s: %s quiet for %.0fs and cannot be asked: %s", op.op_id, agent.id, quiet_for, exc
            )
            return None
        if status is None:  # it cannot be asked: keep waiting on the call (transport timeouts bound it)
            return "and cannot be asked about the operation"
        return f"and reports operation {op.op_id} running" if status["status"] == "running" else None

    async def _escalate(self, op: Operation, agent: AgentRecord, why: str) -> None:
        _emit(
            EventType.RUN_ESCALATED,
            {"op_id": op.op_id, "step": self._step_id, "agent": agent.id, "why": why},
            f"escalated: {why}",
        )

    async def _reroutable(self, agent: AgentRecord, exc: FleetError) -> AgentRecord | None:
        """Another agent to send the operation to, if it may move: when the call never reached
        ``agent`` (it cannot have run it), or when ``agent`` answered garbage or cannot be asked
        and its card says a repeat of the skill is safe. ``agent`` is tried last for a while."""
        safe = exc.code == ErrorCode.SPECIALIST_UNAVAILABLE or (
            exc.code in (ErrorCode.BAD_ANSWER, ErrorCode.DEPENDENCY_UNAVAILABLE)
            and skill_is_idempotent(agent, self._skill)
        )
        if not safe or len(self._tried) > MAX_REROUTES:
            if exc.code in (ErrorCode.SPECIALIST_UNAVAILABLE, ErrorCode.BAD_ANSWER):
                self._delegator.suspect(agent.id, exc.message)
            return None
        if exc.code == ErrorCode.SPECIALIST_UNAVAILABLE:
            # Not reached: the agent may have moved since it was discovered (a restart elsewhere).
            # The same agent at its new address comes first; the call never reached the old one.
            moved = await self._delegator.moved(agent)
            if moved is not None:
                return moved
        if exc.code in (ErrorCode.SPECIALIST_UNAVAILABLE, ErrorCode.BAD_ANSWER):
            self._delegator.suspect(agent.id, exc.message)
        others = await self._delegator.alternatives(self._skill, self._tried)
        return others[0] if others else None

    async def _reroute(
        self, op: Operation, agent: AgentRecord, other: AgentRecord, why: str
    ) -> dict[str, Any]:
        """Send the operation, under its id, to ``other`` instead (the ledger records the move)."""
        log.warning("operation %s moves from %s to %s: %s", op.op_id, agent.id, other.id, why)
        await self._ledger.reroute(self._lease, self._actor, op.op_id, other.id, why[:300])
        self._agent = other
        self._resend = True
        await self._progress(f"{agent.id} failed ({why[:200]}): step {self._step_id} goes to {other.id}")
        return await self._dispatch(op, other)

    async def _reconcile(self, op: Operation, agent: AgentRecord) -> dict[str, Any]:
        await self._progress(f"asking {agent.id} what became of operation {op.op_id}")
        unreachable = 0
        deadline = asyncio.get_running_loop().time() + MAX_RUNNING_WAIT_S
        while True:
            try:
                status = await self._delegator.operation_status(
                    agent, op.op_id, tenant=self._tenant, wait_s=MAX_WAIT_S
                )
            except DependencyUnavailable:
                raise  # no token to ask with: not the agent's silence; the run asks again later
            except FleetError as exc:
                if exc.code == ErrorCode.SPECIALIST_UNAVAILABLE and skill_is_idempotent(agent, self._skill):
                    # It cannot be asked, and a repeat is safe: another agent may take it over.
                    gone = FleetError(
                        ErrorCode.DEPENDENCY_UNAVAILABLE, f"{agent.id} went away mid-step: {exc.message}"
                    )
                    other = await self._reroutable(agent, gone)
                    if other is not None:
                        self._delegator.suspect(agent.id, exc.message)
                        return await self._reroute(op, agent, other, gone.message)
                if exc.code != ErrorCode.SPECIALIST_UNAVAILABLE or unreachable >= RECONCILE_ATTEMPTS:
                    await self._needs_human(op, f"{agent.id} could not be asked: {exc.message}")
                unreachable += 1
                await asyncio.sleep(RECONCILE_BACKOFF_S * unreachable)
                continue
            if status is None:
                await self._needs_human(op, f"{agent.id} cannot report on operations")
            assert status is not None
            log.info("operation %s at %s: %s", op.op_id, agent.id, status["status"])
            if isinstance(status.get("usage"), dict):
                self.usage = status["usage"]
            match status["status"]:
                case "running":
                    if asyncio.get_running_loop().time() > deadline:
                        await self._needs_human(op, f"{agent.id} has been running it for over an hour")
                    continue  # the agent is still at it; the wait was a long poll
                case "succeeded":
                    result = status.get("result") or {}
                    await self._record(op, OpStatus.SUCCEEDED, result=result, after=self._closing(result))
                    self.settled_at = dt.datetime.now(dt.UTC)
                    return dict(result)
                case "failed" | "canceled":
                    error = FleetError.from_dict(status.get("error"), fallback=ErrorCode.SPECIALIST_FAILED)
                    await self._record(op, OpStatus.FAILED, error=error.to_dict())
                    raise FleetError(
                        ErrorCode.SPECIALIST_FAILED,
                        f"{agent.id} failed the step: {error.message}",
                        cause=error,
                    )
                case "unknown" | "interrupted":
                    # Never received, or cut short: send it again under the same id (the agent
                    # decides whether a repeat is safe, and says "uncertain" if it is not).
                    self._redispatches += 1
                    if self._redispatches > MAX_REDISPATCHES:
                        await self._needs_human(op, f"sent {MAX_REDISPATCHES} times without an answer")
                    await self._ledger.retry(self._lease, self._actor, op.op_id)
                    self._resend = True
                    return await self._dispatch(op, agent)
                case _:
                    said = status.get("error")
                    why = (
                        FleetError.from_dict(said).message if said else "the agent cannot tell what happened"
                    )
                    await self._needs_human(op, why)

    async def _record(
        self,
        op: Operation,
        status: OpStatus,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        after: list[Event] | None = None,
    ) -> None:
        usage = self.usage if status in (OpStatus.SUCCEEDED, OpStatus.FAILED) else None
        await self._ledger.record_outcome(
            self._lease,
            self._actor,
            op.op_id,
            status,
            result=result,
            error=error,
            usage=usage,
            after=after or [],
        )
        if usage is not None:  # counted once: the outcome is recorded once (the write is fenced)
            telemetry.record_agent_usage(op.target, spending.priced(usage, self._models))

    async def _needs_human(self, op: Operation, why: str) -> None:
        error = FleetError(ErrorCode.OUTCOME_UNKNOWN, why).to_dict()
        await self._record(op, OpStatus.NEEDS_HUMAN, error=error)
        raise NeedsHuman(op.op_id, why)


async def settle_pending(delegator: Delegator, scope: RunScope, tenant: str) -> None:
    """After a run was stopped (canceled), stop the operations it left in flight and record what became
    of each, so that the ledger matches the world. Each is canceled at its agent (see
    :mod:`fleet.operation_ext`), which answers once the cancel took effect:

    - ``succeeded`` or ``failed`` (it ended first): recorded as it is;
    - ``canceled``: ``failed`` with the agent's error (code ``canceled``), which counts the tool calls
      the operation completed before it stopped: 0 means it made no effect (an operation the agent had
      not received yet is refused if it arrives later); N > 0 means the effects of N complete tool
      calls, each known to its tool, and nothing more;
    - anything else (still running after a wait, interrupted, uncertain; an agent that cannot be
      reached or cannot cancel and has not finished it): ``needs_human``.

    The operations are settled in parallel (each may wait for a tool call in flight); the first error
    (a lost lease, the database) is raised as it is once all were tried.
    """
    pending = [op for op in await scope.ledger.for_run(scope.lease.run_id) if op.status == OpStatus.PENDING]
    settled = await asyncio.gather(
        *(_settle(delegator, scope, op, tenant) for op in pending), return_exceptions=True
    )
    for failure in settled:
        if isinstance(failure, BaseException):
            raise failure


async def _settle(delegator: Delegator, scope: RunScope, op: Operation, tenant: str) -> None:
    outcome, result, error = _settled(op.target, await _cancel_at_agent(delegator, op, tenant))
    await scope.ledger.record_outcome(scope.lease, scope.actor, op.op_id, outcome, result=result, error=error)


async def _cancel_at_agent(delegator: Delegator, op: Operation, tenant: str) -> dict[str, Any]:
    """What the agent of ``op`` says of it after it was asked to cancel it."""
    try:
        agent = await delegator.agent(op.target)
        answer = await delegator.cancel_operation(agent, op.op_id, tenant=tenant)
        if answer is None or answer["status"] == "running":
            # It cannot cancel (it may still finish), or its tool call in flight outlasted the
            # cancel's wait: wait a while longer for its end.
            answer = await delegator.operation_status(agent, op.op_id, tenant=tenant, wait_s=MAX_WAIT_S)
    except FleetError as exc:
        return {"status": "uncertain", "error": exc.to_dict()}
    return answer or {"status": "uncertain", "error": {"message": "it cannot report on operations"}}


_Settled = tuple[OpStatus, dict[str, Any] | None, dict[str, Any] | None]


def _settled(target: str, answer: dict[str, Any]) -> _Settled:
    """The ledger's outcome for an operation of a canceled run, from what its agent said of it."""
    state = answer["status"]
    given = answer.get("error")
    error: dict[str, Any] = given if isinstance(given, dict) else {}
    if state == "succeeded":
        return OpStatus.SUCCEEDED, dict(answer.get("result") or {}), None
    if state == "failed":
        return OpStatus.FAILED, None, error or FleetError(ErrorCode.SPECIALIST_FAILED, "failed").to_dict()
    if state == "canceled":
        message = error.get("message", "canceled when the run was canceled")
        return OpStatus.FAILED, None, {**error, "code": str(ErrorCode.CANCELED), "message": message}
    why = f"{state} at {target} when the run was canceled"
    if error.get("message"):
        why += f": {error['message']}"
    return OpStatus.NEEDS_HUMAN, None, FleetError(ErrorCode.OUTCOME_UNKNOWN, why).to_dict()
