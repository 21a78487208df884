"""Waiting out a failover: exponential backoff with jitter, and one loop that retries an action with it.

A broker node or a database failing over answers again within seconds. Callers that retry all at
once, at a fixed pace, meet it together; a random part of each wait spreads them out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["backoff_s", "retrying"]

T = TypeVar("T")
log = logging.getLogger(__name__)


def backoff_s(attempt: int, *, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    """How long to wait before try ``attempt + 1`` (``attempt`` >= 1 tries failed): ``base_s``
    doubled per failed try, at most ``cap_s``, of which a random half ("equal jitter")."""
    ceiling = min(cap_s, base_s * 2.0 ** min(max(attempt, 1) - 1, 30))
    return ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter, not a secret


async def retrying(
    what: str,
    action: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    patience_s: float | None = None,
    base_s: float = 0.5,
    cap_s: float = 10.0,
) -> T:
    """``action``, tried again after :func:`backoff_s` while it fails with one of ``retry_on``, for up
    to ``patience_s`` (None: until it succeeds or the caller is cancelled); the last failure is
    raised after that. Only for actions that are safe to repeat."""
    deadline = None if patience_s is None else time.monotonic() + patience_s
    attempt = 0
    while True:
        try:
            return await action()
        except retry_on as exc:
            attempt += 1
            wait_s = backoff_s(attempt, base_s=base_s, cap_s=cap_s)
            if deadline is not None:
                if time.monotonic() >= deadline:
                    raise
                wait_s = min(wait_s, deadline - time.monotonic())
            log.warning("%s: %s (try %d); trying again in %.1f s", what, type(exc).__name__, attempt, wait_s)
            await asyncio.sleep(wait_s)
