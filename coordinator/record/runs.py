"""Runs and their event log, in Postgres.

A run is created (with its id) before any work starts. Its event log is append-only with gap-free
sequence numbers: the next number is taken from the run's row under its lock, in the same transaction
as the insert. Writes that advance a run are fenced by the lease epoch: a worker whose lease was taken
over gets :class:`StaleLease` and can write nothing more.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NotRequired, TypedDict

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.record.grant_storage import pack_grant, unpack_grant
from coordinator.record.notifier import NOTIFY_CHANNEL, RunNotifier
from fleet.errors import ErrorCode, FleetError
from fleet.redact import redact, redact_async
from fleet.vocabulary import EventType

WAIT_SUMMARY = (
    "type",
    "awaited",
    "deadline",
)  # of a wait, in the run.waiting event (its time is the event's)
# What a wait record says of the first request it stands for (its detail holds the rest of it).
ON_THE_WAIT = ("type", "awaited", "deadline", "warn_at")
FOLLOW_PAGE = 500
FOLLOW_POLL_S = 60.0  # a follower re-reads this often even without a notification


class RunState(StrEnum):
    SUBMITTED = "submitted"
    WORKING = "working"
    WAITING = "waiting"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELED, RunState.REJECTED})


class StaleLease(FleetError):
    """The caller's lease on a run is no longer current: another worker owns the run now, or the
    run has already reached its terminal state (no write may follow it)."""

    def __init__(self, run_id: str) -> None:
        super().__init__(ErrorCode.CONFLICT, f"lease on run {run_id} is no longer held")


class CancelRequested(FleetError):
    """Someone asked for the run to be canceled; the worker stops at its next write."""

    def __init__(self, run_id: str) -> None:
        super().__init__(ErrorCode.CONFLICT, f"run {run_id} was asked to cancel")


class BatchClosed(FleetError):
    """An item for a batch run whose batch has closed (its items were taken)."""

    def __init__(self, run_id: str, closed_at: dt.datetime) -> None:
        super().__init__(
            ErrorCode.CONFLICT,
            f"the batch of run {run_id} closed at {closed_at.isoformat()}; the item came too late",
        )


class RunNotFound(FleetError):
    def __init__(self, run_id: str) -> None:
        super().__init__(ErrorCode.NOT_FOUND, f"no run {run_id}")


class PlanStep(TypedDict):
    """A step as a run keeps it, in its record, its checkpoints and its events (what
    :meth:`Step.to_dict` gives): the keys a batch, timer or named-agent step adds are optional."""

    id: str
    skill: str
    input: dict[str, Any]
    after: list[str]
    agent: NotRequired[str]
    for_each: NotRequired[Any]
    items_as: NotRequired[str]
    batch: NotRequired[dict[str, int]]
    wait: NotRequired[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Run:
    run_id: str
    tenant: str
    owner: str
    state: RunState
    reason: str | None
    request: dict[str, Any]
    plan: list[PlanStep]
    last_seq: int
    lease_epoch: int
    cancel_requested: bool
    wait: dict[str, Any] | None  # while waiting: type, awaited object, since, deadline, why
    created_at: dt.datetime
    updated_at: dt.datetime
    # Answers to the run's waits (decisions), by what was awaited; kept, so that a worker that dies
    # before the resumed graph is checkpointed cannot lose one.
    answers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunEvent:
    run_id: str
    seq: int
    type: str
    ts: dt.datetime
    actor: str
    payload: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "seq": self.seq,
            "type": self.type,
            "ts": self.ts.isoformat(),
            "actor": self.actor,
            "payload": self.payload,
        }


@dataclass(frozen=True, slots=True)
class Lease:
    run_id: str
    owner: str
    epoch: int


SCHEMA = """
CREATE SCHEMA IF NOT EXISTS fleet_runs;
CREATE TABLE IF NOT EXISTS fleet_runs.runs (
    run_id           text PRIMARY KEY,
    tenant           text NOT NULL,
    owner            text NOT NULL,
    state            text NOT NULL,
    reason           text,
    request          jsonb NOT NULL,
    plan             jsonb NOT NULL DEFAULT '[]',
    last_seq         bigint NOT NULL DEFAULT 0,
    lease_owner      text,
    lease_epoch      bigint NOT NULL DEFAULT 0,
    lease_expires_at timestamptz,
    cancel_requested boolean NOT NULL DEFAULT false,
    wait             jsonb,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS runs_by_tenant ON fleet_runs.runs (tenant, created_at DESC);
CREATE TABLE IF NOT EXISTS fleet_runs.events (
    run_id  text NOT NULL REFERENCES fleet_runs.runs (run_id) ON DELETE CASCADE,
    seq     bigint NOT NULL,
    type    text NOT NULL,
    ts      timestamptz NOT NULL DEFAULT clock_timestamp(),
    actor   text NOT NULL,
    payload jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, seq)
);
ALTER TABLE fleet_runs.runs ADD COLUMN IF NOT EXISTS wait jsonb;
ALTER TABLE fleet_runs.runs ADD COLUMN IF NOT EXISTS answers jsonb NOT NULL DEFAULT '{}';
CREATE INDEX IF NOT EXISTS runs_waiting ON fleet_runs.runs (run_id) WHERE state = 'waiting';
ALTER TABLE fleet_runs.runs ADD COLUMN IF NOT EXISTS batch_closed_at timestamptz;
CREATE TABLE IF NOT EXISTS fleet_runs.batch_items (
    run_id   text NOT NULL REFERENCES fleet_runs.runs (run_id) ON DELETE CASCADE,
    event_id text NOT NULL,
    n        bigserial,
    item     jsonb NOT NULL,
    PRIMARY KEY (run_id, event_id)
);
-- A caller's own runs (see coordinator.record.access), newest first.
CREATE INDEX IF NOT EXISTS runs_by_owner ON fleet_runs.runs (tenant, owner, created_at DESC);
-- A run's wait record as it is read: what a gated step asked is kept once, in the ledger's result of
-- the operation that asked (see stored_wait), and put back here by the rule of the graph's gate_of.
-- PL/pgSQL, so that only a record that names its operation reads the ledger (whose table the
-- ledger's own setup makes).
CREATE OR REPLACE FUNCTION fleet_runs.wait_of(wait jsonb, of_run text) RETURNS jsonb
LANGUAGE plpgsql STABLE PARALLEL SAFE AS $fn$
DECLARE
    result jsonb;
    said text;
BEGIN
    IF jsonb_typeof(wait->'detail') IS DISTINCT FROM 'object' OR wait->'detail' ? 'asked'
        OR NOT (wait->'detail' ? 'op_id') OR wait->>'type' NOT IN ('approval', 'input') THEN
        RETURN wait;
    END IF;
    -- the run's own operation only: a record naming another run's reads as asking nothing
    SELECT op.result INTO result FROM fleet_runs.operations AS op
        WHERE op.op_id = wait->'detail'->>'op_id' AND op.run_id = of_run;
    IF jsonb_typeof(result) IS DISTINCT FROM 'object' THEN
        RETURN jsonb_set(wait, '{detail,asked}', '{}');
    END IF;
    SELECT k INTO said FROM unnest(ARRAY['why', 'question', 'message', 'reason']) WITH ORDINALITY AS w(k, n)
        WHERE jsonb_typeof(result->k) = 'string' ORDER BY n LIMIT 1;
    result := result - 'status' - 'user_input_required';
    IF said IS NOT NULL THEN
        result := result - said;
    END IF;
    RETURN jsonb_set(wait, '{detail,asked}', result);
END
$fn$;
-- A run's grant (see coordinator.grants): never in the event log, the run's record or an API answer.
-- Packed (see coordinator.record.grant_storage).
CREATE TABLE IF NOT EXISTS fleet_runs.run_grants (
    run_id      text PRIMARY KEY REFERENCES fleet_runs.runs (run_id) ON DELETE CASCADE,
    grant_token bytea NOT NULL
);
-- A table made before grants were packed keeps them as text: the same bytes, which read as a token.
DO $$ BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'fleet_runs'
               AND table_name = 'run_grants' AND column_name = 'grant_token' AND data_type = 'text') THEN
        ALTER TABLE fleet_runs.run_grants ALTER COLUMN grant_token TYPE bytea
            USING convert_to(grant_token, 'UTF8');
    END IF;
