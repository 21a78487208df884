"""The operations ledger: every external effect of a run, recorded before and after it happens.

An operation is one dispatch of work to something outside the run (today: a step delegated to a
specialist). Its id is derived from the run and the step, so a replay of the same step after a crash
finds the same operation instead of making a new one, and it is bound to a hash of its exact
arguments. The protocol:

1. record the intent (``pending``) durably, fenced by the run's lease, before anything is sent;
2. dispatch with the operation id as the idempotency key;
3. record the result (``succeeded`` / ``failed``) before the run goes on.

A worker that finds a ``pending`` operation (its predecessor died between 1 and 3) reconciles it with
the target by operation id before anything is retried; if the target cannot say what happened, the
operation becomes ``needs_human`` and the run waits for a person.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.record.notifier import NOTIFY_CHANNEL
from coordinator.record.runs import Lease, StaleLease, fenced_append, hand_back, logged
from fleet.errors import ErrorCode, FleetError
from fleet.operation_ext import args_hash
from fleet.vocabulary import EventType

MAX_PROGRESS_BYTES = 80 * 1024  # an agent's progress notes of one operation (they hold 64 KiB)
_NAMESPACE = uuid.UUID("0b5c7a52-4d8e-4c8e-9a55-3f1f6f0e2a10")


Verdict = Literal["succeeded", "failed", "retry"]


class OpStatus(StrEnum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NEEDS_HUMAN = "needs_human"


SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_runs.operations (
    op_id      text PRIMARY KEY,
    run_id     text NOT NULL REFERENCES fleet_runs.runs (run_id) ON DELETE CASCADE,
    step_id    text NOT NULL,
    kind       text NOT NULL,
    target     text NOT NULL,
    args_hash  text NOT NULL,
    args       jsonb NOT NULL,
    status     text NOT NULL,
    result     jsonb,
    error      jsonb,
    attempts   integer NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS operations_by_run ON fleet_runs.operations (run_id, created_at);
-- What the agent said the operation spent (tool calls, LLM tokens in and out, models), if it said.
ALTER TABLE fleet_runs.operations ADD COLUMN IF NOT EXISTS usage jsonb;
-- The progress notes of the agent loop running it, and the agent that wrote them (sent back to that
-- agent only, if the operation is sent again).
ALTER TABLE fleet_runs.operations ADD COLUMN IF NOT EXISTS progress jsonb;
ALTER TABLE fleet_runs.operations ADD COLUMN IF NOT EXISTS progress_by text;
-- The last request the agent loop of a failed operation sent its model (redacted, as the agent sent
-- it): the debug bundle's model_requests.jsonl.
ALTER TABLE fleet_runs.operations ADD COLUMN IF NOT EXISTS last_request jsonb;
"""

_COLUMNS = (
    "op_id, run_id, step_id, kind, target, args_hash, args, status, result, error, attempts,"
    " created_at, updated_at, usage"
)


# Each write is one statement (one round trip, one commit): the change to the operation, fenced by
# the run's lease, and its event at the run's next sequence number, only if the change happened.
# The fence locks the run's row while it checks the lease, so that no takeover can slip in between
# the check and the write.
_FENCE = """
fence AS (
    SELECT run_id FROM fleet_runs.runs WHERE run_id = %(run_id)s AND lease_epoch = %(epoch)s
    AND state NOT IN ('completed', 'failed', 'canceled', 'rejected') FOR UPDATE
)
"""
# The change's events: the operation's own, and any the caller writes with it (a step's start with
# its intent, its completion with its result), in order, at the run's next sequence numbers.
_LOGGED = """
commit_mode AS (
    -- Relaxed only where losing the write in a crash of Postgres itself is safe (see record_outcome).
    SELECT set_config(
        'synchronous_commit', COALESCE(%(relaxed_commit)s, current_setting('synchronous_commit')), true
    ) AS mode
),
bump AS (
    UPDATE fleet_runs.runs SET last_seq = last_seq + jsonb_array_length(%(events)s), updated_at = now()
    WHERE run_id = %(run_id)s AND EXISTS (SELECT 1 FROM op)
    RETURNING run_id, last_seq
),
logged AS (
    INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload)
    SELECT bump.run_id, bump.last_seq - jsonb_array_length(%(events)s) + e.n, e.item->>'type', %(actor)s,
        jsonb_build_object('step', op.step_id) || (e.item->'payload')
    FROM bump, op, commit_mode, jsonb_array_elements(%(events)s) WITH ORDINALITY AS e(item, n)
    RETURNING run_id
)
"""
_INTENT = f"""
WITH {_FENCE},
op AS (
    INSERT INTO fleet_runs.operations (op_id, run_id, step_id, kind, target, args_hash, args, status)
    SELECT %(op_id)s, %(run_id)s, %(step_id)s, %(kind)s, %(target)s, %(args_hash)s, %(args)s, 'pending'
    FROM fence
    ON CONFLICT (op_id) DO NOTHING
    RETURNING {_COLUMNS}
),
{_LOGGED}
SELECT op.*, (SELECT pg_notify(%(channel)s, run_id) FROM logged LIMIT 1) AS notified FROM op
"""
_OUTCOME = f"""
WITH {_FENCE},
op AS (
    UPDATE fleet_runs.operations SET status = %(status)s, result = %(result)s, error = %(error)s,
        usage = COALESCE(%(usage)s, usage), updated_at = now()
    WHERE op_id = %(op_id)s AND run_id = %(run_id)s AND EXISTS (SELECT 1 FROM fence)
    RETURNING {_COLUMNS}
),
{_LOGGED}
SELECT op.*, (SELECT pg_notify(%(channel)s, run_id) FROM logged LIMIT 1) AS notified FROM op
"""

