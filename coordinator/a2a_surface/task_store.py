"""The A2A task store of the coordinator: tasks derived from the runs in Postgres.

A task is its run (the task id is the run id), seen through :class:`~coordinator.a2a_surface.task_events.TaskFold`:
its status, messages and artifacts are a fold over the run's event log. Nothing the SDK saves can
drift from what the workers record, and a restarted coordinator (or another replica) answers
``GetTask``, ``ListTasks`` and ``SubscribeToTask`` from the same rows. The only A2A facts the log does
not hold are kept in ``fleet_runs.a2a_tasks``: the context id and the request message (written by
:meth:`PostgresTaskStore.save`, the first time the SDK saves the task), and, once retention has pruned
a finished run's older events, the task folded up to the last pruned event.

Every read takes the caller's tenant from the verified token, and its reach from the policy
``fleet.runs.access`` (see :mod:`coordinator.record.access`), and filters on both in SQL: another tenant's
task, or another principal's without a tenant-wide reach, is indistinguishable from one that does
not exist.

A2A context ids belong to the principal (tenant and subject) whose task first used them
(``fleet_runs.a2a_contexts``): a new task that names a context another principal or tenant made is
refused with ``context_refused`` (:meth:`PostgresTaskStore.claim_context`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.tasks import TaskStore
from a2a.types import ListTasksRequest, ListTasksResponse, Message, Task, TaskState
from a2a.utils.constants import DEFAULT_LIST_TASKS_PAGE_SIZE
from a2a.utils.errors import InvalidParamsError
from a2a.utils.task import ListTasksCursor, decode_list_tasks_cursor, encode_list_tasks_cursor
from google.protobuf.json_format import MessageToDict, ParseDict
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.a2a_surface.task_events import A2A_STATE, TaskFold, initial_task
from coordinator.record.access import Reach, RunAccess, RunAction
from coordinator.record.runs import TERMINAL_STATES, PostgresRunStore, RunEvent
from fleet.a2a_support import a2a_error, claims_of
from fleet.errors import ErrorCode, FleetError

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_runs.a2a_tasks (
    task_id      text PRIMARY KEY REFERENCES fleet_runs.runs (run_id) ON DELETE CASCADE,
    context_id   text NOT NULL,
    message      jsonb,
    snapshot     jsonb,
    snapshot_seq bigint NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS a2a_tasks_by_context ON fleet_runs.a2a_tasks (context_id);
CREATE TABLE IF NOT EXISTS fleet_runs.a2a_contexts (
    context_id text PRIMARY KEY,
    tenant     text NOT NULL,
    owner      text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""

# A context is claimed by its first task's principal, unless a task recorded before contexts were
# owned (no row here yet) shows that someone else used it first.
_CLAIM_CONTEXT = """
INSERT INTO fleet_runs.a2a_contexts (context_id, tenant, owner)
SELECT %(context)s, %(tenant)s, %(owner)s WHERE NOT EXISTS (
    SELECT 1 FROM fleet_runs.a2a_tasks t JOIN fleet_runs.runs r ON r.run_id = t.task_id
    WHERE t.context_id = %(context)s AND (r.tenant <> %(tenant)s OR r.owner <> %(owner)s)
)
ON CONFLICT (context_id) DO NOTHING
"""

_TASK_ROWS = """
SELECT r.run_id, r.last_seq, r.updated_at, t.context_id, t.message, t.snapshot,
       COALESCE(t.snapshot_seq, 0) AS snapshot_seq