END $$;
"""

_FENCED_APPEND = """
WITH commit_mode AS (
    -- Only ever relaxed (for progress events); otherwise the server's own setting stands.
    SELECT set_config(
        'synchronous_commit', COALESCE(%(relaxed_commit)s, current_setting('synchronous_commit')), true
    ) AS mode
),
bump AS (
    UPDATE fleet_runs.runs
    SET last_seq = last_seq + 1, updated_at = now(),
        state = COALESCE(%(state)s, state), reason = COALESCE(%(reason)s, reason),
        wait = CASE WHEN %(state)s::text IS NULL THEN wait ELSE %(wait)s END
    WHERE run_id = %(run_id)s AND lease_epoch = %(epoch)s
      AND state NOT IN ('completed', 'failed', 'canceled', 'rejected')
    RETURNING run_id, last_seq, cancel_requested
),
inserted AS (
    INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload)
    SELECT run_id, last_seq, %(type)s, %(actor)s, %(payload)s FROM bump, commit_mode
    RETURNING run_id, seq
)
SELECT inserted.seq, bump.cancel_requested, pg_notify(%(channel)s, inserted.run_id)
FROM inserted, bump
"""

_RUN_COLUMNS = (
    "run_id, tenant, owner, state, reason, request, plan, last_seq, lease_epoch, cancel_requested,"
    " fleet_runs.wait_of(wait, run_id) AS wait, created_at, updated_at, answers"
)


async def fenced_append(
    conn: psycopg.AsyncConnection[Any],
    lease: Lease,
    type_: EventType,
    actor: str,
    payload: Mapping[str, Any],
    state: RunState | None = None,
    reason: str | None = None,
    durable: bool = True,
    wait: Mapping[str, Any] | None = None,
) -> tuple[int, bool]:
    """Append one event to the run's log under ``lease``; return its seq and whether a cancel was
    requested. Raise :class:`StaleLease` if the lease is no longer current or the run has ended.

    One statement, so one round trip: the fenced bump of the run's sequence, the insert at that
    number, and the wake-up for followers happen atomically (in the caller's transaction if it has
    one open, so other writes can be bound to the same fence)."""
    cursor = await conn.execute(
        _FENCED_APPEND,
        {
            "state": state.value if state else None,
            "reason": reason,
            "run_id": lease.run_id,
            "epoch": lease.epoch,
            "type": type_,
            "actor": actor,
            "payload": Jsonb(logged(payload)),
            "channel": NOTIFY_CHANNEL,
            "relaxed_commit": None if durable else "off",
            "wait": Jsonb(stored_wait(wait)) if wait is not None else None,
        },
    )
    row = await cursor.fetchone()
    if row is None:
        raise StaleLease(lease.run_id)
    return int(row[0]), bool(row[1])


def _outline(step: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in step.items() if key not in ("input", "for_each")}


class Unstorable(FleetError):
    """A run that Postgres cannot store as it is (e.g. a NUL character in its request's text)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_REQUEST, message)


@dataclass(frozen=True)
class NewRun:
    """A run to create (see :meth:`PostgresRunStore.create_runs`)."""

    run_id: str
    tenant: str
    owner: str
    request: dict[str, Any]
    plan: list[PlanStep]


def _submitted(plan: list[PlanStep] | None) -> dict[str, Any]:
    """The payload of a run's first event: its state, and the plan's shape if it has one (its
    inputs are in the run's record, once)."""
    submitted: dict[str, Any] = {"state": RunState.SUBMITTED.value}
    if plan is not None:
        submitted["steps"] = [_outline(step) for step in plan]
    return submitted


async def _create(
    conn: psycopg.AsyncConnection[Any],
    run_id: str,
    tenant: str,
    owner: str,
    recorded: dict[str, Any],
    plan: list[PlanStep] | None,
) -> Run | None:
    """Insert the run (with its request as ``recorded``: redacted) and its first events in the
    caller's transaction; None if it exists."""
    events: list[tuple[str, dict[str, Any]]] = [(EventType.RUN_SUBMITTED, _submitted(plan))]
    cursor = conn.cursor(row_factory=dict_row)
    await cursor.execute(
        "INSERT INTO fleet_runs.runs (run_id, tenant, owner, state, request, plan, last_seq)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (run_id) DO NOTHING"
        f" RETURNING {_RUN_COLUMNS}",
        (
            run_id,
            tenant,
            owner,
            RunState.SUBMITTED.value,
            Jsonb(recorded),  # kept for the record, redacted; the plan runs as given
            Jsonb(plan or []),
            len(events),
        ),
    )
    row = await cursor.fetchone()
    if row is None:
        return None
    for seq, (type_, payload) in enumerate(events, start=1):
        await conn.execute(
            "INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload) VALUES (%s, %s, %s, %s, %s)",
            (run_id, seq, type_, owner, Jsonb(logged(payload))),
        )
    await conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, run_id))
    return _run(row)


