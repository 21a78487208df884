"""The bus's catalog (what the bootstrap admin creates on an authenticated bus) and the services' own
get-or-create paths (what they create on a bare one) make the same streams and buckets: the same
subjects, retention, age, de-duplication window and history. Otherwise a stack would behave one way
on a test's bare server and another on the real bus."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from coordinator.record import work
from fleet import telemetry
from fleet.artifacts import NatsArtifactStore
from fleet.buscatalog import BUCKETS, OBJECT_STORES, STREAMS, provision
from fleet.events import ensure_event_streams, ensure_stream
from fleet.natsconn import connect, key_value
from fleet.revocations import REVOCATIONS_BUCKET
from fleet.signal_client import ensure_signal_streams
from fleetctl.console._session import SIGNED_OUT_BUCKET, SIGNED_OUT_KEPT_S
from fleetctl.testing.nats import embedded_nats
from mcp_servers._base import AUDIT_MAX_AGE_S, RUN_CALLS_BUCKET, RUN_CALLS_TTL_S
from mcp_servers.sandbox.server import WORKSPACES_BUCKET
from policy.live import (
    DECISIONS_MAX_AGE_S,
    DECISIONS_STREAM,
    HISTORY,
    POLICY_BUCKET,
    STATUS_BUCKET,
    STATUS_TTL_S,
)
from registry._store import NONCE_TTL_S, NONCES_BUCKET, RECORDS_BUCKET


@pytest.fixture
def two_servers() -> Iterator[tuple[str, str]]:
    with embedded_nats() as catalog, embedded_nats() as services:
        yield catalog, services


async def by_services(client: NATS) -> None:
    """What the services' own code creates, as each does it."""
    js = client.jetstream()
    await ensure_event_streams(js)
    await ensure_signal_streams(js)
    await work.ensure_stream(js)
    await ensure_stream(js, DECISIONS_STREAM, "fleet.decisions.>", max_age_s=DECISIONS_MAX_AGE_S)
    await ensure_stream(js, "FLEET_AUDIT", "fleet.audit.>", max_age_s=AUDIT_MAX_AGE_S)
    async with telemetry.publishing_metrics(client, "catalog-check", every_s=60):
        pass  # makes the metrics stream as a service does
    await key_value(client, RECORDS_BUCKET, history=5)
    await key_value(client, NONCES_BUCKET, history=1, ttl_s=NONCE_TTL_S)
    await key_value(client, REVOCATIONS_BUCKET, history=1)
    await key_value(client, POLICY_BUCKET, history=HISTORY)
    await key_value(client, STATUS_BUCKET, history=1, ttl_s=STATUS_TTL_S)
    await key_value(client, RUN_CALLS_BUCKET, history=1, ttl_s=RUN_CALLS_TTL_S)
    await key_value(client, WORKSPACES_BUCKET, history=1)
    await key_value(client, SIGNED_OUT_BUCKET, history=1, ttl_s=SIGNED_OUT_KEPT_S)
    await NatsArtifactStore.open(client)


async def configs(client: NATS) -> dict[str, dict[str, Any]]:
    js = client.jetstream()
    names = (
        [s.name for s in STREAMS] + [f"KV_{b.name}" for b in BUCKETS] + [f"OBJ_{o}" for o in OBJECT_STORES]
    )
    found = {}
    for name in names:
        config = (await js.stream_info(name)).config
        found[name] = {
            "subjects": config.subjects,
            "retention": config.retention,
            "max_age": config.max_age,
            "duplicate_window": config.duplicate_window,
            "max_msgs_per_subject": config.max_msgs_per_subject,
            "storage": config.storage,
        }
    return found


async def test_the_catalog_makes_what_the_services_would(two_servers: tuple[str, str]) -> None:
    catalog_url, services_url = two_servers
    admin = await connect(catalog_url, "bootstrap")
    services = await connect(services_url, "services")
    try:
        made = await provision(admin)
        assert len(made) == len(STREAMS) + len(BUCKETS) + len(OBJECT_STORES)
        await by_services(services)
        assert await configs(admin) == await configs(services)
        assert await provision(admin) == []  # run again, it changes nothing
    finally:
        await admin.close()
        await services.close()
