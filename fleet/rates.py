"""Token buckets: how often a key (a tenant, an agent's tool calls) may do something, as policy says."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RateLimits"]


class RateLimits:
    """Token buckets per key (a tool server's: tenant, agent, tool; the token service's and the
    trigger ingest's: a tenant), sized by what policy says for each call (``per_minute`` or
    ``per_second``, and ``burst``). In memory: every replica limits on its own, so a fleet-wide
    limit is this times the replicas."""

    MAX_BUCKETS = 100_000

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[tuple[str, ...], tuple[float, float]] = {}

    def take(self, key: tuple[str, ...], limit: Mapping[str, Any] | None) -> float:
        """Take one call from ``key``'s bucket: 0.0 if it may go now, else the seconds to wait."""
        if not limit:
            return 0.0
        per_s = float(limit.get("per_second", 0)) or float(limit.get("per_minute", 0)) / 60.0
        burst = max(1.0, float(limit.get("burst", 1)))
        now = self._clock()
        tokens, then = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + (now - then) * per_s)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / per_s if per_s > 0 else float("inf")
        if len(self._buckets) >= self.MAX_BUCKETS and key not in self._buckets:
            self._buckets.clear()  # a flood of new keys: start over rather than grow without end
        self._buckets[key] = (tokens - 1.0, now)
        return 0.0
