"""The NATS connection's settings: a cluster's server list and the replicas of what it creates."""

from __future__ import annotations

import pytest

from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import connect, server_urls, stream_replicas


def test_a_cluster_is_named_by_its_servers_separated_by_commas() -> None:
    assert server_urls("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert server_urls(" nats://a:1, nats://b:2 ,nats://c:3,") == ["nats://a:1", "nats://b:2", "nats://c:3"]
    with pytest.raises(FleetError) as raised:
        server_urls(" , ")
    assert raised.value.code is ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize("replicas", [0, 6, -1])
async def test_a_replica_count_no_cluster_can_have_is_refused_before_connecting(replicas: int) -> None:
    with pytest.raises(FleetError) as raised:
        await connect("nats://127.0.0.1:9", "t", replicas=replicas)
    assert raised.value.code is ErrorCode.INVALID_REQUEST and str(replicas) in str(raised.value)


def test_a_command_creates_streams_with_the_replicas_its_stack_runs_with() -> None:
    assert stream_replicas({"nats": "nats://a:1,nats://b:2,nats://c:3", "nats_replicas": 3}) == 3
    assert stream_replicas({"nats": "nats://127.0.0.1:4222"}) == 1  # a stack from before the setting
    for nonsense in (0, 9, "3", None, True):
        assert stream_replicas({"nats_replicas": nonsense}) == 1
