"""The NATS connection every process opens, and get-or-create helpers for KV buckets."""

from __future__ import annotations

import nats
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError
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
