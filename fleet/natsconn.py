"""The NATS connection every process opens, and get-or-create helpers for KV buckets.

A connection knows how many replicas the streams, KV buckets and object stores it creates get: one
on the embedded single server, three on a three-node cluster (``FLEET_NATS_REPLICAS``). Whoever
creates a stream first sets it; every process of a deployment is given the same number.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from fleet.errors import ErrorCode, FleetError

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a JetStream call meets while a cluster elects a leader or is slow under load: worth asking again.
TRANSIENT: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
RETRY_S = 0.2


class FleetConnection(NATS):
    """A NATS connection that carries the replica count of what it creates."""

    def __init__(self, replicas: int) -> None:
        super().__init__()
        self.replicas = replicas


def server_urls(url: str) -> list[str]:
    """``FLEET_NATS_URL`` as a list: one URL, or a cluster's seed servers separated by commas."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise FleetError(ErrorCode.INVALID_REQUEST, "no NATS server URL given")
    return urls


async def connect(url: str, name: str, *, replicas: int = 1) -> NATS:
    """Connect to NATS (``url``: one server or a comma-separated list of a cluster's servers),
    failing within seconds (never hanging) if no server is reachable. Once connected it follows the
    cluster: a node going away moves the connection to another, and publishes wait for it.

    ``replicas``: the replicas of every stream, KV bucket and object store created through this
    connection (1 to 5, at most the cluster's size)."""
    if not 1 <= replicas <= 5:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"NATS replicas must be 1 to 5, not {replicas}")
    servers = server_urls(url)
    client = FleetConnection(replicas)
    try:
        await client.connect(
            servers=servers,
            name=name,
            connect_timeout=5,
            max_reconnect_attempts=-1,
            allow_reconnect=True,
            # The order of a cluster's URLs should not decide which node every process lands on.
            dont_randomize=False,
        )
    except (OSError, nats.errors.Error, TimeoutError) as exc:
        raise FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE, f"cannot reach NATS at {url}", retryable=True
        ) from exc
    return client


async def patiently(what: str, action: Callable[[], Awaitable[T]], *, patience_s: float = 30.0) -> T:
    """``action`` (a JetStream call), tried again while it fails in a :data:`TRANSIENT` way, for
    up to ``patience_s``; the last failure is raised after that. Only for calls that are safe to
    repeat (a lookup, a create-if-missing, a publish with a message id)."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return await action()
        except TRANSIENT as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning("%s: %s from NATS; trying again", what, type(exc).__name__)
            await asyncio.sleep(RETRY_S)


def stream_replicas(endpoints: Mapping[str, Any]) -> int:
    """The replicas a running stack's streams get (its ``endpoints.json``), for a command that may
    be the first to create one."""
    value = endpoints.get("nats_replicas", 1)
    return value if isinstance(value, int) and 1 <= value <= 5 else 1


def replicas(handle: NATS | JetStreamContext) -> int:
    """How many replicas a stream, bucket or object store created through ``handle`` gets."""
    client = handle._nc if isinstance(handle, JetStreamContext) else handle
    return client.replicas if isinstance(client, FleetConnection) else 1


async def key_value(
    client: NATS,
    bucket: str,
    *,
    history: int = 5,
    ttl_s: float | None = None,
) -> KeyValue:
    """The KV bucket ``bucket``, created (file storage) if it does not exist yet."""
    js = client.jetstream()

    async def get_or_create() -> KeyValue:
        try:
            return await js.key_value(bucket)
        except BucketNotFoundError:
            config = KeyValueConfig(
                bucket=bucket, history=history, storage=StorageType.FILE, ttl=ttl_s, replicas=replicas(client)
            )
            return await js.create_key_value(config)

    return await patiently(f"opening KV bucket {bucket}", get_or_create)


# nats-py's ``KeyValue.history`` and ``KeyValue.keys`` read through a watcher that can signal "no
# more entries" before the entries already pushed to it are processed (its consumer reports nothing
# pending while none has been handled yet), and then answer empty on a loaded machine. These two read
# the bucket's stream directly instead: each answer is complete as of the moment it is asked.
_REMOVED = {b"DEL", b"PURGE"}


async def kv_history(bucket: KeyValue, key: str) -> list[tuple[int, bytes]]:
    """Every value ``key`` holds in ``bucket``'s kept history, oldest first: (revision, value).
    Deletions and purges are left out; empty if the key was never written."""
    js = bucket._js
    subject = f"{bucket._pre}{key}"
    kept: list[tuple[int, bytes]] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(bucket._stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return kept
        if not msg.headers or msg.headers.get("KV-Operation", "").encode() not in _REMOVED:
            kept.append((int(msg.seq or 0), msg.data or b""))
        seq = int(msg.seq or seq) + 1


async def kv_keys(bucket: KeyValue) -> list[str]:
    """The keys of ``bucket`` whose latest entry is a value (not a deletion), sorted."""
    info = await bucket._js.stream_info(bucket._stream, subjects_filter=f"{bucket._pre}>")
    keys = []
    for subject in sorted((info.state.subjects or {}).keys()):
        key = subject[len(bucket._pre) :]
        try:
            await bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        keys.append(key)
    return keys
