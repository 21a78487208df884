"""The one backoff every retry loop uses: waits that double up to a ceiling, spread by jitter so
that clients dropped together do not come back together, and a patience after which the last
failure is raised."""

from __future__ import annotations

import logging
import time

import pytest

from fleet.retry import Backoff, retry_until

log = logging.getLogger(__name__)


def test_waits_double_up_to_the_ceiling_each_between_half_and_all_of_it() -> None:
    backoff = Backoff(first_s=0.1, max_s=1.0)
    delays = [backoff.delay() for _ in range(8)]
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    backoff.reset()
    assert backoff.delay() <= 0.1


def test_clients_dropped_together_do_not_come_back_together() -> None:
    firsts = {round(Backoff(first_s=1.0).delay(), 6) for _ in range(50)}
    assert len(firsts) > 40


async def test_a_transient_failure_is_tried_again_until_it_passes() -> None:
    calls: list[float] = []

    async def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError("failing over")
        return "ok"

    assert (
        await retry_until(flaky, ConnectionError, patience_s=10, log=log, what="t", backoff=Backoff(0.01))
        == "ok"
    )
    assert len(calls) == 3


async def test_after_its_patience_the_last_failure_is_raised_and_others_at_once() -> None:
    async def down() -> None:
        raise ConnectionError("still failing over")

    started = time.monotonic()
    with pytest.raises(ConnectionError, match="still failing over"):
        await retry_until(
            down, ConnectionError, patience_s=0.2, log=log, what="t", backoff=Backoff(0.01, 0.05)
        )
    assert time.monotonic() - started >= 0.2

    attempts = 0

    async def broken() -> None:
        nonlocal attempts
        attempts += 1
        raise ValueError("not transient")

    with pytest.raises(ValueError):
        await retry_until(broken, ConnectionError, patience_s=10, log=log, what="t")
    assert attempts == 1
