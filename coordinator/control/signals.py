"""Signals: the answers people and programs give to what a paused run waits for.

A run that stops at a gate (a step whose result asks for an approval or for input, see
:func:`coordinator.engine.graph.gate_of`) parks: its checkpoint is durable, its wait record says what is
awaited (``approval:<step>:<n>``) and until when, and no process waits for it. The worker that parks
it publishes an approval request on ``fleet.approvals.<tenant>.<run_id>`` (JetStream stream
``FLEET_APPROVALS``, one message per awaited id).

A signal answers it: ``approve``, ``reject``, ``input`` (approve with input), ``extend`` (the
deadline, by ``extend_s`` seconds) or ``cancel``. It arrives on one of three channels, and every one
goes through :meth:`SignalDesk.apply`:

- the run API: ``POST /v1/runs/{id}/signals`` (``fleet approve|reject RUN``);
- NATS: a message on ``fleet.signals.<run_id>`` (JetStream stream ``FLEET_SIGNALS``, which keeps
  it) with its id in ``Nats-Msg-Id`` and a **signal grant** in ``Fleet-Signal-Grant``: a grant the
  registry's token service signed for the signer, good for this run, this action, this id and
  the SHA-256 of these exact bytes, for five minutes (see :func:`publish_signal`). A copy read
  from the stream carries that one signal again and nothing else: the same id gets the first
  answer. No bearer token travels on NATS: a message with an ``Authorization`` header is refused
  and erased from the stream. The outcome is published on ``fleet.signal_outcomes.<run_id>``;
- A2A: a follow-up message on the run's task while it is ``input-required``.

The rules:

- the signer is the verified token's (or signal grant's) subject. ``fleet.runs.access`` decides
  which runs the signer reaches (its own; the tenant's with ``runs:admin``, or, to answer or
  cancel, with ``runs:approve``): any other run is not found, as if it did not exist. Then
  ``fleet.approvals.decision`` decides whether they may give this answer to this wait (a refusal
  is recorded and answered ``forbidden``). A2A ``CancelTask`` is a cancel signal like the others;
- a signal id is the signer's: the same id from another signer is a ``conflict``;
- the answer is delivered to the exact wait it names (``awaited``; by default the gate the run
  waits at now) and recorded with the run (``runs.answers``) under the run's row lock, so
  concurrent signals are serialised and only the first answer to a wait counts;
- every signal is recorded (``fleet_runs.signals``) with what came of it: ``applied``, or a no-op
  (``duplicate``: that wait was answered already; ``stale``: the run waits for nothing it names;
  ``finished``: the run has ended), or ``forbidden``. A signal id given twice gets the first answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.client import JetStreamContext
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.record.access import RunAccess, signal_action
from coordinator.record.gates import GATE_TYPES
from coordinator.record.runs import PostgresRunStore, Run, RunNotFound, wait_requests
from fleet.approvals import ApprovalBinding, ApprovalRequest
from fleet.errors import AuthError, DependencyUnavailable, ErrorCode, FleetError
from fleet.retry import backoff_s, retrying
from fleet.signal_client import (
    GRANT_HEADER,
    OUTCOMES_PREFIX,
    SIGNALS_PREFIX,
    SIGNALS_STREAM,
    SIGNALS_SUBJECTS,
    ensure_signal_streams,
)
from fleet.tokens import (
    ACCESS_TOKEN_TYPE,
    SIGNAL_GRANT_TYPE,
    Claims,
    SignalBinding,
    TokenVerifier,
)
from fleet.vocabulary import EventType, SignalAction
from policy import PolicyEngine

log = logging.getLogger(__name__)

ACTIONS = tuple(SignalAction)
DEAD_LETTER_SUBJECT = "fleet.dead.signals"
SIGNAL_GRANT = "signal_grant"  # its token_use
MAX_EXTEND_S = 30 * 24 * 3600.0
MAX_NOTE = 2000
CONSUMER = "signals"
MAX_DELIVER = 5
RETRY_DELAY_S = 2.0
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_SIGNAL_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,200}$")

# Asks the registry for an approval grant: (binding, tenant, the signer's token, its token type).
GrantIssuer = Callable[[ApprovalBinding, str, str, str], Awaitable[str]]

# What an applied answer is recorded as in the run's event log.
ANSWER_EVENTS = {
    SignalAction.APPROVE: EventType.APPROVAL_GRANTED,
    SignalAction.INPUT: EventType.INPUT_PROVIDED,
    SignalAction.REJECT: EventType.APPROVAL_REJECTED,
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_runs.signals (
    tenant      text NOT NULL,
    signal_id   text NOT NULL,
    run_id      text NOT NULL,
    action      text NOT NULL,
    awaited     text,
    signer      text NOT NULL,
    via         text NOT NULL,
    outcome     text NOT NULL,
    reasons     jsonb NOT NULL DEFAULT '[]',
    seq         bigint,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, signal_id)
);
CREATE INDEX IF NOT EXISTS signals_by_run ON fleet_runs.signals (run_id, received_at);
"""