Event = tuple[EventType, Mapping[str, Any]]  # (type, payload) of an event written with a ledger change


def _events(own: Event, before: Sequence[Event] = (), after: Sequence[Event] = ()) -> Jsonb:
    return Jsonb([{"type": type_, "payload": logged(payload)} for type_, payload in (*before, own, *after)])


def operation_id(run_id: str, step_id: str) -> str:
    """The same run and step always give the same id: a replay finds the operation it made before."""
    return "op-" + uuid.uuid5(_NAMESPACE, f"{run_id}/{step_id}").hex


@dataclass(frozen=True, slots=True)
class Operation:
    op_id: str
    run_id: str
    step_id: str
    kind: str
    target: str
    args_hash: str
    args: dict[str, Any]
    status: OpStatus
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    attempts: int
    created_at: dt.datetime
    updated_at: dt.datetime
    usage: dict[str, Any] | None = None  # what the agent said it spent, as it said it

    def to_json(self) -> dict[str, Any]:
        return {
            "op_id": self.op_id,
            "run_id": self.run_id,
            "step_id": self.step_id,
            "kind": self.kind,
            "target": self.target,
            "args_hash": self.args_hash,
            "status": self.status.value,
            "error": self.error,
            "attempts": self.attempts,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            **({"usage": self.usage} if self.usage is not None else {}),
        }


def _operation(row: Mapping[str, Any]) -> Operation:
    return Operation(**{**row, "status": OpStatus(row["status"])})


class OperationConflict(FleetError):
    """A step was replayed with other arguments than the operation recorded for it: the run is not
    deterministic, and nothing is sent until a person looks."""

    def __init__(self, op_id: str) -> None:
        super().__init__(ErrorCode.CONFLICT, f"operation {op_id} was recorded with other arguments")
        self.op_id = op_id


