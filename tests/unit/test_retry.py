"""The one backoff of the fleet's failover waits (fleet/retry.py)."""

from __future__ import annotations

import time

import pytest

from fleet.retry import backoff_s, retrying


def test_backoff_doubles_up_to_its_cap_with_a_random_half() -> None:
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (10, 10.0), (100, 10.0)]:
        waits = [backoff_s(attempt) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits), (attempt, min(waits), max(waits))
        assert len(set(waits)) > 100  # jittered: callers that failed together do not retry together


async def test_an_action_is_retried_until_it_succeeds() -> None:
    tries: list[int] = []

    async def flaky() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionError("failing over")
        return "answered"

    assert await retrying("flaky", flaky, retry_on=(ConnectionError,), base_s=0.01) == "answered"
    assert len(tries) == 3


async def test_the_last_failure_is_raised_once_patience_runs_out_and_others_at_once() -> None:
    async def down() -> None:
        raise ConnectionError("still failing over")

    started = time.monotonic()
    with pytest.raises(ConnectionError):
        await retrying("down", down, retry_on=(ConnectionError,), patience_s=0.3, base_s=0.05, cap_s=0.1)
    assert 0.3 <= time.monotonic() - started < 5

    async def refused() -> None:
        raise PermissionError("not a failover")

    with pytest.raises(PermissionError):
        await retrying("refused", refused, retry_on=(ConnectionError,), base_s=10)
