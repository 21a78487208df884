"""One Postgres ``LISTEN`` connection per process, shared by everything that follows runs' events.

Readers register a :class:`Wakeup` for a run (or for every run) and are woken when a notification
names it. A notification only wakes: readers always read the events from the table, so a lost or
repeated notification never loses or repeats an event. When the connection drops, the notifier
reconnects with backoff and then wakes every reader, which re-reads what it may have missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from types import TracebackType

import psycopg

from fleet.retry import backoff_s

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "fleet_run_events"  # the run store notifies it (the run id) after each event it commits

HEALTH_CHECK_S = 30.0  # a quiet connection is probed this often, so a dead one is noticed
FIRST_CONNECT_S = 10.0


class Wakeup:
    """One reader's flag: :meth:`arm` before reading the table, then :meth:`wait` for news."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def arm(self) -> None:
        """Forget earlier wake-ups: a notification after this call ends the next :meth:`wait`."""
        self._event.clear()

    async def wait(self, timeout_s: float) -> bool:
        """Until woken (True) or ``timeout_s`` passes (False)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._event.wait()
        except TimeoutError:
            return False
        return True

    def wake(self) -> None:
        self._event.set()


class RunNotifier:
    """Listens on ``NOTIFY_CHANNEL`` over one connection and wakes the readers a notification names.

    Use with ``async with``: the listening task lives in the notifier's task group."""

    def __init__(
        self, dsn: str, *, channel: str = NOTIFY_CHANNEL, backoff_s: float = 0.5, max_backoff_s: float = 30.0
    ) -> None:
        self._dsn = dsn
        self._channel = channel
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._by_run: dict[str, set[Wakeup]] = {}
        self._every: set[Wakeup] = set()
        self._listening = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self.backend_pid: int | None = None  # of the listening connection, while it is up

    @property
    def watching(self) -> int:
        """How many readers are registered."""
        return len(self._every) + sum(len(w) for w in self._by_run.values())

    @property
    def listening(self) -> bool:
        return self._listening.is_set()

    async def __aenter__(self) -> RunNotifier:
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        self._task = self._group.create_task(self._listen())
        with contextlib.suppress(TimeoutError):  # readers still poll until it is up
            async with asyncio.timeout(FIRST_CONNECT_S):
                await self._listening.wait()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._group is not None and self._task is not None
        self._task.cancel()
        await self._group.__aexit__(exc_type, exc, tb)

    @contextlib.contextmanager
    def watch(self, run_id: str | None = None) -> Iterator[Wakeup]:
        """A wake-up for ``run_id``'s notifications (for every run's if None), for the block."""
        wakeup = Wakeup()
        watchers = self._every if run_id is None else self._by_run.setdefault(run_id, set())
        watchers.add(wakeup)
        try:
            yield wakeup
        finally:
            watchers.discard(wakeup)
            if run_id is not None and not watchers:
                self._by_run.pop(run_id, None)

    def _wake(self, run_id: str) -> None:
        for wakeup in (*self._by_run.get(run_id, ()), *self._every):
            wakeup.wake()

    def _wake_all(self) -> None:
        for wakeup in (*self._every, *(w for ws in self._by_run.values() for w in ws)):
            wakeup.wake()

    async def _listen(self) -> None:
        failed = 0  # connections lost in a row without one that got to listen
        while True:
            try:
                await self._listen_once()
            except Exception as exc:  # the database restarting, a network cut: log, then reconnect
                failed = 1 if self._listening.is_set() else failed + 1
                delay = backoff_s(failed, base_s=self._backoff_s, cap_s=self._max_backoff_s)
                log.warning("run notifications: connection lost (%s); reconnecting in %.1fs", exc, delay)
            else:
                failed, delay = 0, self._backoff_s
            self._listening.clear()
            self.backend_pid = None
            await asyncio.sleep(delay)

    async def _listen_once(self) -> None:
        async with await psycopg.AsyncConnection.connect(self._dsn, autocommit=True) as conn:
            await conn.execute(f"LISTEN {self._channel}")
            self.backend_pid = conn.info.backend_pid
            self._listening.set()
            self._wake_all()  # whatever was committed while nobody listened
            while True:
                async for note in conn.notifies(timeout=HEALTH_CHECK_S):
                    self._wake(note.payload)
                await conn.execute("SELECT 1")  # raises if the connection died quietly


__all__ = ["RunNotifier", "Wakeup"]
