"""Records that must be kept but must never slow down what they record: the tool servers' audit
events and every policy decision. Each goes to a JetStream stream, batched.

A caller never waits on the broker: :meth:`EventLog.record` queues the record and a background task
stores the records of each ``LINGER_S`` as one message (JSON lines; header ``Fleet-Events`` says how
many; its ``Nats-Msg-Id`` is its first record's id, so a retried publish is stored once). If the
broker stays away until ``max_pending`` records wait, :meth:`record` raises: the caller decides
whether to go on without the record (the decision log) or to refuse (the audit trail).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from fleet.errors import ErrorCode, FleetError
from fleet.events import ensure_stream
from fleet.retry import backoff_s

log = logging.getLogger(__name__)

MAX_BATCH = 512  # records per stored message at most
LINGER_S = 0.05  # how long the first record of a message waits for company
FLUSH_S = 5.0  # what is still queued at shutdown gets this long to reach the stream


class EventLog:
    """One stream's records from this process, published in batches on ``subject``."""

    def __init__(
        self,
        stream: str,
        subjects: str,
        subject: str,
        *,
        max_age_s: float,
        max_pending: int,
        max_msgs_per_subject: int = -1,
    ) -> None:
        self.stream, self.subjects, self.subject = stream, subjects, subject
        self._max_age_s = max_age_s
        self._max_per_subject = max_msgs_per_subject
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(max_pending)

    def record(self, record: dict[str, Any]) -> str:
        """Queue ``record`` (the log owns it from now on; it is serialized when it is published) and
        return its id (``id`` if it has one); ``dependency_unavailable`` if too many wait."""
        record.setdefault("id", uuid.uuid4().hex)
        record.setdefault("time", time.time())
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE,
                f"{self._queue.maxsize} records wait for {self.stream} (is NATS down?)",
                retryable=True,
            ) from None
        return str(record["id"])

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    @contextlib.asynccontextmanager
    async def publishing(self, client: NATS) -> AsyncIterator[None]:
        """Publish the queued records while the context is open (the stream is made if missing)."""
        js = client.jetstream()
        await ensure_stream(
            js,
            self.stream,
            self.subjects,
            max_age_s=self._max_age_s,
            max_msgs_per_subject=self._max_per_subject,
        )
        task = asyncio.create_task(self._publish(js))
        try:
            yield
        finally:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FLUSH_S):
                    await self._queue.join()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if self._queue.qsize():
                log.error(
                    "%d records for %s could not be stored before shutdown", self._queue.qsize(), self.stream
                )

    async def _publish(self, js: JetStreamContext) -> None:
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(LINGER_S)  # gather what comes meanwhile: one message per batch
            while len(batch) < MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            message = b"\n".join(json.dumps(record, default=str).encode() for record in batch)
            headers = {"Nats-Msg-Id": str(batch[0]["id"]), "Fleet-Events": str(len(batch))}
            failed = 0
            while True:
                try:
                    await js.publish(self.subject, message, headers=headers)
                    break
                except (nats.errors.Error, TimeoutError, OSError) as exc:
                    failed += 1
                    log.warning(
                        "records for %s not stored yet (%d queued): %s", self.stream, self.pending, exc
                    )
                    await asyncio.sleep(backoff_s(failed, base_s=0.2, cap_s=5.0))
            for _ in batch:
                self._queue.task_done()


async def read_records(client: NATS, subject: str, *, wait_s: float = 1.0) -> list[dict[str, Any]]:
    """Every record kept on ``subject`` (wildcards allowed), oldest first."""
    js = client.jetstream()
    try:
        subscription = await js.subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    except NotFoundError:
        return []  # no stream holds the subject (yet)
    records: list[dict[str, Any]] = []
    try:
        while True:
            try:
                msg = await subscription.next_msg(timeout=wait_s)
            except TimeoutError:
                break  # nothing kept
            records += [json.loads(line) for line in msg.data.split(b"\n")]
            if msg.metadata.num_pending == 0:
                break  # the last of what was kept
    finally:
        await subscription.unsubscribe()
    return records
