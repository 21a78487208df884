"""Where runs keep their checkpoints: LangGraph's checkpointer interface over one Postgres table.

One row per checkpoint holds all of it: the state (every channel's value), the channel versions, the
metadata, and the writes of the tasks that ran from it (``writes``), each compressed. LangGraph's own
Postgres saver spreads a checkpoint over three tables (a JSONB document, a row per changed channel, a
row per write), each with its own index; a run that waits at a gate for a week then costs about three
times the disk (``docs/benchmarks.md``, pauses). What a run needs to resume is its latest checkpoint
and that checkpoint's writes, and the coordinator only ever reads whole checkpoints, so one compact row
is the better shape.

* A checkpoint is saved in full each time (not only the channels that changed). The coordinator's
  state is a plan and its results, small next to what a channel-per-row layout costs per row; a run
  that grows large state (a batch) checkpoints every K items, not every item.
* A task's writes can arrive before the checkpoint they belong to is saved (LangGraph saves
  checkpoints in the background while the next step runs), so ``put_writes`` creates the row if need
  be; a row without a checkpoint (``body IS NULL``) is never returned.
* Writes are kept as LangGraph's savers keep them: a task's ordinary write is recorded once (the first
  wins, a retry repeats it), a special write (error, interrupt, resume) replaces the one before.
* Checkpoint ids are LangGraph's (UUIDs, ordered by time), stored as ``uuid``: the latest checkpoint
  is the greatest id.
* Channel versions are integers (LangGraph's default), not the 50-character strings of the Postgres
  saver: they appear in every checkpoint, once per channel and again per node.
* Only the async interface exists: the coordinator runs its graph with ``astream`` and reads state with
  ``aget_state``.

Encoding (:func:`encode`): ``FORMAT`` (one byte), the serializer's type, then the serialized value
compressed with zlib (the zlib format: it names the dictionary by checksum and checks the data, so a
wrong dictionary or a damaged row is an error, never a wrong state) from a fixed dictionary of what every checkpoint repeats (``_DICTIONARY``): a
pending run's checkpoint takes a few hundred bytes. The dictionary is part of the format: changing it
needs a new format byte, and the old one kept to read old rows.
"""

from __future__ import annotations

import hashlib
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ormsgpack
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
    writes_sort_key,
)
from psycopg_pool import AsyncConnectionPool

