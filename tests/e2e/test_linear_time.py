"""A caller's large text does not stall the coordinator: its redaction reads the whole text in linear
time, off the event loop, while other callers' requests are answered."""

from __future__ import annotations

import asyncio

import pytest

from fleetctl.testing.e2e import Stack, user_message
from tests.e2e.a2a_helpers import INLINE_OUTLIERS, fresh_tenant, start

pytestmark = pytest.mark.e2e

ANSWER_WITHIN_S = 15.0  # one small request on a loaded 2-core machine; the old code stalled for minutes
# Letters without "://": the old URL-password pattern read each run once per letter (quadratic).
LARGE_TEXT = "a" * 900_000


async def test_a_900_kb_text_part_does_not_stall_the_coordinator_for_another_tenant(stack: Stack) -> None:
    large = asyncio.create_task(
        start(
            stack,
            stack.token("coordinator", tenant=fresh_tenant()),
            user_message(LARGE_TEXT, INLINE_OUTLIERS),
        )
    )
    other = stack.token("coordinator", tenant=fresh_tenant())
    answered_meanwhile = 0
    while not large.done():
        async with asyncio.timeout(ANSWER_WITHIN_S):
            task = await start(stack, other, user_message(data=INLINE_OUTLIERS))
        assert task.id
        answered_meanwhile += not large.done()
    accepted = await large
    assert accepted.id
    assert answered_meanwhile >= 1, "the large request was accepted before another could be sent"
