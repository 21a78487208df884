"""Scan threads shared fairly between tenants.

Each tenant's scan jobs wait in the tenant's own queue; a free thread takes the next job of the next
tenant in turn, ``weight`` jobs of a tenant before the next tenant's (weighted round-robin). A tenant
under its ``max_threads`` (by default one) goes before tenants that hold theirs: a thread that frees
up goes to a tenant waiting with fewer, so a tenant's flood holds at most its share once another
tenant waits, while a tenant alone uses every thread. A tenant's jobs count against its own quota
(texts and characters queued or being scanned) until its thread is really done with them, so a tenant
that floods the pool waits behind itself, never others behind it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fleet.errors import ErrorCode, FleetError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ScanQuota:
    """What one tenant may have in the scan pool (``fleet.limits.fair.memory_scan``)."""

    weight: int = 1  # jobs taken from the tenant's queue in a row when its turn comes
    max_queued_texts: int = 512  # texts queued or being scanned, over all its calls
    max_queued_chars: int = 2_097_152  # characters of those texts
    max_call_chars: int = 1_048_576  # characters of one call's texts
    max_threads: int = 1  # scan threads its jobs may hold at once

    @classmethod
    def of(cls, value: object) -> ScanQuota:
        """The quota a policy answer names; fields it lacks or gets wrong keep their default."""
        fields = value if isinstance(value, dict) else {}
        given = {
            k: int(v)
            for k, v in fields.items()
            if k in cls.__dataclass_fields__ and isinstance(v, int | float) and not isinstance(v, bool)
        }
        quota = cls(**given)
        return cls(**{k: max(1, getattr(quota, k)) for k in cls.__dataclass_fields__})


class ScanPool:
    """``threads`` scan threads, served per tenant in turn. Used from one event loop."""

    def __init__(self, threads: int = 2, *, chars_per_second: float = 8_000.0) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="memory-scan"
        )
        self._free = threads
        self._chars_per_second = chars_per_second  # for Retry-After: a scan thread's pace
        self._queues: dict[str, deque[tuple[Callable[[], Any], asyncio.Future[Any]]]] = {}
        self._turns: deque[str] = deque()  # tenants with queued jobs, the next one first
        self._served = 0  # jobs taken from the first tenant in its current turn
        self._weights: dict[str, int] = {}
        self._max_threads: dict[str, int] = {}
        self._running: dict[str, int] = {}  # tenant: its jobs in a thread now
        self._held: dict[str, tuple[int, int]] = {}  # tenant: (texts, chars) queued or in a thread

    def reserve(self, tenant: str, texts: list[str], quota: ScanQuota) -> None:
        """Count ``texts`` against the tenant's quota, or refuse them all (``quota_exceeded``,
        retryable, with the seconds after which its own earlier texts should be done)."""
        chars = sum(len(t) for t in texts)
        if chars > quota.max_call_chars:
            raise FleetError(
                ErrorCode.TOO_LARGE,
                f"at most {quota.max_call_chars} characters per call, not {chars}; nothing was written",
            )
        held_texts, held_chars = self._held.get(tenant, (0, 0))
        if held_texts + len(texts) > quota.max_queued_texts or held_chars + chars > quota.max_queued_chars:
            retry = max(1, math.ceil(held_chars / self._chars_per_second))
            raise FleetError(
                ErrorCode.QUOTA_EXCEEDED,
                f"this tenant has {held_texts} texts ({held_chars} characters) waiting to be scanned,"
                f" its quota is {quota.max_queued_texts} ({quota.max_queued_chars}); nothing was"
                f" written, retry in {retry} s",
                retryable=True,
                retry_after_s=retry,
            )
        self._held[tenant] = (held_texts + len(texts), held_chars + chars)
        self._weights[tenant] = quota.weight
        self._max_threads[tenant] = quota.max_threads

    def release(self, tenant: str, texts: list[str]) -> None:
        """Take ``texts`` (reserved before) off the tenant's count."""
        held_texts, held_chars = self._held.pop(tenant, (0, 0))
        left = (held_texts - len(texts), held_chars - sum(len(t) for t in texts))
        if left[0] > 0:
            self._held[tenant] = left

    def submit(self, tenant: str, job: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``job`` in a scan thread when the tenant's turn comes. Cancelling the answer before a
        thread takes the job drops it; after, the thread finishes the job and its answer is dropped."""
        answer: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        if tenant not in self._queues:
            self._queues[tenant] = deque()
            self._turns.append(tenant)
        self._queues[tenant].append((job, answer))
        self._dispatch()
        return answer

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._free > 0 and (next_job := self._next()) is not None:
            tenant, job, answer = next_job
            if answer.done():  # given up while it waited
                continue
            self._free -= 1
            self._running[tenant] = self._running.get(tenant, 0) + 1
            running = self._executor.submit(job)
            running.add_done_callback(functools.partial(self._done, loop, tenant, answer))

    def _next(self) -> tuple[str, Callable[[], Any], asyncio.Future[Any]] | None:
        """The next job of the first tenant in turn that is under its ``max_threads``; if every
        tenant with jobs waiting is at its cap, of the first in turn (a free thread never idles
        while jobs wait: the cap is a tenant's share while others wait, not a limit when alone)."""
        if not self._turns:
            return None
        for _ in range(len(self._turns)):
            tenant = self._turns[0]
            if self._running.get(tenant, 0) < self._max_threads.get(tenant, 1):
                break
            self._turns.rotate(-1)  # at its cap: the next tenant's turn
            self._served = 0
        else:
            tenant = self._turns[0]
        queue = self._queues[tenant]
        job, answer = queue.popleft()
        self._served += 1
        if not queue:
            del self._queues[tenant]
            self._turns.popleft()
            self._served = 0
        elif self._served >= self._weights.get(tenant, 1):
            self._turns.rotate(-1)
            self._served = 0
        return tenant, job, answer

    def _done(
        self,
        loop: asyncio.AbstractEventLoop,
        tenant: str,
        answer: asyncio.Future[Any],
        done: concurrent.futures.Future[Any],
    ) -> None:
        loop.call_soon_threadsafe(self._finished, tenant, done, answer)

    def _finished(
        self, tenant: str, done: concurrent.futures.Future[Any], answer: asyncio.Future[Any]
    ) -> None:
        self._free += 1
        left = self._running.pop(tenant, 1) - 1
        if left > 0:
            self._running[tenant] = left
        if not answer.done():
            if done.cancelled():
                answer.cancel()
            elif (exc := done.exception()) is not None:
                answer.set_exception(exc)
            else:
                answer.set_result(done.result())
        self._dispatch()