async def hand_back(
    conn: psycopg.AsyncConnection[Any],
    run_id: str,
    seq: int,
    type_: EventType,
    actor: str,
    payload: Mapping[str, Any],
    *,
    answer: tuple[str, Mapping[str, Any]] | None = None,
) -> None:
    """Move a waiting run (whose row the caller has locked, last event ``seq - 1``) back to
    ``submitted`` for the workers, clearing its wait and keeping ``answer`` (awaited, answer) if
    given, with the event ``type_`` at ``seq``: in the caller's transaction."""
    if answer is None:
        await conn.execute(
            "UPDATE fleet_runs.runs SET state = 'submitted', wait = NULL, last_seq = %s, updated_at = now()"
            " WHERE run_id = %s",
            (seq, run_id),
        )
    else:
        await conn.execute(
            "UPDATE fleet_runs.runs SET state = 'submitted', wait = NULL, last_seq = %s, updated_at = now(),"
            " answers = answers || jsonb_build_object(%s::text, %s::jsonb) WHERE run_id = %s",
            (seq, answer[0], Jsonb(dict(answer[1])), run_id),
        )
    await conn.execute(
        "INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload) VALUES (%s, %s, %s, %s, %s)",
        (run_id, seq, type_, actor, Jsonb(logged(payload))),
    )
    await conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, run_id))


