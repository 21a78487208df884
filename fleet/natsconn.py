"""The NATS connection every process opens, and get-or-create helpers for KV buckets."""

from __future__ import annotations

import nats
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from fleet.errors import ErrorCode, FleetError


async def connect(url: str, name: str) -> NATS:
    """Connect to NATS, failing within seconds (never hanging) if the broker is unreachable."""
    try:
        client: NATS = await nats.connect(
            url,
            name=name,
            connect_timeout=5,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
        )
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        raise FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE, f"cannot reach NATS at {url}", retryable=True
        ) from exc
    return client


async def key_value(
    client: NATS,
    bucket: str,
    *,
    history: int = 5,
    ttl_s: float | None = None,
) -> KeyValue:
    """The KV bucket ``bucket``, created (file storage) if it does not exist yet."""
    js = client.jetstream()
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        config = KeyValueConfig(bucket=bucket, history=history, storage=StorageType.FILE, ttl=ttl_s)
        return await js.create_key_value(config)