from fleet.errors import ErrorCode, FleetError

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS fleet_runs;
CREATE TABLE IF NOT EXISTS fleet_runs.checkpoints (
    thread_id     text NOT NULL,
    checkpoint_ns text NOT NULL DEFAULT '',
    checkpoint_id uuid NOT NULL,
    parent_id     uuid,
    body          bytea,
    writes        bytea[] NOT NULL DEFAULT '{}',
    PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
);
"""

FORMAT = 1

# The dictionary zlib starts from: what every checkpoint of the coordinator repeats, so that a small
# checkpoint costs about what is particular to it (ids, times, inputs, results). Its words and
# templates are plain msgpack of literals (the msgpack format is fixed), the templates shaped like the
# coordinator's state and a gate's request, with the shipped policy's defaults. A deployment whose
# state looks different compresses less, never wrongly. The dictionary is part of ``FORMAT``.
_WORDS = (
    # LangGraph's own keys and channels
    "v", "id", "ts", "channel_values", "channel_versions", "versions_seen", "updated_channels",
    "pending_sends", "__start__", "__input__", "__pregel_tasks", "__interrupt__", "__resume__",
    "__error__", "branch:to:", "source", "loop", "input", "step", "parents", "writes", "value",
    "resumable", "when", "during", "ns", "langgraph.types", "Interrupt", "Send", "node", "arg",
    # the coordinator's state (coordinator.engine.graph.GraphState) and its gates
    "run_id", "tenant", "steps", "results", "limits", "tranche", "calls", "failure", "stop",
    "finished", "schedule", "delegate", "batch", "batches", "outcomes", "after", "skill", "agent",
    "status", "completed", "failed", "pending_approval", "user_input_required", "input_required",
    "approval", "awaited", "deadline", "warn_at", "escalated", "on_expired", "expire", "escalate",
    "choices", "approve", "reject", "asked", "why", "op_id", "op-", "requests", "type", "code",
    "message", "text", "payload", "for_each", "wait", "until", "event", "subject",
)  # fmt: skip
_TIME = "2026-01-01T00:00:00.000000+00:00"
_UUID = "00000000-0000-0000-0000-000000000000"
_STEP = {"id": "step", "after": [], "input": {}, "skill": "skill"}
_DEADLINES = {"escalate_for_s": 3600, "on_expired": "expire", "timeout_s": 86400, "warn_before_s": 3600}
_LIMITS = {
    "limits": {
        "activity": {"max_renewals": 30, "on_stuck": "escalate", "quiet_after_s": 120},
        "after_tranches": "summarize",
        "ask": {"on_expired": "expire", "timeout_s": 86400, "warn_before_s": 3600},
        "max_operations": 1000,
        "max_seconds": 3600,
        "max_steps": 50,
        "max_tranches": 1,
        "on_exhausted": "tranche",
    },
    "convergence": {"max_calls_per_turn": 25, "repeat_limit": 3},
    "batch": {"call_size": 50, "checkpoint_every": 50},
    "approvals": {"default": _DEADLINES, "skills": {}},
}
_TASK = {
    "run_id": _UUID,
    "tenant": "tenant",
    "step": _STEP,
    "results": {},
    "offset": 0,
    "batch": {},
    "approval": {"timeout_s": 86400, "warn_before_s": 3600, "on_expired": "expire", "escalate_for_s": 3600},
}
_REQUEST = {
    "type": "approval",
    "awaited": "approval:step:0",
    "step": "step",
    "skill": "skill",
    "agent": "agent",
    "op_id": "op-",
    "why": "needs approval (decision ",
    "asked": {},
    "deadline": _TIME,
    "warn_at": _TIME,
    "on_expired": "expire",
}
_STATE = {
    "checkpoint": {
        "v": 4,
        "ts": _TIME,
        "id": _UUID,
        "channel_values": {
            "run_id": _UUID,
            "tenant": "tenant",
            "steps": [_STEP],
            "results": {},
            "failure": None,
            "limits": _LIMITS,
            "tranche": {"number": 0, "steps": 0, "operations": 0, "started_at": _TIME},
            "calls": [],
            "stop": None,
            "__pregel_tasks": [],
        },
        "channel_versions": {
            **dict.fromkeys(
                ("__start__", "run_id", "tenant", "steps", "results", "failure", "limits", "tranche", "stop"),
                2,
            ),
            **dict.fromkeys(("branch:to:schedule", "calls", "__pregel_tasks"), 3),
        },
        "versions_seen": {
            "__input__": {},
            "__start__": {"__start__": 1},
            "schedule": {"branch:to:schedule": 2},
        },
        "updated_channels": ["__pregel_tasks", "calls"],
    },
    "metadata": {"source": "loop", "step": 1, "parents": {}},
}
_DICTIONARY = b"".join(
    [
        *(ormsgpack.packb(word) for word in _WORDS),
        b"\x93\xaflanggraph.types\xa4Send\x92\xa8delegate" + ormsgpack.packb(_TASK),
        b"\x93\xaflanggraph.types\xa9Interrupt"
        + ormsgpack.packb({"value": _REQUEST, "id": "0" * 32, "response_schema": None}),
        ormsgpack.packb(
            [["", -3, "__interrupt__", "msgpack", b"", "~__pregel_push, 0000000000, 0000000000"]]
        ),
        ormsgpack.packb(_STATE),  # last: the nearest, cheapest to refer to
    ]
)
# The dictionary is part of FORMAT 1: a change to the templates above must not slip in unnoticed.
_DICTIONARY_SHA256 = "d4039fbf408e0d31e97242ea920d94848d931b74bab6642e84914363167e46b8"
if hashlib.sha256(_DICTIONARY).hexdigest() != _DICTIONARY_SHA256:
    raise RuntimeError(
        "the checkpoint dictionary changed: give the new one a new FORMAT byte and keep this one to read old rows"
    )
_LEVEL = 9  # the values are small: the best compression costs microseconds


# The serializer's type names, one byte each in the stored format; another name is spelled out.
_KINDS = ("msgpack", "json", "bytes", "bytearray", "null", "writes")
_NAMED = 0xFF


def encode(typed: tuple[str, bytes]) -> bytes:
    """A serialized value (the serializer's ``(type, bytes)``), in the stored format: ``FORMAT``,
    the type (a byte of ``_KINDS``, or ``_NAMED``, the name and a NUL byte), the compressed value."""
    kind, data = typed
    label = bytes([_KINDS.index(kind)]) if kind in _KINDS else bytes([_NAMED]) + kind.encode() + b"\0"
    # the zlib format, not raw deflate: it names the dictionary (by checksum) and checks the data
    packer = zlib.compressobj(_LEVEL, zlib.DEFLATED, 15, 9, zlib.Z_DEFAULT_STRATEGY, _DICTIONARY)
    return bytes([FORMAT]) + label + packer.compress(data) + packer.flush()


def decode(stored: bytes) -> tuple[str, bytes]:
    """The ``(type, bytes)`` a stored value was made from; a clear error for anything else."""
    if len(stored) < 2 or stored[0] != FORMAT:
        raise FleetError(
            ErrorCode.INTERNAL, f"a checkpoint in an unknown format ({stored[:1].hex() or 'empty'})"
        )
    if stored[1] == _NAMED and b"\0" in stored[2:]:
        name, _, data = stored[2:].partition(b"\0")
        kind = name.decode(errors="replace")
    elif stored[1] < len(_KINDS):
        kind, data = _KINDS[stored[1]], stored[2:]
    else:
        raise FleetError(ErrorCode.INTERNAL, f"a checkpoint of an unknown type ({stored[1]})")
    try:
        unpacker = zlib.decompressobj(15, zdict=_DICTIONARY)
        value = unpacker.decompress(data) + unpacker.flush()
    except zlib.error as exc:
        raise FleetError(ErrorCode.INTERNAL, f"a damaged checkpoint: {exc}") from exc
    if not unpacker.eof or unpacker.unused_data:
        raise FleetError(ErrorCode.INTERNAL, "a damaged checkpoint: truncated or with trailing bytes")
    return kind, value


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


class CompactCheckpointer(BaseCheckpointSaver[int]):
    """LangGraph checkpoints in ``fleet_runs.checkpoints``, one compressed row each (module doc)."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        super().__init__()
        self._pool = pool

    async def setup(self) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            # The coordinator and every worker run this as they start; serialise the DDL.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.runs.schema'))")
            await conn.execute(SCHEMA)

    # -- writing ----------------------------------------------------------------------------------

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        configurable = config["configurable"]
        thread_id, namespace = configurable["thread_id"], configurable.get("checkpoint_ns", "")
        body = encode(
            self.serde.dumps_typed(
                {"checkpoint": checkpoint, "metadata": get_checkpoint_metadata(config, metadata)}
            )
        )
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO fleet_runs.checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_id, body)"
                " VALUES (%s, %s, %s::uuid, %s::uuid, %s)"
                " ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id)"
                " DO UPDATE SET body = EXCLUDED.body, parent_id = EXCLUDED.parent_id",
                (thread_id, namespace, checkpoint["id"], configurable.get("checkpoint_id"), body),
            )
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": namespace,
                "checkpoint_id": checkpoint["id"],
            }
        }

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        if not writes:
            return
        configurable = config["configurable"]
        packed = [
            [task_id, WRITES_IDX_MAP.get(channel, idx), channel, *self.serde.dumps_typed(value), task_path]
            for idx, (channel, value) in enumerate(writes)
        ]
        element = encode(("writes", ormsgpack.packb(packed)))
        async with self._pool.connection() as conn:
            await conn.execute(
                "INSERT INTO fleet_runs.checkpoints AS c (thread_id, checkpoint_ns, checkpoint_id, writes)"
                " VALUES (%s, %s, %s::uuid, ARRAY[%s::bytea])"
                " ON CONFLICT (thread_id, checkpoint_ns, checkpoint_id)"
                " DO UPDATE SET writes = c.writes || EXCLUDED.writes",
                (
                    configurable["thread_id"],
                    configurable.get("checkpoint_ns", ""),
                    configurable["checkpoint_id"],
                    element,
                ),
            )

    # -- reading ----------------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        configurable = config["configurable"]
        query = (
            "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_id, body, writes"
            " FROM fleet_runs.checkpoints"
            " WHERE thread_id = %s AND checkpoint_ns = %s AND body IS NOT NULL"
        )
        params: list[Any] = [configurable["thread_id"], configurable.get("checkpoint_ns", "")]
        if checkpoint_id := get_checkpoint_id(config):
            if not _is_uuid(checkpoint_id):
                return None  # no checkpoint has such an id
            query += " AND checkpoint_id = %s::uuid"
            params.append(checkpoint_id)
        else:
            query += " ORDER BY checkpoint_id DESC LIMIT 1"
        async with self._pool.connection() as conn:
            cursor = await conn.execute(query, params)
            row = await cursor.fetchone()
        return None if row is None else self._tuple(row)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        query = (
            "SELECT thread_id, checkpoint_ns, checkpoint_id, parent_id, body, writes"
            " FROM fleet_runs.checkpoints WHERE body IS NOT NULL"
        )
        params: list[Any] = []
        if config is not None:
            configurable = config["configurable"]
            query += " AND thread_id = %s"
            params.append(configurable["thread_id"])
            if (namespace := configurable.get("checkpoint_ns")) is not None:
                query += " AND checkpoint_ns = %s"
                params.append(namespace)
            if checkpoint_id := get_checkpoint_id(config):
                if not _is_uuid(checkpoint_id):
                    return
                query += " AND checkpoint_id = %s::uuid"
                params.append(checkpoint_id)
        if before is not None and (before_id := get_checkpoint_id(before)):
            if not _is_uuid(before_id):
                raise FleetError(ErrorCode.INVALID_REQUEST, f"not a checkpoint id: {before_id!r}")
            query += " AND checkpoint_id < %s::uuid"
            params.append(before_id)
        query += " ORDER BY checkpoint_id DESC"
        if limit is not None and not filter:
            query += " LIMIT %s"
            params.append(limit)
        async with self._pool.connection() as conn:
            cursor = await conn.execute(query, params)
            rows = await cursor.fetchall()
        left = limit
        for row in rows:
            if left is not None and left <= 0:
                return
            found = self._tuple(row)
            if filter and any(found.metadata.get(key) != value for key, value in filter.items()):
                continue
            if left is not None:
                left -= 1
            yield found

    def _tuple(self, row: Sequence[Any]) -> CheckpointTuple:
        thread_id, namespace, checkpoint_id, parent_id, body, stored_writes = row
        saved = self.serde.loads_typed(decode(bytes(body)))

        def config_of(checkpoint: Any) -> RunnableConfig:
            return {
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": namespace,
                    "checkpoint_id": str(checkpoint),  # LangGraph's ids are UUIDs, kept as such
                }
            }

        return CheckpointTuple(
            config=config_of(checkpoint_id),
            checkpoint=saved["checkpoint"],
            metadata=saved["metadata"],
            parent_config=config_of(parent_id) if parent_id else None,
            pending_writes=self._pending(stored_writes),
        )

    def _pending(self, stored: Sequence[bytes]) -> list[tuple[str, str, Any]]:
        """The writes of a checkpoint as LangGraph's savers keep them: the first of a task's ordinary
        writes, the last of its special ones, in the order a step applies them."""
        kept: dict[tuple[str, int], tuple[str, int, str, str, bytes, str]] = {}
        for element in stored:
            _, data = decode(bytes(element))
            for task_id, idx, channel, kind, value, task_path in ormsgpack.unpackb(data):
                if idx >= 0 and (task_id, idx) in kept:
                    continue
                kept[task_id, idx] = (task_id, idx, channel, kind, value, task_path)
        ordered = sorted(kept.values(), key=lambda w: writes_sort_key(w[5], w[0], w[1]))
        return [(w[0], w[2], self.serde.loads_typed((w[3], w[4]))) for w in ordered]

    # -- forgetting -------------------------------------------------------------------------------

    async def adelete_thread(self, thread_id: str) -> None:
        async with self._pool.connection() as conn:
            await conn.execute("DELETE FROM fleet_runs.checkpoints WHERE thread_id = %s", (thread_id,))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``keep_latest``: only the latest checkpoint of each namespace stays (with its writes, and
        the writes of a checkpoint newer than it, if one is being saved); ``delete``: nothing stays."""
        if strategy == "delete":
            async with self._pool.connection() as conn:
                await conn.execute(
                    "DELETE FROM fleet_runs.checkpoints WHERE thread_id = ANY(%s)", (list(thread_ids),)
                )
            return
        if strategy != "keep_latest":
            raise ValueError(f"unknown pruning strategy {strategy!r}")
        async with self._pool.connection() as conn:
            await conn.execute(
                "DELETE FROM fleet_runs.checkpoints AS c WHERE thread_id = ANY(%s)"
                " AND checkpoint_id < (SELECT l.checkpoint_id FROM fleet_runs.checkpoints AS l"
                "  WHERE l.thread_id = c.thread_id AND l.checkpoint_ns = c.checkpoint_ns"
                "  AND l.body IS NOT NULL ORDER BY l.checkpoint_id DESC LIMIT 1)",
                (list(thread_ids),),
            )