@dataclass(frozen=True, slots=True)
class Signal:
    run_id: str
    action: SignalAction
    signal_id: str
    via: str
    awaited: str | None = None
    input: dict[str, Any] | None = None
    note: str = ""
    extend_s: float | None = None


def parse_signal(run_id: str, body: Any, via: str, signal_id: str | None = None) -> Signal:
    """A signal from a request body, or ``invalid_request`` saying what is wrong with it."""
    if not isinstance(body, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "a signal is a JSON object")
    asked = body.get("action")
    if not isinstance(asked, str) or asked not in ACTIONS:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"action must be one of {', '.join(ACTIONS)}")
    action = SignalAction(asked)
    awaited, note, given = body.get("awaited"), body.get("note", ""), body.get("input")
    if awaited is not None and (not isinstance(awaited, str) or not awaited):
        raise FleetError(ErrorCode.INVALID_REQUEST, "awaited must be the id of what the run waits for")
    if not isinstance(note, str) or len(note) > MAX_NOTE:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"note must be a string of at most {MAX_NOTE} characters")
    if given is not None and not isinstance(given, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "input must be a JSON object")
    if action == SignalAction.INPUT and given is None:
        raise FleetError(ErrorCode.INVALID_REQUEST, "an input signal needs input")
    if given is not None and action not in (SignalAction.APPROVE, SignalAction.INPUT):
        raise FleetError(ErrorCode.INVALID_REQUEST, "input goes with approve or input")
    extend_s = body.get("extend_s")
    if action == SignalAction.EXTEND:
        if (
            isinstance(extend_s, bool)
            or not isinstance(extend_s, int | float)
            or not 0 < extend_s <= MAX_EXTEND_S
        ):
            raise FleetError(
                ErrorCode.INVALID_REQUEST, f"extend needs extend_s, 0 < seconds <= {MAX_EXTEND_S:g}"
            )
    elif extend_s is not None:
        raise FleetError(ErrorCode.INVALID_REQUEST, "extend_s goes with extend")
    signal_id = signal_id or body.get("id") or uuid.uuid4().hex
    if not isinstance(signal_id, str) or not _SIGNAL_ID.match(signal_id):
        raise FleetError(ErrorCode.INVALID_REQUEST, "id: 1-200 characters of letters, digits and ._:@/-")
    return Signal(
        run_id=run_id,
        action=action,
        signal_id=signal_id,
        via=via,
        awaited=awaited,
        input=given,
        note=note,
        extend_s=float(extend_s) if action == SignalAction.EXTEND and extend_s is not None else None,
    )


@dataclass(frozen=True, slots=True)
class SignalOutcome:
    """What came of a signal: ``applied``, a no-op (``duplicate``, ``stale``, ``finished``), or
    ``forbidden``; ``repeated`` when its id had been seen, and this is the first answer again."""

    signal_id: str
    run_id: str
    action: str
    outcome: str
    awaited: str | None = None
    reasons: list[str] = field(default_factory=list)
    seq: int | None = None
    repeated: bool = False
    signer: str = field(default="", compare=False)  # who gave it (not in the JSON answer)

    @property
    def applied(self) -> bool:
        return self.outcome == "applied"

    def to_json(self) -> dict[str, Any]:
        return {
            "signal_id": self.signal_id,
            "run_id": self.run_id,
            "action": self.action,
            "outcome": self.outcome,
            "applied": self.applied,
            "awaited": self.awaited,
            "reasons": self.reasons,
            "seq": self.seq,
            "repeated": self.repeated,
        }