def wait_requests(wait: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What a wait record waits for, one request per interrupt: the first is the record's own
    ``ON_THE_WAIT`` fields (its deadline as extended, if it was) with its ``detail``, and
    ``detail.others`` are the rest (parallel steps may each wait). A record without ``detail`` is
    its own request."""
    detail = wait.get("detail")
    if not isinstance(detail, Mapping) or not detail:
        return [dict(wait)]
    if isinstance(detail.get("requests"), list):  # a record written before 2026-12 held them all
        return [dict(r) for r in detail["requests"]]
    first = {key: value for key, value in detail.items() if key != "others"}
    first.update({key: wait[key] for key in ON_THE_WAIT if wait.get(key) is not None})
    return [first, *(dict(r) for r in detail.get("others") or [])]


# The gates whose request says what the step asked (``detail.asked``): the rest of the result of the
# operation that asked (``detail.op_id``), which the ledger keeps.
GATE_WAITS = ("approval", "input")


def stored_wait(wait: Mapping[str, Any]) -> dict[str, Any]:
    """A wait record as the run's row keeps it: what a gate asked is left out, since the ledger
    holds it (the result of the operation that asked, less the why, ``status`` and
    ``user_input_required``: see :func:`coordinator.engine.graph.gate_of`), and every read of the
    run (``fleet_runs.wait_of``) puts it back from there. About 400 bytes of a parked run's row."""
    detail = wait.get("detail")
    if (
        wait.get("type") not in GATE_WAITS
        or not isinstance(detail, Mapping)
        or not isinstance(detail.get("op_id"), str)
        or "asked" not in detail
    ):
        return dict(wait)
    return {**wait, "detail": {k: v for k, v in detail.items() if k != "asked"}}


def _awaits(wait: dict[str, Any], wait_type: str, awaited: str | None) -> bool:
    """Whether a wait record awaits ``awaited`` (of ``wait_type``), or, without one, is of that type."""
    if awaited is None:
        return wait.get("type") == wait_type
    requests = wait_requests(wait)
    return any(r.get("type") == wait_type and r.get("awaited") == awaited for r in requests)


def logged(payload: Mapping[str, Any]) -> dict[str, Any]:
    """An event payload as the log keeps it: secrets redacted, and how many said."""
    clean, count = redact(dict(payload))
    return {**clean, "redacted": count} if count else clean


def _run(row: Mapping[str, Any]) -> Run:
    return Run(
        run_id=row["run_id"],
        tenant=row["tenant"],
        owner=row["owner"],
        state=RunState(row["state"]),
        reason=row["reason"],
        request=row["request"],
        plan=row["plan"],
        last_seq=row["last_seq"],
        lease_epoch=row["lease_epoch"],
        cancel_requested=row["cancel_requested"],
        wait=row["wait"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        answers=row["answers"] or {},
    )


_OWNED = " AND (%s::text IS NULL OR owner = %s)"  # a caller's reach: its own runs, or (None) all


class PostgresRunStore:
    """Runs and their events on Postgres. Every read takes the caller's tenant: a run of another tenant
    is indistinguishable from a run that does not exist. Reads for a caller also take its ``owner``
    reach (see :mod:`coordinator.record.access`): with an owner, another principal's run of the same
    tenant is just as unknown; None reaches every run of the tenant.

    The pool's connections should be in autocommit mode: every write is then one statement and one
    commit (multi-statement writes open their own transaction)."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool

    async def setup(self) -> None:
        """Create the schema (idempotent; several processes may call it at once)."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.runs.schema'))")
            await conn.execute(SCHEMA)

    async def census(self) -> list[tuple[str, str | None, int]]:
        """How many runs of all tenants are in each state (and, waiting, each wait type): counts
        only, for the fleet's metrics."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT state, wait->>'type', count(*) FROM fleet_runs.runs GROUP BY 1, 2"
            )
            return [(str(state), wait_type, int(n)) for state, wait_type, n in await cursor.fetchall()]

    async def create_run(
        self,
        run_id: str,
        tenant: str,
        owner: str,
        request: dict[str, Any],
        plan: list[PlanStep] | None = None,
        grant: str | None = None,
    ) -> Run:
        """Create the run in state ``submitted`` with its first events (submitted, and the plan if
        there is one), and its caller's ``grant`` if it has one (see :mod:`coordinator.grants`);
        idempotent for one run id."""
        recorded = (await redact_async(request))[0]  # before the transaction: a large text takes a while
        async with self._pool.connection() as conn, conn.transaction():
            created = await _create(conn, run_id, tenant, owner, recorded, plan)
            if created is not None and grant is not None:
                await conn.execute(
                    "INSERT INTO fleet_runs.run_grants (run_id, grant_token) VALUES (%s, %s)",
                    (run_id, pack_grant(grant)),
                )
        return created or await self.get_run(run_id, tenant)

    async def create_runs(self, runs: list[NewRun]) -> set[str]:
        """Create many runs (each as :meth:`create_run` would, with no grant) in one transaction
        of a few round trips: the ids of the runs created (the others existed already). All or
        none: a failure creates none of them; :class:`Unstorable` if what one of them holds cannot
        be stored."""
        if not runs:
            return set()
        recorded = [(await redact_async(run.request))[0] for run in runs]
        try:
            return await self._insert_runs(runs, recorded)
        except psycopg.DataError as exc:  # what a run holds, not the database: it fails every time
            what = exc.diag.message_primary or str(exc)
            raise Unstorable(f"a run cannot be stored as it is ({what})") from exc

    async def _insert_runs(self, runs: list[NewRun], recorded: list[dict[str, Any]]) -> set[str]:
        # One statement per table (arrays unnested), not one per run: three round trips for any number.
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "INSERT INTO fleet_runs.runs (run_id, tenant, owner, state, request, plan, last_seq)"
                " SELECT id, tenant, owner, %s, request, plan, 1"
                " FROM unnest(%s::text[], %s::text[], %s::text[], %s::jsonb[], %s::jsonb[])"
                "  AS r(id, tenant, owner, request, plan)"
                " ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
                (
                    RunState.SUBMITTED.value,
                    [run.run_id for run in runs],
                    [run.tenant for run in runs],
                    [run.owner for run in runs],
                    [Jsonb(r) for r in recorded],
                    [Jsonb(run.plan) for run in runs],
                ),
            )
            created = {str(row[0]) for row in await cursor.fetchall()}
            new = [run for run in runs if run.run_id in created]
            if new:
                await conn.execute(
                    "INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload)"
                    " SELECT id, 1, %s, actor, payload FROM unnest(%s::text[], %s::text[], %s::jsonb[])"
                    "  AS e(id, actor, payload)",
                    (
                        EventType.RUN_SUBMITTED,
                        [run.run_id for run in new],
                        [run.owner for run in new],
                        [Jsonb(logged(_submitted(run.plan))) for run in new],
                    ),
                )
                await conn.execute(
                    "SELECT pg_notify(%s, id) FROM unnest(%s::text[]) AS id",
                    (NOTIFY_CHANNEL, [run.run_id for run in new]),
                )
        return created

    async def run_grant(self, run_id: str) -> str | None:
        """The grant of the caller who started ``run_id``; None for a run no caller started."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT grant_token FROM fleet_runs.run_grants WHERE run_id = %s", (run_id,)
            )
            row = await cursor.fetchone()
        return unpack_grant(row[0]) if row is not None else None

    async def add_batch_item(
        self,
        run_id: str,
        tenant: str,
        owner: str,
        request: dict[str, Any],
        plan: list[PlanStep],
        event_id: str,
        item: dict[str, Any],
    ) -> tuple[bool, bool]:
        """Add an event's item to the batch run ``run_id`` (created with ``plan`` if it is the
        first): (whether the run was created, whether the item is new). One transaction, under the
        run's row lock, so an item is either in the batch when it closes or refused:
        :class:`BatchClosed` once it has (see :meth:`close_batch`)."""
        recorded = (await redact_async(request))[0]
        async with self._pool.connection() as conn, conn.transaction():
            created = await _create(conn, run_id, tenant, owner, recorded, plan) is not None
            cursor = await conn.execute(
                "SELECT batch_closed_at, state, updated_at FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s"
                " FOR UPDATE",
                (run_id, tenant),
            )
            row = await cursor.fetchone()
            if row is None:
                raise RunNotFound(run_id)  # the id is another tenant's: never add to it
            if row[0] is not None or RunState(row[1]).terminal:  # closed, or the run ended (e.g. canceled)
                raise BatchClosed(run_id, row[0] or row[2])
            cursor = await conn.execute(
                "INSERT INTO fleet_runs.batch_items (run_id, event_id, item) VALUES (%s, %s, %s)"
                " ON CONFLICT (run_id, event_id) DO NOTHING RETURNING n",
                (run_id, event_id, Jsonb(item)),
            )
            added = await cursor.fetchone() is not None
        return created, added

    async def request_batch_close(self, run_id: str, tenant: str) -> bool:
        """Close the batch of ``run_id`` (of ``tenant``) to new items, if its collection has not
        finished; whether it had not (its collection wait is then to be answered: the caller does
        that). Idempotent."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "UPDATE fleet_runs.runs SET batch_closed_at = COALESCE(batch_closed_at, now())"
                " WHERE run_id = %s AND tenant = %s"
                " AND state NOT IN ('completed', 'failed', 'canceled', 'rejected')"
                " AND NOT EXISTS (SELECT 1 FROM fleet_runs.events e WHERE e.run_id = runs.run_id"
                " AND e.type = 'batch.closed') RETURNING run_id",
                (run_id, tenant),
            )
            return await cursor.fetchone() is not None

    async def batch_size(self, run_id: str, tenant: str) -> int:
        """How many items the batch of ``run_id`` (of ``tenant``) holds (0 if there is no such run)."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT count(*) FROM fleet_runs.batch_items b JOIN fleet_runs.runs r USING (run_id)"
                " WHERE b.run_id = %s AND r.tenant = %s",
                (run_id, tenant),
            )
            row = await cursor.fetchone()
            return int(row[0]) if row else 0

    async def close_batch(self, run_id: str) -> list[dict[str, Any]]:
        """Close the batch of ``run_id`` (no item is added after this) and return its items in the
        order they came. Idempotent: closing again returns the same items."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "UPDATE fleet_runs.runs SET batch_closed_at = COALESCE(batch_closed_at, now())"
                " WHERE run_id = %s",
                (run_id,),
            )
            cursor = await conn.execute(
                "SELECT item FROM fleet_runs.batch_items WHERE run_id = %s ORDER BY n", (run_id,)
            )
            return [row[0] for row in await cursor.fetchall()]

    async def get_run(self, run_id: str, tenant: str, *, owner: str | None = None) -> Run:
        """The run, if ``tenant`` has it (and ``owner`` started it, if given); else :class:`RunNotFound`."""
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                f"SELECT {_RUN_COLUMNS} FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s{_OWNED}",
                (run_id, tenant, owner, owner),
            )
            row = await cursor.fetchone()
        if row is None:
            raise RunNotFound(run_id)
        return _run(row)

    async def get_run_for_worker(self, run_id: str) -> Run:
        """A run whatever its tenant: for workers, which take run ids from the work queue only."""
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(f"SELECT {_RUN_COLUMNS} FROM fleet_runs.runs WHERE run_id = %s", (run_id,))
            row = await cursor.fetchone()
        if row is None:
            raise RunNotFound(run_id)
        return _run(row)

    async def stranded_runs(self, older_than_s: float, limit: int = 100) -> list[tuple[str, int]]:
        """(run id, last seq) of unfinished runs that no worker holds and that have not moved for
        ``older_than_s``: their work message may have been lost (a submit that failed, a queue
        that was purged). For workers only."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT run_id, last_seq FROM fleet_runs.runs"
                " WHERE state IN ('submitted', 'working')"
                " AND (lease_owner IS NULL OR lease_expires_at < now())"
                " AND updated_at < now() - make_interval(secs => %s)"
                " ORDER BY updated_at LIMIT %s",
                (older_than_s, limit),
            )
            return [(str(row[0]), int(row[1])) for row in await cursor.fetchall()]

    async def list_runs(
        self, tenant: str, limit: int = 50, state: RunState | None = None, *, owner: str | None = None
    ) -> list[Run]:
        """The tenant's newest runs (only those in ``state``, and ``owner``'s, if given)."""
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                f"SELECT {_RUN_COLUMNS} FROM fleet_runs.runs WHERE tenant = %s{_OWNED}"
                " AND (%s::text IS NULL OR state = %s) ORDER BY created_at DESC LIMIT %s",
                (tenant, owner, owner, state and state.value, state and state.value, limit),
            )
            return [_run(row) for row in await cursor.fetchall()]

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> Lease | None:
        """Take the run's lease if it is free or expired; each grant bumps the fencing epoch."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "UPDATE fleet_runs.runs SET lease_owner = %s, lease_epoch = lease_epoch + 1,"
                " lease_expires_at = now() + make_interval(secs => %s)"
                " WHERE run_id = %s AND (lease_owner IS NULL OR lease_expires_at < now())"
                " AND state NOT IN ('completed', 'failed', 'canceled', 'rejected')"
                " RETURNING lease_epoch",
                (owner, ttl_s, run_id),
            )
            row = await cursor.fetchone()
        return Lease(run_id, owner, int(row[0])) if row else None

    async def renew_lease(self, lease: Lease, ttl_s: float) -> bool:
        """Extend the lease; return whether the run has been asked to cancel."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "UPDATE fleet_runs.runs SET lease_expires_at = now() + make_interval(secs => %s)"
                " WHERE run_id = %s AND lease_epoch = %s RETURNING cancel_requested",
                (ttl_s, lease.run_id, lease.epoch),
            )
            row = await cursor.fetchone()
        if row is None:
            raise StaleLease(lease.run_id)
        return bool(row[0])

    async def request_cancel(self, run_id: str, tenant: str, actor: str, *, owner: str | None = None) -> Run:
        """Ask for the run to be canceled (idempotent; a finished run is left as it is). The event
        is recorded at once; the worker advancing the run stops at its next write or heartbeat.
        Callers come through :meth:`coordinator.control.signals.SignalDesk.apply` (policy decides)."""
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "SELECT last_seq, lease_owner IS NOT NULL AND lease_expires_at >= now() AND state <> 'waiting'"
                " FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s AND NOT cancel_requested"
                f" AND state NOT IN ('completed', 'failed', 'canceled', 'rejected'){_OWNED} FOR UPDATE",
                (run_id, tenant, owner, owner),
            )
            row = await cursor.fetchone()
            if row is not None:
                await self._record_cancel(conn, run_id, int(row[0]), actor, leased=bool(row[1]))
        return await self.get_run(run_id, tenant, owner=owner)

    @staticmethod
    async def _record_cancel(
        conn: psycopg.AsyncConnection[Any], run_id: str, last_seq: int, actor: str, *, leased: bool
    ) -> None:
        """With a worker on the run, flag it (the worker stops and records the end); with none, end
        the run here, bumping the epoch so that a worker arriving late cannot write."""
        events: list[tuple[str, dict[str, Any]]] = [(EventType.RUN_CANCEL_REQUESTED, {})]
        if leased:
            await conn.execute(
                "UPDATE fleet_runs.runs SET cancel_requested = true, last_seq = %s, updated_at = now()"
                " WHERE run_id = %s",
                (last_seq + 1, run_id),
            )
        else:
            events.append(
                (
                    EventType.RUN_CANCELED,
                    {"state": "canceled", "reason": "canceled", "text": "canceled on request"},
                )
            )
            await conn.execute(
                "UPDATE fleet_runs.runs SET cancel_requested = true, last_seq = %s, updated_at = now(),"
                " state = 'canceled', reason = 'canceled', lease_epoch = lease_epoch + 1,"
                " lease_owner = NULL, lease_expires_at = NULL WHERE run_id = %s",
                (last_seq + 2, run_id),
            )
        for offset, (type_, payload) in enumerate(events, start=1):
            await conn.execute(
                "INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload) VALUES (%s, %s, %s, %s, %s)",
                (run_id, last_seq + offset, type_, actor, Jsonb(payload)),
            )
        await conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, run_id))

    async def answer_wait(
        self,
        run_id: str,
        tenant: str,
        wait_type: str,
        answer: Mapping[str, Any],
        actor: str,
        *,
        event: EventType = EventType.WAIT_ANSWERED,
        text: str = "",
        awaited: str | None = None,
        only_if_due: bool = False,
    ) -> int:
        """Record the answer to what a waiting run awaits, and hand the run back to the workers
        (it goes to ``submitted``; the caller submits it): one transaction, under the run's row
        lock, so concurrent answers are serialised and only the first one counts. Return the seq
        of the event. Raise ``conflict`` if the run does not wait for a ``wait_type`` (or, with
        ``only_if_due``, if its deadline has not passed: it was extended meanwhile)."""
        async with self._pool.connection() as conn, conn.transaction():
            due = " AND (wait->>'deadline')::timestamptz <= now()" if only_if_due else ""
            cursor = await conn.execute(
                "SELECT last_seq, wait FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s"
                f" AND state = 'waiting'{due} FOR UPDATE",
                (run_id, tenant),
            )
            row = await cursor.fetchone()
            wait = row[1] if row is not None else None
            if row is None or not isinstance(wait, dict) or not _awaits(wait, wait_type, awaited):
                raise FleetError(
                    ErrorCode.CONFLICT, f"run {run_id} is not waiting for a {wait_type} decision"
                )
            seq, awaited = int(row[0]) + 1, awaited or str(wait.get("awaited"))
            recorded = {**answer, "by": actor}
            shown = {k: v for k, v in recorded.items() if k != "grant"}  # a credential: not in the log
            payload = {"awaited": awaited, **shown, "state": RunState.SUBMITTED.value}
            payload["text"] = text or f"{actor} answered {awaited}: {answer.get('decision', '')}"
            await hand_back(conn, run_id, seq, event, actor, payload, answer=(awaited, recorded))
        return seq

    async def extend_wait(self, run_id: str, tenant: str, awaited: str, extend_s: float, actor: str) -> int:
        """Move the deadline (and the warning) of what a waiting run awaits ``extend_s`` seconds
        later, under the run's row lock; the seq of the ``wait.extended`` event. Raise ``conflict``
        if the run does not wait for ``awaited``."""
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "SELECT last_seq, wait FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s"
                " AND state = 'waiting' FOR UPDATE",
                (run_id, tenant),
            )
            row = await cursor.fetchone()
            wait = row[1] if row is not None else None
            if row is None or not isinstance(wait, dict) or wait.get("awaited") != awaited:
                raise FleetError(ErrorCode.CONFLICT, f"run {run_id} is not waiting for {awaited}")
            step = dt.timedelta(seconds=extend_s)
            now = dt.datetime.now(dt.UTC)
            deadline = max(dt.datetime.fromisoformat(wait["deadline"]), now) if wait.get("deadline") else now
            moved = {**wait, "deadline": (deadline + step).isoformat()}
            if wait.get("warn_at"):
                moved["warn_at"] = (dt.datetime.fromisoformat(wait["warn_at"]) + step).isoformat()
            moved.pop("warned", None)
            seq = int(row[0]) + 1
            await conn.execute(
                "UPDATE fleet_runs.runs SET wait = %s, last_seq = %s, updated_at = now() WHERE run_id = %s",
                (Jsonb(moved), seq, run_id),
            )
            payload = {
                "awaited": awaited,
                "deadline": moved["deadline"],
                "by": actor,
                "text": f"{actor} extended the deadline of {awaited} to {moved['deadline']}",
            }
            await conn.execute(
                "INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload) VALUES (%s, %s, %s, %s, %s)",
                (run_id, seq, EventType.WAIT_EXTENDED, actor, Jsonb(logged(payload))),
            )
            await conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, run_id))
        return seq

    async def awaiting_events(
        self, keys: list[tuple[str, str, str, str]]
    ) -> dict[tuple[str, str, str, str], list[tuple[str, str]]]:
        """For each (tenant, subject, type, source) of ``keys``: (run id, awaited) of the tenant's
        runs that wait for an event on the logical ``subject`` (of that type and from that source,
        if their wait names them). For the trigger ingest, which passes the tenant and source of
        each event's NATS subject. One statement (a burst of events mostly shares one key: each
        distinct key is asked once)."""
        distinct = list(dict.fromkeys(keys))
        found: dict[tuple[str, str, str, str], list[tuple[str, str]]] = {key: [] for key in distinct}
        if not distinct:
            return found
        columns = [list(column) for column in zip(*distinct, strict=True)]
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT q.i, runs.run_id, r->>'awaited'"
                " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) WITH ORDINALITY"
                "  AS q(tenant, subject, event_type, source, i)"
                " JOIN fleet_runs.runs ON runs.tenant = q.tenant AND runs.state = 'waiting'"
                # the requests of the wait record (see wait_requests): its detail, then the others
                " CROSS JOIN LATERAL jsonb_array_elements(jsonb_build_array(COALESCE(wait->'detail', '{}')"
                "  || jsonb_build_object('type', wait->'type', 'awaited', wait->'awaited'))"
                "  || COALESCE(wait->'detail'->'others', wait->'detail'->'requests', '[]')) AS r"
                " WHERE r->>'type' = 'event' AND r->>'subject' = q.subject"
                " AND (r->>'event_type' IS NULL OR r->>'event_type' = q.event_type)"
                " AND (r->>'event_source' IS NULL OR r->>'event_source' = q.source)",
                columns,
            )
            for i, run_id, awaited in await cursor.fetchall():
                found[distinct[int(i) - 1]].append((str(run_id), str(awaited)))
        return found

    async def waits_due(self, limit: int = 100) -> list[Run]:
        """Waiting runs whose deadline has passed, or whose warning is due and not yet given. For
        the supervisor only (every tenant)."""
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                f"SELECT {_RUN_COLUMNS} FROM fleet_runs.runs WHERE state = 'waiting' AND ("
                " (wait->>'deadline')::timestamptz < now()"
                " OR ((wait->>'warn_at')::timestamptz < now() AND NOT (wait ? 'warned')))"
                " LIMIT %s",
                (limit,),
            )
            return [_run(row) for row in await cursor.fetchall()]

    async def warn_wait(self, run_id: str, actor: str) -> int | None:
        """Record, once, that a waiting run's deadline is near; the seq of the event, or None if
        it was given already (or the run no longer waits)."""
        async with self._pool.connection() as conn, conn.transaction():
            cursor = await conn.execute(
                "UPDATE fleet_runs.runs SET wait = wait || '{\"warned\": true}', last_seq = last_seq + 1,"
                " updated_at = now() WHERE run_id = %s AND state = 'waiting' AND NOT (wait ? 'warned')"
                " RETURNING last_seq, wait",
                (run_id,),
            )
            row = await cursor.fetchone()
            if row is None:
                return None
            seq, wait = int(row[0]), row[1]
            payload = {
                "awaited": wait.get("awaited"),
                "deadline": wait.get("deadline"),
                "text": f"still waiting for {wait.get('awaited')}: the deadline is {wait.get('deadline')}",
            }
            await conn.execute(
                "INSERT INTO fleet_runs.events (run_id, seq, type, actor, payload) VALUES (%s, %s, %s, %s, %s)",
                (run_id, seq, EventType.WAIT_DEADLINE_NEAR, actor, Jsonb(logged(payload))),
            )
            await conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, run_id))
        return seq

    async def release_lease(self, lease: Lease) -> None:
        async with self._pool.connection() as conn:
            await conn.execute(
                "UPDATE fleet_runs.runs SET lease_owner = NULL, lease_expires_at = NULL"
                " WHERE run_id = %s AND lease_epoch = %s",
                (lease.run_id, lease.epoch),
            )

    async def append(
        self,
        lease: Lease,
        type_: EventType,
        actor: str,
        payload: Mapping[str, Any],
        *,
        durable: bool = True,
    ) -> int:
        """Append one event under ``lease``; return its sequence number.

        ``durable=False`` is for progress events: the commit returns before the WAL is flushed
        (Postgres flushes it within ~200 ms, and any later durable write flushes it first). A crash
        of Postgres itself can lose the last such events, never a gap and never a transition.
        """
        async with self._pool.connection() as conn:
            seq, cancel_requested = await fenced_append(conn, lease, type_, actor, payload, durable=durable)
        if cancel_requested:
            raise CancelRequested(lease.run_id)
        return seq

    async def transition(
        self,
        lease: Lease,
        state: RunState,
        actor: str,
        payload: Mapping[str, Any],
        reason: str | None = None,
        wait: Mapping[str, Any] | None = None,
    ) -> int:
        """Move the run to ``state`` and record it as an event, atomically. ``wait`` is the wait
        record of a run that goes to ``waiting``; any other transition clears it. The event keeps
        what the wait is (type, awaited, since, deadline); the record itself is on the run."""
        summary = {k: wait[k] for k in WAIT_SUMMARY if wait.get(k) is not None} if wait else None
        event = {
            "state": state.value,
            **({"reason": reason} if reason else {}),
            **({"wait": summary} if summary else {}),
            **payload,
        }
        async with self._pool.connection() as conn:
            seq, _ = await fenced_append(
                conn, lease, EventType.of_state(state), actor, event, state, reason, wait=wait
            )
        return seq

    async def events_after(
        self, run_id: str, tenant: str, after_seq: int, limit: int = 500, *, owner: str | None = None
    ) -> list[RunEvent]:
        """Events of the run with ``seq > after_seq``, in order (tenant- and owner-checked; none
        for a run the tenant, or ``owner``, does not have)."""
        try:
            events, _, _ = await self._page_and_state(run_id, tenant, after_seq, limit, owner)
        except RunNotFound:
            return []
        return events

    async def follow(
        self, run_id: str, tenant: str, after_seq: int, notifier: RunNotifier, *, owner: str | None = None
    ) -> AsyncIterator[RunEvent]:
        """Every event after ``after_seq``, then new ones as they are committed, until the run ends.

        ``notifier`` (the process's one ``LISTEN`` connection) only wakes the reader; the events
        always come from the table, so a missed or duplicated notification never loses or repeats
        an event.
        """
        with notifier.watch(run_id) as wakeup:
            cursor = after_seq
            while True:
                wakeup.arm()  # before reading: a commit after the read wakes the wait below
                page, state, last_seq = await self._page_and_state(run_id, tenant, cursor, FOLLOW_PAGE, owner)
                for event in page:
                    cursor = event.seq
                    yield event
                if len(page) == FOLLOW_PAGE:
                    continue  # a backlog: read on before waiting for news
                if state.terminal and cursor >= last_seq:
                    return
                await wakeup.wait(FOLLOW_POLL_S)

    async def _page_and_state(
        self, run_id: str, tenant: str, after_seq: int, limit: int, owner: str | None
    ) -> tuple[list[RunEvent], RunState, int]:
        """Events after ``after_seq`` (at most ``limit``), and the run's state and last seq, read in
        one statement (one snapshot: a run that ended with no event past the page has ended for
        the reader). :class:`RunNotFound` if the tenant (and ``owner``) has no such run."""
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                "SELECT r.state AS run_state, r.last_seq AS run_last_seq,"
                " e.run_id, e.seq, e.type, e.ts, e.actor, e.payload FROM fleet_runs.runs r"
                " LEFT JOIN LATERAL (SELECT * FROM fleet_runs.events x WHERE x.run_id = r.run_id"
                " AND x.seq > %s ORDER BY x.seq LIMIT %s) e ON true"
                " WHERE r.run_id = %s AND r.tenant = %s AND (%s::text IS NULL OR r.owner = %s)"
                " ORDER BY e.seq",
                (after_seq, limit, run_id, tenant, owner, owner),
            )
            rows = await cursor.fetchall()
        if not rows:
            raise RunNotFound(run_id)
        state, last_seq = RunState(rows[0]["run_state"]), int(rows[0]["run_last_seq"])
        events = [
            RunEvent(**{k: v for k, v in row.items() if not k.startswith("run_") or k == "run_id"})
            for row in rows
            if row["seq"] is not None
        ]
        return events, state, last_seq


def event_json(event: RunEvent) -> str:
    return json.dumps(event.to_json(), separators=(",", ":"))