class Ledger:
    """Operations in Postgres, next to the runs. Every write is fenced by the run's lease and
    recorded in the run's event log in the same transaction."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool

    async def setup(self) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.runs.schema'))")
            await conn.execute(SCHEMA)

    async def get(self, op_id: str) -> Operation | None:
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(f"SELECT {_COLUMNS} FROM fleet_runs.operations WHERE op_id = %s", (op_id,))
            row = await cursor.fetchone()
        return _operation(row) if row else None

    async def for_run(self, run_id: str) -> list[Operation]:
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                f"SELECT {_COLUMNS} FROM fleet_runs.operations WHERE run_id = %s ORDER BY created_at, op_id",
                (run_id,),
            )
            return [_operation(row) for row in await cursor.fetchall()]

    async def record_intent(
        self,
        lease: Lease,
        actor: str,
        *,
        step_id: str,
        kind: str,
        target: str,
        args: dict[str, Any],
        before: Sequence[Event] = (),
    ) -> tuple[Operation, bool]:
        """Record that the run is about to dispatch ``args`` to ``target`` (durable when this
        returns), and whether this call created it, with ``before`` logged ahead of its event (only
        if it did). Idempotent for the same step and arguments; other arguments are a conflict; a
        lease that is no longer current gets nothing."""
        op_id = operation_id(lease.run_id, step_id)
        digest = args_hash(args)
        payload = {"op_id": op_id, "kind": kind, "target": target}  # the arguments' hash is on the row
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                _INTENT,
                {
                    "op_id": op_id,
                    "run_id": lease.run_id,
                    "epoch": lease.epoch,
                    "step_id": step_id,
                    "kind": kind,
                    "target": target,
                    "args_hash": digest,
                    "args": Jsonb(args),
                    "events": _events((EventType.OPERATION_INTENT, payload), before),
                    "actor": actor,
                    "relaxed_commit": None,
                    "channel": NOTIFY_CHANNEL,
                },
            )
            row = await cursor.fetchone()
        if row is not None:
            return _operation({k: v for k, v in row.items() if k != "notified"}), True
        existing = await self.get(op_id)  # recorded before (a replay), or the lease is gone
        if existing is None or existing.run_id != lease.run_id or not await self._holds(lease):
            raise StaleLease(lease.run_id)
        if existing.args_hash != digest:
            raise OperationConflict(op_id)
        return existing, False

    async def _holds(self, lease: Lease) -> bool:
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT 1 FROM fleet_runs.runs WHERE run_id = %s AND lease_epoch = %s"
                " AND state NOT IN ('completed', 'failed', 'canceled', 'rejected')",
                (lease.run_id, lease.epoch),
            )
            return await cursor.fetchone() is not None

    async def record_outcome(
        self,
        lease: Lease,
        actor: str,
        op_id: str,
        status: OpStatus,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        usage: dict[str, Any] | None = None,
        after: Sequence[Event] = (),
    ) -> None:
        """Record what became of a pending operation (its result or error, and what the agent said
        it spent: ``usage``, also on its event), with its event and ``after`` logged behind it.

        A result that came from the agent is committed without waiting for the WAL flush: every
        later durable write (the next intent, the checkpoint, the run's transition) flushes it
        first, and if Postgres itself crashes before then, the operation is found ``pending`` and
        reconciled with the agent, which keeps its outcome. Anything a person or the wait
        machinery depends on (``needs_human``) is durable at once."""
        payload: dict[str, Any] = {"op_id": op_id, **({"error": error} if error is not None else {})}
        if usage is not None:
            payload["usage"] = usage
        relaxed = status in (OpStatus.SUCCEEDED, OpStatus.FAILED)
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                _OUTCOME,
                {
                    "op_id": op_id,
                    "run_id": lease.run_id,
                    "epoch": lease.epoch,
                    "status": status.value,
                    "result": Jsonb(result) if result is not None else None,
                    "error": Jsonb(error) if error is not None else None,
                    "usage": Jsonb(usage) if usage is not None else None,
                    "events": _events((EventType.of_operation(status), payload), after=after),
                    "actor": actor,
                    "relaxed_commit": "off" if relaxed else None,
                    "channel": NOTIFY_CHANNEL,
                },
            )
            row = await cursor.fetchone()
        if row is None:
            if await self.get(op_id) is None:
                raise FleetError(ErrorCode.NOT_FOUND, f"no operation {op_id} in run {lease.run_id}")
            raise StaleLease(lease.run_id)

    async def record_progress(self, run_id: str, op_id: str, agent: str, notes: dict[str, Any]) -> bool:
        """Keep the progress notes ``agent`` sent for a pending operation it was sent; False (and
        nothing kept) if the operation is not pending at that agent any more, or the notes are over
        :data:`MAX_PROGRESS_BYTES`. Not fenced by the lease: the notes are the agent's, about its own
        work on this operation, and whoever sends the operation again reads the latest."""
        body = Jsonb(notes)
        if len(json.dumps(notes, default=str)) > MAX_PROGRESS_BYTES:
            return False
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "UPDATE fleet_runs.operations SET progress = %s, progress_by = %s"
                " WHERE op_id = %s AND run_id = %s AND status = 'pending' AND target = %s",
                (body, agent, op_id, run_id, agent),
            )
            return bool(cursor.rowcount == 1)

    async def record_last_request(self, run_id: str, op_id: str, agent: str, request: dict[str, Any]) -> None:
        """Keep the last model request of ``agent``'s failed loop on ``op_id`` (at most
        :data:`MAX_PROGRESS_BYTES`, else not kept), for the run's debug bundle."""
        if len(json.dumps(request, default=str)) > MAX_PROGRESS_BYTES:
            return
        async with self._pool.connection() as conn:
            await conn.execute(
                "UPDATE fleet_runs.operations SET last_request = %s WHERE op_id = %s AND run_id = %s AND target = %s",
                (Jsonb(request), op_id, run_id, agent),
            )

    async def last_requests(self, run_id: str) -> list[dict[str, Any]]:
        """The kept last model requests of the run's operations: ``{op_id, step_id, target, request}``."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT op_id, step_id, target, last_request FROM fleet_runs.operations"
                " WHERE run_id = %s AND last_request IS NOT NULL ORDER BY created_at, op_id",
                (run_id,),
            )
            rows = await cursor.fetchall()
        return [{"op_id": r[0], "step_id": r[1], "target": r[2], "request": r[3]} for r in rows]

    async def progress_for(self, op_id: str, agent: str) -> dict[str, Any] | None:
        """The progress notes of ``op_id`` if ``agent`` wrote them (another agent's are not its)."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT progress FROM fleet_runs.operations WHERE op_id = %s AND progress_by = %s",
                (op_id, agent),
            )
            row = await cursor.fetchone()
        return row[0] if row is not None and isinstance(row[0], dict) else None

    async def retry(self, lease: Lease, actor: str, op_id: str) -> None:
        """Send a pending operation again (after its target said it never received it)."""
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "UPDATE fleet_runs.operations SET attempts = attempts + 1, updated_at = now()"
                " WHERE op_id = %s AND run_id = %s AND status = 'pending' RETURNING attempts",
                (op_id, lease.run_id),
            )
            row = await cursor.fetchone()
            if row is None:
                raise FleetError(ErrorCode.CONFLICT, f"operation {op_id} is not pending")
            await fenced_append(
                conn, lease, EventType.OPERATION_REDISPATCH, actor, {"op_id": op_id, "attempt": row[0]}
            )

    async def reroute(self, lease: Lease, actor: str, op_id: str, target: str, why: str) -> None:
        """Send a pending operation to another agent offering its skill (its first could not be
        reached, or could not answer it and the skill is safe to repeat): the same id, so every
        effect keyed on it is still made once."""
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "UPDATE fleet_runs.operations op SET target = %s, attempts = op.attempts + 1,"
                " updated_at = now() FROM fleet_runs.operations was"
                " WHERE op.op_id = was.op_id AND op.op_id = %s AND op.run_id = %s"
                " AND op.status = 'pending' RETURNING was.target, op.step_id",
                (target, op_id, lease.run_id),
            )
            row = await cursor.fetchone()
            if row is None:
                raise FleetError(ErrorCode.CONFLICT, f"operation {op_id} is not pending")
            payload = {"op_id": op_id, "step": row[1], "from": row[0], "to": target, "why": why}
            await fenced_append(conn, lease, EventType.STEP_REROUTED, actor, payload)

    async def resolve(
        self,
        run_id: str,
        tenant: str,
        op_id: str,
        verdict: Verdict,
        actor: str,
        *,
        result: dict[str, Any] | None = None,
        note: str = "",
    ) -> tuple[Operation, int]:
        """A person's answer for an operation that needed one, which also hands the waiting run
        back to the workers (returned with the seq of its event): ``succeeded`` (with the result the person vouches for), ``failed``, or
        ``retry`` (it is reconciled with its agent and sent again if the agent never got it)."""
        status = {"succeeded": OpStatus.SUCCEEDED, "failed": OpStatus.FAILED, "retry": OpStatus.PENDING}[
            verdict
        ]
        error = {"code": "resolved_by_person", "message": note or "failed, as a person said", "by": actor}
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "SELECT last_seq FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s AND state = 'waiting'"
                " FOR UPDATE",
                (run_id, tenant),
            )
            run = await cursor.fetchone()
            if run is None:
                raise FleetError(ErrorCode.CONFLICT, f"run {run_id} is not waiting for a person")
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                f"UPDATE fleet_runs.operations SET status = %s, updated_at = now(),"
                f" result = CASE WHEN %s = 'succeeded' THEN %s ELSE result END,"
                f" error = CASE WHEN %s = 'failed' THEN %s ELSE error END"
                f" WHERE op_id = %s AND run_id = %s AND status = 'needs_human' RETURNING {_COLUMNS}",
                (status.value, status.value, Jsonb(result or {}), status.value, Jsonb(error), op_id, run_id),
            )
            row = await cursor.fetchone()
            if row is None:
                raise FleetError(
                    ErrorCode.CONFLICT, f"operation {op_id} of run {run_id} does not need a person"
                )
            seq = int(run[0]) + 1
            resolved = {
                "op_id": op_id,
                "verdict": verdict,
                "note": note,
                "state": "submitted",
                "text": f"{actor} resolved operation {op_id}: {verdict}",
            }
            await hand_back(conn, run_id, seq, EventType.OPERATION_RESOLVED, actor, resolved)
        return _operation(row), seq