def gate_waiting(run: Run, awaited: str | None) -> dict[str, Any] | None:
    """The gate request of a waiting run that ``awaited`` names (by default, the first gate)."""
    if run.state.value != "waiting" or not isinstance(run.wait, dict):
        return None
    for request in wait_requests(run.wait):
        if request.get("type") in GATE_TYPES and awaited in (None, request.get("awaited")):
            return dict(request)
    return None


def _no_op(run: Run, signal: Signal) -> str:
    if run.state.terminal:
        return "finished"
    if signal.awaited is not None and signal.awaited in run.answers:
        return "duplicate"
    return "stale"


class SignalDesk:
    """Applies signals (see the module's doc). One per coordinator process; the database
    serialises them across processes."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        runs: PostgresRunStore,
        engine: PolicyEngine,
        submit: Callable[[str, str, str], Awaitable[None]],
        grants: GrantIssuer | None = None,
    ) -> None:
        """``grants``: asks the registry for the approval grant of an approved gate whose tool
        named the call to approve (see :mod:`fleet.approvals`), with the signer's own token as
        evidence; None: no grants (an approved tool call is then refused by the tool)."""
        self._pool = pool
        self._runs = runs
        self._engine = engine
        self._access = RunAccess(engine)
        self._submit = submit
        self._grants = grants

    async def setup(self) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.signals.schema'))")
            await conn.execute(SCHEMA)

    async def apply(self, signal: Signal, claims: Claims) -> SignalOutcome:
        """Apply ``signal`` as ``claims``' subject; raise ``not_found`` for a run the signer does
        not reach (another tenant's, or another principal's: ``fleet.runs.access``) and
        ``forbidden`` for a signer policy refuses (both recorded)."""
        reach = await self._access.reach(claims, signal_action(signal.action))
        earlier = await self._recorded(claims.tenant, signal.signal_id)
        if earlier is not None:
            if earlier.signer != claims.sub or earlier.run_id != signal.run_id:
                raise FleetError(
                    ErrorCode.CONFLICT, f"signal id {signal.signal_id} was used for another signal"
                )
            if earlier.outcome == "forbidden":
                raise FleetError(ErrorCode.FORBIDDEN, "; ".join(earlier.reasons))
            return earlier
        try:
            run = await self._runs.get_run(signal.run_id, reach.tenant, owner=reach.owner)
        except RunNotFound:
            await self._record(signal, claims, "unknown_run", signal.awaited, [f"no run {signal.run_id}"])
            raise
        if run.state.terminal:
            return await self._record(
                signal, claims, "finished", signal.awaited, [f"the run has {run.state}"]
            )
        gate = gate_waiting(run, signal.awaited)
        if gate is None and signal.action != SignalAction.CANCEL:
            outcome = _no_op(run, signal)
            why = (
                "that wait was answered already"
                if outcome == "duplicate"
                else "the run waits for nothing it names"
            )
            return await self._record(signal, claims, outcome, signal.awaited, [why])
        awaited = gate.get("awaited") if gate is not None else None
        # Input for an approval gate approves it: policy decides it as an approval.
        action = (
            SignalAction.APPROVE
            if signal.action == SignalAction.INPUT and gate and gate.get("type") == "approval"
            else signal.action
        )
        decision = await self._engine.decide(
            "fleet.approvals.decision",
            {
                "action": action,
                "tenant": run.tenant,
                "signer": {"sub": claims.sub, "tenant": claims.tenant, "scopes": sorted(claims.scopes)},
                "run": {"owner": run.owner},
                "wait": {
                    **{key: gate.get(key) for key in ("type", "skill", "step") if gate is not None},
                    "escalated": bool(gate and gate.get("escalated")),
                },
            },
        )
        if not decision.allow:
            log.warning(
                "signal %s (%s) on run %s by %s refused: %s",
                signal.signal_id,
                signal.action,
                run.run_id,
                claims.sub,
                "; ".join(decision.reasons),
            )
            await self._record(signal, claims, "forbidden", awaited, list(decision.reasons))
            raise FleetError(ErrorCode.FORBIDDEN, "; ".join(decision.reasons))
        try:
            grant = await self._approval_grant(signal, action, claims, run, gate, decision.decision_id)
        except DependencyUnavailable:
            raise  # the token service is away: not an answer, the signal may be sent again
        except FleetError as exc:
            reasons = [f"the approval grant was refused: {exc.message}"]
            await self._record(signal, claims, "forbidden", awaited, reasons)
            raise FleetError(ErrorCode.FORBIDDEN, reasons[0]) from exc
        try:
            seq = await self._deliver(signal, claims, run, awaited, grant)
        except FleetError as exc:
            if exc.code != ErrorCode.CONFLICT:
                raise
            # Answered, or no longer waiting, between the read and the row lock.
            outcome = _no_op(await self._runs.get_run(run.run_id, claims.tenant), signal)
            if outcome == "stale" and awaited is not None:
                outcome = "duplicate"  # it was waiting for this a moment ago: someone answered first
            return await self._record(signal, claims, outcome, awaited, [exc.message])
        return await self._record(signal, claims, "applied", awaited, [], seq)

    async def _approval_grant(
        self,
        signal: Signal,
        action: str,
        claims: Claims,
        run: Run,
        gate: dict[str, Any] | None,
        decision_id: str,
    ) -> str | None:
        """The approval grant for the tool call an approved gate asked about (None for any other
        signal, or a gate whose step named no tool call): the registry's, bound to the run, the
        operation that asked, the tool and the hash of the arguments the approver was shown, in the
        name of the signer of ``claims`` (the registry takes it from their token, not from here)."""
        if (
            action != SignalAction.APPROVE
            or gate is None
            or gate.get("type") != "approval"
            or self._grants is None
        ):
            return None
        asked = gate.get("asked")
        request = ApprovalRequest.of(asked.get("approval_request") if isinstance(asked, dict) else None)
        if request is None:
            return None
        if not claims.token:
            raise FleetError(
                ErrorCode.FORBIDDEN, "the signer's token is not at hand to vouch for the approval"
            )
        binding = ApprovalBinding(
            run.run_id,
            str(gate.get("op_id") or ""),
            request.server,
            request.tool,
            request.args_sha256,
            decision_id,
        )
        kind = SIGNAL_GRANT_TYPE if claims.raw.get("token_use") == SIGNAL_GRANT else ACCESS_TOKEN_TYPE
        return await self._grants(binding, run.tenant, claims.token, kind)

    async def _deliver(
        self, signal: Signal, claims: Claims, run: Run, awaited: str | None, grant: str | None = None
    ) -> int:
        if signal.action == SignalAction.CANCEL:
            cancelled = await self._runs.request_cancel(run.run_id, run.tenant, claims.sub)
            return cancelled.last_seq
        assert awaited is not None
        if signal.action == SignalAction.EXTEND:
            assert signal.extend_s is not None
            return await self._runs.extend_wait(
                run.run_id, claims.tenant, awaited, signal.extend_s, claims.sub
            )
        answer: dict[str, Any] = {"decision": signal.action, "note": signal.note, "signal": signal.signal_id}
        if grant is not None:
            answer["grant"] = grant  # for the step's next call; never in the event log
        if signal.input is not None:
            answer["input"] = signal.input
        verb = {
            SignalAction.APPROVE: "approved",
            SignalAction.INPUT: "answered",
            SignalAction.REJECT: "rejected",
        }[signal.action]
        seq = await self._runs.answer_wait(
            run.run_id,
            claims.tenant,
            str((gate_waiting(run, awaited) or {}).get("type")),
            answer,
            claims.sub,
            event=ANSWER_EVENTS[signal.action],
            text=f"{claims.sub} {verb} {awaited} (via {signal.via})"
            + (f": {signal.note}" if signal.note else ""),
            awaited=awaited,
        )
        try:
            await self._submit(run.run_id, f"signal-{seq}", run.tenant)
        except Exception:  # the run is durable as submitted: the workers' sweep picks it up
            log.warning("could not submit run %s after a signal; the sweep will", run.run_id, exc_info=True)
        return seq

    async def _recorded(self, tenant: str, signal_id: str) -> SignalOutcome | None:
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT run_id, action, outcome, awaited, reasons, seq, signer FROM fleet_runs.signals"
                " WHERE tenant = %s AND signal_id = %s",
                (tenant, signal_id),
            )
            row = await cursor.fetchone()
        if row is None:
            return None
        return SignalOutcome(
            signal_id, row[0], row[1], row[2], row[3], list(row[4]), row[5], repeated=True, signer=row[6]
        )

    async def _record(
        self,
        signal: Signal,
        claims: Claims,
        outcome: str,
        awaited: str | None,
        reasons: list[str],
        seq: int | None = None,
    ) -> SignalOutcome:
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO fleet_runs.signals (tenant, signal_id, run_id, action, awaited, signer, via,"
                " outcome, reasons, seq) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (tenant, signal_id) DO NOTHING",
                (
                    claims.tenant,
                    signal.signal_id,
                    signal.run_id,
                    signal.action,
                    awaited,
                    claims.sub,
                    signal.via,
                    outcome,
                    Jsonb(reasons),
                    seq,
                ),
            )
        if outcome != "applied":
            log.info(
                "signal %s on run %s: %s (%s)", signal.signal_id, signal.run_id, outcome, "; ".join(reasons)
            )
        return SignalOutcome(signal.signal_id, signal.run_id, signal.action, outcome, awaited, reasons, seq)

    async def for_run(self, run_id: str, tenant: str) -> list[dict[str, Any]]:
        """Every signal given to a run of ``tenant``, oldest first."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT signal_id, action, awaited, signer, via, outcome, reasons, seq, received_at"
                " FROM fleet_runs.signals WHERE run_id = %s AND tenant = %s ORDER BY received_at, signal_id",
                (run_id, tenant),
            )
            rows = await cursor.fetchall()
        keys = ("signal_id", "action", "awaited", "signer", "via", "outcome", "reasons", "seq", "received_at")
        return [{**dict(zip(keys, row, strict=True)), "received_at": row[8].isoformat()} for row in rows]


