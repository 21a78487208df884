"""A specialist's journal of operations: what it was asked to do under which operation id, and what
came of it. It is what lets a specialist answer "what happened to operation X?" after the caller (or
the specialist itself) crashed, and what keeps a re-sent operation from running twice.

SQLite in the specialist's state dir, in WAL mode with full sync: a row is on disk before the skill
starts. One small write at the start and one at the end of each operation, so its cost is noise next
to the A2A call it journals.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from fleet.errors import ErrorCode


class JournalStatus(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    # The skill was running when this specialist died: its effects may be partial.
    INTERRUPTED = "interrupted"
    # A tool call timed out and the tool cannot say whether it took effect.
    UNCERTAIN = "uncertain"
    # Stopped on request between tool calls (the error counts those it completed); or canceled before
    # it was received (a tombstone, with no skill or arguments): the request is refused if it comes.
    CANCELED = "canceled"
    UNKNOWN = "unknown"  # never received (the journal is written before any work starts)


@dataclass(frozen=True, slots=True)
class Entry:
    op_id: str
    tenant: str
    skill: str
    args_hash: str
    status: JournalStatus
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    usage: dict[str, Any] | None = None  # what the operation spent (the skill's BudgetMeter)

    @property
    def received(self) -> bool:
        """False for an operation canceled before it arrived (a tombstone): it has no arguments."""
        return bool(self.args_hash)

    def to_json(self) -> dict[str, Any]:
        body = {
            "operation_id": self.op_id,
            "status": self.status.value,
            "skill": self.skill,
            "result": self.result,
            "error": self.error,
        }
        if self.usage is not None:
            body["usage"] = self.usage
        return body


_SCHEMA = """
CREATE TABLE IF NOT EXISTS operations (
    op_id     TEXT NOT NULL,
    tenant    TEXT NOT NULL,
    skill     TEXT NOT NULL,
    args_hash TEXT NOT NULL,
    status    TEXT NOT NULL,
    result    TEXT,
    error     TEXT,
    boot      TEXT NOT NULL,
    created   REAL NOT NULL,
    updated   REAL NOT NULL,
    PRIMARY KEY (tenant, op_id)
)
"""


class Journal:
    """Operation entries, keyed by (tenant, operation id): one tenant never sees another's."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(operations)")}
        if "usage" not in columns:  # a journal from before usage was kept
            self._db.execute("ALTER TABLE operations ADD COLUMN usage TEXT")
        self._lock = threading.Lock()
        # Entries left running by an earlier process of this specialist were interrupted.
        self._boot = uuid.uuid4().hex
        self._finished: dict[tuple[str, str], asyncio.Event] = {}

    def close(self) -> None:
        self._db.close()

    def _row(self, tenant: str, op_id: str) -> Entry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT op_id, tenant, skill, args_hash, status, result, error, boot, usage FROM operations"
                " WHERE tenant = ? AND op_id = ?",
                (tenant, op_id),
            ).fetchone()
        if row is None:
            return None
        status = JournalStatus(row[4])
        if status == JournalStatus.RUNNING and row[7] != self._boot:
            status = JournalStatus.INTERRUPTED
        return Entry(
            row[0],
            row[1],
            row[2],
            row[3],
            status,
            json.loads(row[5]) if row[5] else None,
            json.loads(row[6]) if row[6] else None,
            json.loads(row[8]) if row[8] else None,
        )

    def get(self, tenant: str, op_id: str) -> Entry:
        return self._row(tenant, op_id) or Entry(op_id, tenant, "", "", JournalStatus.UNKNOWN, None, None)

    def begin(self, tenant: str, op_id: str, skill: str, args_hash: str) -> bool:
        """Record that the operation starts now (durable on return); replaces an interrupted entry.
        False, and nothing starts, if the operation was canceled."""
        now = time.time()
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO operations (op_id, tenant, skill, args_hash, status, boot, created, updated)"
                " VALUES (?, ?, ?, ?, 'running', ?, ?, ?) ON CONFLICT (tenant, op_id) DO UPDATE SET"
                " status = 'running', boot = excluded.boot, updated = excluded.updated"
                " WHERE operations.status <> 'canceled'",
                (op_id, tenant, skill, args_hash, self._boot, now, now),
            )
        if cursor.rowcount != 1:
            return False
        self._finished[(tenant, op_id)] = asyncio.Event()
        return True

    def cancel_unreceived(self, tenant: str, op_id: str) -> Entry:
        """Cancel an operation that has not arrived: record a tombstone (``canceled``, no skill, no
        arguments) so that it is refused if it comes later. An entry already there is kept as it is.
        Returns the entry."""
        error = {
            "code": str(ErrorCode.CANCELED),
            "message": "canceled before it was received; it will not run",
            "tool_calls": 0,
        }
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO operations (op_id, tenant, skill, args_hash, status, error, boot, created,"
                " updated) VALUES (?, ?, '', '', 'canceled', ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (op_id, tenant, json.dumps(error), self._boot, now, now),
            )
        return self.get(tenant, op_id)

    def finish(
        self,
        tenant: str,
        op_id: str,
        status: JournalStatus,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        usage: dict[str, Any] | None = None,
    ) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE operations SET status = ?, result = ?, error = ?, usage = ?, updated = ?"
                " WHERE tenant = ? AND op_id = ?",
                (
                    status.value,
                    json.dumps(result) if result is not None else None,
                    json.dumps(error) if error is not None else None,
                    json.dumps(usage) if usage is not None else None,
                    time.time(),
                    tenant,
                    op_id,
                ),
            )
        done = self._finished.pop((tenant, op_id), None)
        if done is not None:
            done.set()

    async def wait(self, tenant: str, op_id: str, timeout_s: float) -> Entry:
        """The entry, once it is no longer running here or ``timeout_s`` has passed."""
        done = self._finished.get((tenant, op_id))
        if done is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    await done.wait()
            except TimeoutError:
                pass
        return self.get(tenant, op_id)

    def prune(self, older_than_s: float) -> int:
        """Forget finished entries older than ``older_than_s`` (tombstones too: a request canceled
        before it arrived is not expected to arrive that late)."""
        with self._lock:
            cursor = self._db.execute(
                "DELETE FROM operations WHERE status <> 'running' AND updated < ?",
                (time.time() - older_than_s,),
            )
        return cursor.rowcount
