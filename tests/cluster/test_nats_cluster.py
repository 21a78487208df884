"""The broker as production runs it: three routed ``nats-server`` processes, every stream R3.

A node is SIGKILLed under load. Every event a producer had acknowledged is still there, every event
it was still sending gets in on a retry with the same id, a consumer reads each of them, and the killed
node catches up when it returns. (A retry later than the stream's 100 ms de-duplication window may be
kept twice: the trigger ingest is idempotent by (tenant, source, id), so a copy starts nothing.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import Error as JetStreamError

from deploy.nats_cluster import NatsCluster, Node
from fleet.events import EVENTS_STREAM, event_subject, publish_event
from fleet.natsconn import connect
from tests.nats_protocol import answer_to_connect

EVENTS = 3000
KILL_AFTER = 1000  # events acknowledged before the stream's leader is killed
SUBJECT = "fleet.events.invoices.closed"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path / "nats", size=3) as running:
        yield running


async def publish_until_kept(client: NATS, n: int) -> None:
    """Publish event ``n`` the way a producer must: until the stream acknowledges it, with the same
    event id every time (the stream drops a copy it already has)."""
    for attempt in range(200):
        try:
            await publish_event(
                client,
                SUBJECT,
                tenant="acme",
                source="cluster-test",
                type_="invoices.closed",
                data={"n": n},
                event_id=f"ev-{n}",
            )
            return
        except (TimeoutError, NatsError, JetStreamError):
            await asyncio.sleep(min(0.05 * (attempt + 1), 0.5))
    raise AssertionError(f"event {n} was never acknowledged")


def leader_of(cluster: NatsCluster, info_leader: str | None) -> Node:
    assert info_leader, "the stream has no leader"
    return cluster.node_named(info_leader)


async def test_killing_the_streams_leader_under_load_loses_no_event_and_duplicates_none(
    cluster: NatsCluster,
) -> None:
    reader = await connect(cluster.url, "cluster-reader", replicas=3)
    await publish_until_kept(reader, 0)  # creates the R3 streams
    js = reader.jetstream()
    info = await js.stream_info(EVENTS_STREAM)
    assert info.config.num_replicas == 3
    assert info.cluster is not None and len(info.cluster.replicas or []) == 2
    leader = leader_of(cluster, info.cluster.leader)
    # The producer is connected to the node about to die; it learns the others from it.
    producer = await connect(leader.url, "cluster-producer", replicas=3)
    try:
        # A durable consumer reading while the producer publishes, as the trigger ingest does.
        consumer = await reader.jetstream().pull_subscribe(
            event_subject(SUBJECT, tenant="acme", source="cluster-test"),
            durable="cluster-test",
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=5
            ),
        )
        seen: list[str] = []
        done = asyncio.Event()

        async def consume() -> None:
            while len(set(seen)) < EVENTS:
                try:
                    messages = await consumer.fetch(200, timeout=1)
                except (TimeoutError, NatsError, JetStreamError):
                    continue
                for message in messages:
                    seen.append(json.loads(message.data)["id"])
                    # An ack lost with the node is redelivered later: seen again, which the set absorbs.
                    with contextlib.suppress(TimeoutError, NatsError, JetStreamError):
                        await message.ack_sync(timeout=2)
            done.set()

        reading = asyncio.create_task(consume())
        in_flight: set[asyncio.Task[None]] = set()
        for n in range(1, EVENTS):
            if n == KILL_AFTER:
                await asyncio.to_thread(cluster.kill, leader)  # the node the stream's writes go to
            task = asyncio.create_task(publish_until_kept(producer, n))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            if len(in_flight) >= 64:  # a producer with 64 publishes outstanding
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        async with asyncio.timeout(120):
            await asyncio.gather(*in_flight)
            await done.wait()
        await reading

        assert producer.connected_url is not None and producer.connected_url.port != leader.client_port
        info = await js.stream_info(EVENTS_STREAM)
        assert info.cluster is not None and info.cluster.leader != leader.name  # a new leader took over
        assert info.state.messages >= EVENTS  # none lost (a late retry may be kept twice)
        assert set(seen) == {f"ev-{n}" for n in range(EVENTS)}
        kept = info.state.messages

        # The killed node comes back on its own store and catches up with what it missed.
        await asyncio.to_thread(cluster.restart, leader)
        await asyncio.to_thread(cluster.wait_healthy)
        async with asyncio.timeout(60):
            while True:
                stream = leader.monitor("/jsz?streams=true&accounts=true")
                counts = [
                    detail["state"]["messages"]
                    for account in stream.get("account_details", [])
                    for detail in account.get("stream_detail", [])
                    if detail["name"] == EVENTS_STREAM
                ]
                if counts == [kept]:
                    break
                await asyncio.sleep(0.2)
    finally:
        for client in (producer, reader):
            await client.close()


def test_a_cluster_with_the_bus_keys_takes_no_anonymous_client_and_no_rogue_route(tmp_path: Path) -> None:
    """With the bus's keys, every node authenticates its clients (the registry's callout: here
    nobody answers it, so an anonymous client is refused) and its routes (a process that reaches a
    route port cannot join the cluster as a server and read every message)."""
    with NatsCluster(tmp_path / "nats", size=3, keys_dir=tmp_path / "keys") as secured:
        node = secured.nodes[1]
        assert "Authorization Violation" in answer_to_connect(
            node.client_port, lambda _: {"name": "anonymous"}
        )
        assert "Authorization Violation" in answer_to_connect(node.cluster_port, lambda _: {"name": "rogue"})