class SignalIngest:
    """Takes signals from ``fleet.signals.<run_id>`` (a durable consumer on ``FLEET_SIGNALS``):
    verifies the signal grant and that it is for exactly this message, applies the signal,
    publishes the outcome, then acks. A signal that cannot be settled (the database is away) is
    retried, then dead-lettered. ``grants``: a verifier of signal grants addressed to this
    coordinator (``TokenVerifier(..., grant="signal_grant")``)."""

    def __init__(self, client: NATS, desk: SignalDesk, grants: TokenVerifier) -> None:
        self._client = client
        self._desk = desk
        self._grants = grants

    async def subscribe(self, ack_wait_s: float = 30.0) -> JetStreamContext.PullSubscription:
        js = self._client.jetstream()
        await ensure_signal_streams(js)
        config = ConsumerConfig(
            durable_name=CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=MAX_DELIVER + 1,
            max_ack_pending=256,
        )
        return await js.pull_subscribe(
            SIGNALS_SUBJECTS, durable=CONSUMER, stream=SIGNALS_STREAM, config=config
        )

    async def run(self) -> None:
        # The broker not there yet, or away (failing over): tried again with backoff, for ever.
        subscription = await retrying("subscribing to signals", self.subscribe, retry_on=(Exception,))
        failed = 0  # fetches failed in a row
        while True:
            try:
                messages = await subscription.fetch(16, timeout=5)
                failed = 0
            except TimeoutError:  # nats' own, or the bare one its fetch raises when its first answer
                continue  # came at the deadline: no message, not a failure
            except Exception:
                failed += 1
                log.warning("could not fetch signals", exc_info=True)
                await asyncio.sleep(backoff_s(failed, base_s=RETRY_DELAY_S / 4, cap_s=RETRY_DELAY_S * 4))
                continue
            # One at a time, in order: signals to one run are answered in the order they came.
            for message in messages:
                try:
                    await self.handle(message)
                except Exception:
                    log.warning("a signal could not be settled", exc_info=True)

    async def handle(self, message: Msg) -> dict[str, Any]:
        """Settle one signal message; the outcome as published."""
        run_id = message.subject.removeprefix(SIGNALS_PREFIX)
        headers = message.headers or {}
        try:
            outcome = await self._settle(run_id, message, headers)
        except FleetError as exc:
            log.warning("signal on %s refused: [%s] %s", message.subject, exc.code, exc.message)
            outcome = {"run_id": run_id, "outcome": "refused", "applied": False, "error": exc.to_dict()}
        except Exception as exc:  # infrastructure trouble: keep the signal
            delivered = message.metadata.num_delivered
            if delivered < MAX_DELIVER:
                log.warning(
                    "signal for run %s failed (delivery %d); retrying", run_id, delivered, exc_info=True
                )
                with contextlib.suppress(Exception):
                    await message.nak(delay=RETRY_DELAY_S * delivered)
                raise
            error = FleetError(ErrorCode.INTERNAL, f"failed {delivered} times; last: {exc}")
            body = {
                "subject": message.subject,
                "reason": error.message,
                "error": error.to_dict(),
                "payload": message.data.decode(errors="replace"),
            }
            await self._client.jetstream().publish(
                DEAD_LETTER_SUBJECT,
                json.dumps(body).encode(),
                headers={"Nats-Msg-Id": f"dead-signal-{message.metadata.sequence.stream}"},
            )
            outcome = {"run_id": run_id, "outcome": "dead", "applied": False, "error": error.to_dict()}
        if _bearer_header(headers):
            await self._erase(message)
        with contextlib.suppress(Exception):
            await self._client.publish(OUTCOMES_PREFIX + run_id, json.dumps(outcome).encode())
        await message.ack()
        return outcome

    async def _erase(self, message: Msg) -> None:
        """Take a message that carried a bearer token out of the stream (it was refused), so that
        the token is not kept there for everyone who reads the stream."""
        sequence = message.metadata.sequence.stream
        try:
            await self._client.jetstream().delete_msg(SIGNALS_STREAM, sequence)
        except Exception:  # the stream keeps it until max_age: say so, and go on
            log.warning("could not erase signal message %d, which carried a bearer token", sequence)

    async def _settle(self, run_id: str, message: Msg, headers: dict[str, str]) -> dict[str, Any]:
        if _bearer_header(headers):  # never read, never logged: only refused
            raise AuthError(f"a signal carries a signal grant ({GRANT_HEADER}), never a bearer token")
        if not _TOKEN.match(run_id):
            raise FleetError(ErrorCode.INVALID_REQUEST, "the subject must be fleet.signals.<run id>")
        grant = headers.get(GRANT_HEADER)
        if not grant:
            raise AuthError(f"a signal needs a signal grant in the {GRANT_HEADER} header")
        claims = await self._grants.verify(grant)
        try:
            body = json.loads(message.data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"the signal is not JSON: {exc}") from exc
        signal_id = headers.get("Nats-Msg-Id", "")
        if not signal_id:
            raise FleetError(ErrorCode.INVALID_REQUEST, "a signal needs its id in the Nats-Msg-Id header")
        signal = parse_signal(run_id, body, "nats", signal_id)
        bound_to(claims, SignalBinding.of(run_id, signal.action, signal_id, message.data))
        # The signal id is the grant's nonce: it is recorded with the signal (fleet_runs.signals,
        # shared by every coordinator), and the same id again gets the first answer.
        outcome = await self._desk.apply(signal, claims)
        return outcome.to_json()


def _bearer_header(headers: dict[str, str]) -> bool:
    return any(name.lower() == "authorization" for name in headers)


def bound_to(claims: Claims, signal: SignalBinding) -> None:
    """Refuse a signal grant that was not given for exactly ``signal``."""
    granted = claims.raw.get("signal")
    granted = granted if isinstance(granted, dict) else {}
    expected = signal.claim()
    wrong = [name for name, value in expected.items() if granted.get(name) != value]
    if claims.raw.get("run_id") != signal.run_id:
        wrong.insert(0, "run")
    if wrong:
        names = {"id": "signal id", "sha256": "body"}
        raise AuthError(
            f"the signal grant is for another {', '.join(names.get(name, name) for name in wrong)}"
        )
