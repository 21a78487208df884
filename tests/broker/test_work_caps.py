"""A tenant's runs in flight on the work queue, on a real JetStream: at most its policy's
``max_in_flight`` over every pull at once (its consumer's ``max_ack_pending``), and a pull passes
over a tenant at its cap straight to the next tenant's work; while another tenant has work, a
tenant's cap is its share; an idle pull wakes when work comes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from coordinator.record import work
from fleet.natsconn import connect


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[NATS]:
    nc = await connect(nats_url, "test-work-caps")
    js = nc.jetstream()
    with contextlib.suppress(NotFoundError):  # another test's stream on the session's server
        await js.delete_stream(work.STREAM)
    await work.ensure_stream(js)
    yield nc
    await js.delete_stream(work.STREAM)
    await nc.drain()


async def caps(tenant: str) -> work.InFlight:
    cap = {"flooder": 2}.get(tenant, 4)
    return work.InFlight(alone=cap, shared=cap)


async def shared_caps(tenant: str) -> work.InFlight:
    return work.InFlight(alone=3, shared=1)


async def given(client: NATS, tenant: str) -> int:
    info = await client.jetstream().consumer_info(work.STREAM, f"{work.CONSUMER}-{tenant}")
    return int(info.config.max_ack_pending or 0)


async def pulled(queues: list[work.TenantQueues]) -> list[str]:
    """One message from each pull, unacked (in flight): the tenants they are of."""
    taken = []
    for queue in queues:
        message: Msg | None = await queue.next()
        assert message is not None
        taken.append(message.subject.rsplit(".", 1)[1])
    return taken


async def test_a_tenant_at_its_cap_is_passed_over_for_the_next_tenants_work(client: NATS) -> None:
    for n in range(6):
        await work.submit_run(client, f"flood-{n}", tenant="flooder")
    await work.submit_run(client, "victim-0", tenant="victim")
    queues = [work.TenantQueues(client, ack_wait_s=30.0, cap=caps) for _ in range(4)]
    try:
        taken = await pulled(queues[:3])
        # Without the cap the third pull would have been the flooder's third run in flight.
        assert sorted(taken) == ["flooder", "flooder", "victim"]
        info = await client.jetstream().consumer_info(work.STREAM, f"{work.CONSUMER}-flooder")
        assert info.config.max_ack_pending == 2
        assert info.num_ack_pending == 2
        assert await queues[3].next() is None  # nothing deliverable: the flooder is at its cap
    finally:
        for queue in queues:
            await queue.close()


async def test_a_run_acked_makes_room_for_the_tenants_next(client: NATS) -> None:
    for n in range(3):
        await work.submit_run(client, f"flood-{n}", tenant="flooder")
    queues = [work.TenantQueues(client, ack_wait_s=30.0, cap=caps) for _ in range(2)]
    try:
        first = await queues[0].next()
        assert first is not None
        assert await queues[1].next() is not None
        assert await queues[1].next() is None
        await first.ack()
        again = await queues[1].next()
        assert again is not None and again.subject == work.run_subject("flooder")
    finally:
        for queue in queues:
            await queue.close()


async def test_a_run_whose_worker_died_is_redelivered_although_its_tenant_is_at_its_cap(client: NATS) -> None:
    for n in range(3):
        await work.submit_run(client, f"flood-{n}", tenant="flooder")
    dead = work.TenantQueues(client, ack_wait_s=1.0, cap=caps)
    alive = work.TenantQueues(client, ack_wait_s=1.0, cap=caps)
    try:
        lost = [await dead.next(), await dead.next()]  # taken, never acked: the worker died
        assert all(m is not None for m in lost)
        async with asyncio.timeout(10):
            while (again := await alive.next()) is None:
                pass
        # One of the dead pull's runs again, not the third: the tenant is still at its cap.
        assert again.data in {m.data for m in lost if m is not None}
        assert again.metadata.num_delivered == 2
    finally:
        await dead.close()
        await alive.close()


async def test_an_idle_pull_is_woken_by_work_submitted_not_by_its_timer(client: NATS) -> None:
    bell = work.WorkBell()
    await bell.follow(client)
    queue = work.TenantQueues(client, ack_wait_s=30.0, cap=caps, bell=bell, idle_wait_s=120.0)
    try:
        waiting = asyncio.create_task(queue.next())
        await asyncio.sleep(0.5)
        assert not waiting.done()  # nothing to take: it waits
        await work.submit_run(client, "victim-0", tenant="victim")
        async with asyncio.timeout(30):  # far less than its idle wait
            message = await waiting
        assert message is not None and message.data == b"victim-0"
    finally:
        await queue.close()


async def test_a_tenant_alone_has_its_cap_and_only_its_share_while_another_has_work(client: NATS) -> None:
    shares = work.WorkShares(contending_s=1.0)
    for n in range(5):
        await work.submit_run(client, f"flood-{n}", tenant="flooder")
    queues = [work.TenantQueues(client, ack_wait_s=30.0, cap=shared_caps, shares=shares) for _ in range(4)]
    try:
        assert await pulled(queues[:3]) == ["flooder"] * 3  # alone: its whole cap
        assert await given(client, "flooder") == 3
        await work.submit_run(client, "victim-0", tenant="victim")
        victim = await queues[3].next()
        assert victim is not None and victim.subject == work.run_subject("victim")
        assert await given(client, "flooder") == 1  # another tenant has work: the flooder's share
        await victim.ack()
        await asyncio.sleep(1.5)  # the victim has had no work for longer than contending_s
        assert await queues[3].next() is None  # the flooder has 3 in flight: its cap again, reached
        assert await given(client, "flooder") == 3
    finally:
        for queue in queues:
            await queue.close()