FROM fleet_runs.runs r LEFT JOIN fleet_runs.a2a_tasks t ON t.task_id = r.run_id
"""

_EVENTS_OF_PAGE = """
SELECT e.run_id, e.seq, e.type, e.ts, e.actor, e.payload
FROM fleet_runs.events e
JOIN fleet_runs.runs r USING (run_id)
LEFT JOIN fleet_runs.a2a_tasks t ON t.task_id = e.run_id
WHERE e.run_id = ANY(%s) AND r.tenant = %s AND e.seq > COALESCE(t.snapshot_seq, 0)
ORDER BY e.run_id, e.seq
"""

_TERMINAL_NAMES = [state.value for state in TERMINAL_STATES]
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
PAGE = 500
# SQL clauses and their arguments (module-level: inside the store, ``list`` is a method).
Clauses = list[str]
Arguments = list[Any]


def _base_fold(row: Mapping[str, Any]) -> TaskFold:
    """The fold before the first event still in the log: the retained snapshot, or the new task."""
    if row["snapshot"] is not None:
        return TaskFold(ParseDict(row["snapshot"], Task()), int(row["snapshot_seq"]))
    message = ParseDict(row["message"], Message()) if row["message"] is not None else None
    # A task whose A2A record was never written (the API died between creating the run and the
    # SDK's first save) still shows: it is its own context.
    return TaskFold(initial_task(row["run_id"], row["context_id"] or row["run_id"], message))


def _states_for(status: TaskState) -> list[str]:
    return [run.value for run, a2a in A2A_STATE.items() if a2a == status]


def _ns(moment: dt.datetime) -> int:
    return (moment - _EPOCH) // dt.timedelta(microseconds=1) * 1000


RECORDED_KEPT = 10_000


class PostgresTaskStore(TaskStore):
    """A2A tasks as folds over the run store's rows (see the module docstring)."""

    def __init__(self, pool: AsyncConnectionPool[Any], runs: PostgresRunStore, access: RunAccess) -> None:
        self._pool = pool
        self._runs = runs
        self._access = access
        # Tasks this process recorded: the SDK saves a task at every event it relays, and only the
        # first save writes anything (the newest RECORDED_KEPT, oldest forgotten first).
        self._recorded: dict[str, None] = {}

    async def reach(self, context: ServerCallContext | None, action: RunAction = RunAction.READ) -> Reach:
        """The caller's reach for ``action``; a principal policy refuses outright gets
        ``InvalidParamsError`` with the ``forbidden`` code."""
        try:
            return await self._access.reach(claims_of(context), action)
        except FleetError as exc:
            raise a2a_error(exc, InvalidParamsError) from exc

    async def claim_context(self, context_id: str, tenant: str, owner: str) -> None:
        """Make ``context_id`` the principal's (``tenant``, ``owner``) if nobody has it yet; raise
        ``context_refused`` if another principal or tenant made it."""
        async with self._pool.connection() as conn, conn.transaction():
            args = {"context": context_id, "tenant": tenant, "owner": owner}
            await conn.execute(_CLAIM_CONTEXT, args)
            cursor = await conn.execute(
                "SELECT tenant, owner FROM fleet_runs.a2a_contexts WHERE context_id = %s", (context_id,)
            )
            row = await cursor.fetchone()
        if row is None or (str(row[0]), str(row[1])) != (tenant, owner):
            raise FleetError(
                ErrorCode.CONTEXT_REFUSED,
                f"context {context_id} belongs to another principal: a new task may continue only a "
                "context its own principal made (leave context_id out to start a new one)",
            )

    async def setup(self) -> None:
        """Create the table (idempotent); the run store's ``setup`` must have run first."""
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.a2a_tasks.schema'))")
            await conn.execute(SCHEMA)

    async def save(self, task: Task, context: ServerCallContext) -> None:
        """Record what the log does not hold: the context id and the request (first save wins).

        Status and artifacts are not saved: they are folded from the run's events on every read. A
        task whose run does not exist (a request refused before its run was created) is not
        recorded, so it stays unknown."""
        if task.id in self._recorded:
            return
        message = MessageToDict(task.history[0]) if task.history else None
        claims = claims_of(context)
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "INSERT INTO fleet_runs.a2a_tasks (task_id, context_id, message)"
                " SELECT run_id, %s, %s FROM fleet_runs.runs WHERE run_id = %s AND tenant = %s AND owner = %s"
                " ON CONFLICT (task_id) DO NOTHING",
                (task.context_id, Jsonb(message) if message else None, task.id, claims.tenant, claims.sub),
            )
        if cursor.rowcount == 1:  # not when its run does not exist (or another process recorded it)
            self._recorded[task.id] = None
            if len(self._recorded) > RECORDED_KEPT:
                del self._recorded[next(iter(self._recorded))]

    async def get(self, task_id: str, context: ServerCallContext) -> Task | None:
        """The task if the caller reaches it (``fleet.runs.access``, action ``read``): None, as for
        a task that does not exist, otherwise."""
        reach = await self.reach(context)
        fold = await self.fold(task_id, reach.tenant, owner=reach.owner)
        return fold.task if fold is not None else None

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        """Tasks are runs, and runs are kept: nothing is deleted through A2A."""

    async def fold(
        self, task_id: str, tenant: str, upto: int | None = None, *, owner: str | None = None
    ) -> TaskFold | None:
        """The task folded from its events up to event ``upto`` (all of them if None); None if the
        tenant has no such task (or ``owner``, if given, did not start it). ``fold.base`` is the
        oldest event id still resumable from."""
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                _TASK_ROWS + " WHERE r.run_id = %s AND r.tenant = %s AND (%s::text IS NULL OR r.owner = %s)",
                (task_id, tenant, owner, owner),
            )
            row = await cursor.fetchone()
        if row is None:
            return None
        fold = _base_fold(row)
        while upto is None or fold.seq < upto:
            page = await self._runs.events_after(task_id, tenant, fold.seq, PAGE)
            for event in page:
                if upto is not None and event.seq > upto:
                    return fold
                fold.apply(event)
            if len(page) < PAGE:
                break
        return fold

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        """The caller's tenant's tasks, most recently updated first, filtered and paged in SQL.

        Filters: ``context_id``, ``status``, ``status_timestamp_after`` (compared with the run's last
        update). The page token is a keyset cursor (last update, task id), so it stays valid while
        tasks change. The request's own ``tenant`` field is ignored: the token decides, and so does
        the caller's reach (only its own tasks, unless policy gives it the tenant's)."""
        reach = await self.reach(context)
        where, args = self._filters(params, reach)
        page_size = params.page_size or DEFAULT_LIST_TASKS_PAGE_SIZE
        keyset, keyset_args = self._after_page_token(params.page_token)
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                f"{_TASK_ROWS} WHERE {' AND '.join([*where, *keyset])}"
                " ORDER BY r.updated_at DESC, r.run_id DESC LIMIT %s",
                (*args, *keyset_args, page_size + 1),
            )
            rows = await cursor.fetchall()
            count = await conn.execute(
                "SELECT count(*) FROM fleet_runs.runs r LEFT JOIN fleet_runs.a2a_tasks t"
                f" ON t.task_id = r.run_id WHERE {' AND '.join(where)}",
                args,
            )
            total = (await count.fetchone() or (0,))[0]
        more = len(rows) > page_size
        rows = rows[:page_size]
        tasks = await self._fold_page(rows, claims_of(context).tenant)
        token = ""
        if more:
            last = rows[-1]
            token = encode_list_tasks_cursor(ListTasksCursor(_ns(last["updated_at"]), last["run_id"]))
        return ListTasksResponse(tasks=tasks, next_page_token=token, page_size=page_size, total_size=total)

    @staticmethod
    def _filters(params: ListTasksRequest, reach: Reach) -> tuple[Clauses, Arguments]:
        where: Clauses = ["r.tenant = %s"]
        args: Arguments = [reach.tenant]
        if reach.owner is not None:
            where.append("r.owner = %s")
            args.append(reach.owner)
        if params.context_id:
            where.append("t.context_id = %s")
            args.append(params.context_id)
        if params.status:
            where.append("r.state = ANY(%s)")
            args.append(_states_for(params.status))
        if params.HasField("status_timestamp_after"):
            where.append("r.updated_at >= %s")
            args.append(params.status_timestamp_after.ToDatetime(tzinfo=dt.UTC))
        return where, args

    @staticmethod
    def _after_page_token(token: str) -> tuple[Clauses, Arguments]:
        if not token:
            return [], []
        cursor = decode_list_tasks_cursor(token)
        if cursor is None or cursor.timestamp_ns is None:
            unknown = FleetError(ErrorCode.INVALID_REQUEST, "page_token is not a token this agent issued")
            raise a2a_error(unknown, InvalidParamsError)
        after = _EPOCH + dt.timedelta(microseconds=cursor.timestamp_ns // 1000)
        return ["(r.updated_at, r.run_id) < (%s, %s)"], [after, cursor.task_id]

    async def _fold_page(self, rows: Sequence[Mapping[str, Any]], tenant: str) -> Sequence[Task]:
        """Fold a page of tasks with one query for all their events."""
        folds = {row["run_id"]: _base_fold(row) for row in rows}
        if not folds:
            return []
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(_EVENTS_OF_PAGE, (list(folds), tenant))
            for event in await cursor.fetchall():
                folds[event["run_id"]].apply(RunEvent(**event))
        return [folds[row["run_id"]].task for row in rows]

    async def compact(self, older_than_s: float, limit: int = 100) -> int:
        """Retention: for runs that ended more than ``older_than_s`` ago, fold all but the last event
        into the task's snapshot and delete them. The terminal event stays, so the run API still sees
        the run end. Returns how many runs were compacted."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(
                "SELECT r.run_id, r.tenant, r.last_seq FROM fleet_runs.runs r"
                " LEFT JOIN fleet_runs.a2a_tasks t ON t.task_id = r.run_id"
                " WHERE r.state = ANY(%s) AND r.updated_at < now() - make_interval(secs => %s)"
                " AND r.last_seq - 1 > COALESCE(t.snapshot_seq, 0) ORDER BY r.updated_at LIMIT %s",
                (_TERMINAL_NAMES, older_than_s, limit),
            )
            candidates = await cursor.fetchall()
        compacted = 0
        for run_id, tenant, last_seq in candidates:
            compacted += await self._compact_one(str(run_id), str(tenant), int(last_seq) - 1)
        return compacted

    async def _compact_one(self, run_id: str, tenant: str, upto: int) -> bool:
        fold = await self.fold(run_id, tenant, upto)
        if fold is None or fold.seq != upto:
            return False
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO fleet_runs.a2a_tasks (task_id, context_id, snapshot, snapshot_seq)"
                " VALUES (%s, %s, %s, %s) ON CONFLICT (task_id) DO UPDATE"
                " SET snapshot = EXCLUDED.snapshot, snapshot_seq = EXCLUDED.snapshot_seq"
                " WHERE a2a_tasks.snapshot_seq < EXCLUDED.snapshot_seq",
                (run_id, fold.task.context_id, Jsonb(MessageToDict(fold.task)), upto),
            )
            await conn.execute(
                "DELETE FROM fleet_runs.events WHERE run_id = %s AND seq <= %s", (run_id, upto)
            )
        return True


async def sweep_retention(tasks: PostgresTaskStore, retention_s: float, interval_s: float) -> None:
    """Apply the event retention every ``interval_s``, until cancelled (see ``compact``)."""
    while True:
        try:
            while await tasks.compact(retention_s):
                pass
        except Exception:  # housekeeping: never let it take the service down; try again next round
            log.exception("event retention sweep failed")
        await asyncio.sleep(interval_s)


__all__ = ["PostgresTaskStore", "sweep_retention"]
