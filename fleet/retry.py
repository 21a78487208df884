"""Waiting out a failover: exponential backoff with jitter, one helper for every retry loop.

A broker node, the registry or a database failing over drops every client at once; if each tried
again after the same fixed pause they would all come back in the same instant, again and again.
Here each wait doubles from ``first_s`` up to ``max_s`` and is drawn between half of that and all of
it, so clients spread out, and a loop that keeps failing asks at most every ``max_s``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Backoff:
    """The waits of one retry loop: :meth:`wait` after a failure, :meth:`reset` after a success."""

    first_s: float = 0.2
    max_s: float = 5.0
    failures: int = 0

    def delay(self) -> float:
        """The next wait, counting one more failure."""
        ceiling = min(self.max_s, self.first_s * 2.0 ** min(self.failures, 32))
        self.failures += 1
        return random.uniform(ceiling / 2, ceiling)

    async def wait(self) -> None:
        await asyncio.sleep(self.delay())

    def reset(self) -> None:
        self.failures = 0


async def retry_until(
    action: Callable[[], Awaitable[T]],
    transient: type[BaseException] | tuple[type[BaseException], ...],
    *,
    patience_s: float,
    log: logging.Logger,
    what: str,
    level: int = logging.INFO,
    backoff: Backoff | None = None,
) -> T:
    """``action``, tried again while it fails with ``transient`` (logged at ``level`` with ``what``),
    for up to ``patience_s``; the last failure is raised after that. Only for actions safe to repeat."""
    backoff = backoff or Backoff()
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return await action()
        except transient as exc:
            if time.monotonic() >= deadline:
                raise
            log.log(level, "%s: %s; trying again", what, str(exc) or type(exc).__name__)
            await backoff.wait()
