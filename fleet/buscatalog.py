"""Every stream, KV bucket and object store of the fleet's bus, and the bootstrap that creates them.

On an authenticated bus nobody but the bootstrap identity may create or change a stream: the
services only bind to what is here (``$JS.API.STREAM.INFO``), so whoever starts first cannot pick a
stream's retention, replicas or size. :func:`provision` creates what is missing and is run by
``fleet up`` (and by the bootstrap Job of a deployment) before any service starts; it is safe to run
again. The services' own get-or-create paths stay for a bus without authentication (a test's bare
server), where they create the same things with the same settings (``tests/broker/test_bus_catalog.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from fleet.events import EVENTS_DUPLICATE_WINDOW_S
from fleet.natsconn import patiently, replicas
from fleet.telemetry import METRICS_MAX_AGE_S, METRICS_MAX_PER_SOURCE, METRICS_STREAM, METRICS_SUBJECTS

DAY_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class StreamSpec:
    name: str
    subjects: str
    max_age_s: float | None
    duplicate_window_s: float = 3600.0
    work_queue: bool = False
    max_msgs_per_subject: int = -1  # -1: no limit but the age


@dataclass(frozen=True, slots=True)
class BucketSpec:
    name: str
    history: int = 1
    ttl_s: float | None = None


STREAMS: tuple[StreamSpec, ...] = (
    # Events are de-duplicated by the ingest, by (tenant, source, id): the broker's window, which
    # any producer's message id could use to drop another tenant's event, is the least it allows.
    StreamSpec("FLEET_EVENTS", "fleet.events.>", 7 * DAY_S, duplicate_window_s=EVENTS_DUPLICATE_WINDOW_S),
    StreamSpec("FLEET_DEAD_LETTERS", "fleet.dead.>", 7 * DAY_S),
    StreamSpec("FLEET_WORK", "fleet.work.>", None, duplicate_window_s=600.0, work_queue=True),
    StreamSpec("FLEET_APPROVALS", "fleet.approvals.>", 30 * DAY_S),
    StreamSpec("FLEET_SIGNALS", "fleet.signals.>", 30 * DAY_S),
    StreamSpec("FLEET_DECISIONS", "fleet.decisions.>", 30 * DAY_S),
    StreamSpec("FLEET_AUDIT", "fleet.audit.>", 90 * DAY_S),
    # Each process's metrics snapshots (fleet.telemetry): a few hours, and at most that many per
    # process at the fastest interval it may choose, whatever one publisher does.
    StreamSpec(
        METRICS_STREAM,
        METRICS_SUBJECTS,
        METRICS_MAX_AGE_S,
        max_msgs_per_subject=METRICS_MAX_PER_SOURCE,
    ),
)

BUCKETS: tuple[BucketSpec, ...] = (
    BucketSpec("fleet-registry", history=5),
    BucketSpec("fleet-nonces", ttl_s=900.0),
    BucketSpec("fleet-revocations"),
    BucketSpec("fleet-policy", history=16),
    BucketSpec("fleet-policy-status", ttl_s=60.0),
    BucketSpec("fleet-run-tool-calls", ttl_s=14 * DAY_S),
    BucketSpec("fleet_sandbox_workspaces"),
    BucketSpec("fleet-console-signouts", ttl_s=9 * 3600.0),
)

OBJECT_STORES: tuple[str, ...] = ("fleet_artifacts",)


async def provision(client: NATS) -> list[str]:
    """Create every stream, bucket and object store that does not exist yet (as the bootstrap
    identity); the names of those created."""
    js = client.jetstream()
    r = replicas(client)
    wanted: list[tuple[str, Callable[[], Awaitable[object]], Callable[[], Awaitable[object]]]] = []
    for stream in STREAMS:
        config = StreamConfig(
            name=stream.name,
            subjects=[stream.subjects],
            retention=RetentionPolicy.WORK_QUEUE if stream.work_queue else RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=stream.duplicate_window_s,
            max_age=stream.max_age_s,
            max_msgs_per_subject=stream.max_msgs_per_subject,
            num_replicas=r,
        )
        wanted.append((stream.name, partial(js.stream_info, stream.name), partial(js.add_stream, config)))
    for bucket in BUCKETS:
        kv = KeyValueConfig(
            bucket=bucket.name, history=bucket.history, storage=StorageType.FILE, ttl=bucket.ttl_s, replicas=r
        )
        wanted.append((bucket.name, partial(js.key_value, bucket.name), partial(js.create_key_value, kv)))
    for name in OBJECT_STORES:
        store = ObjectStoreConfig(
            bucket=name, storage=StorageType.FILE, description="fleet artifacts", replicas=r
        )
        wanted.append((name, partial(js.object_store, name), partial(js.create_object_store, name, store)))
    made = []
    for name, look, create in wanted:
        if await patiently(f"creating {name}", partial(_made, look, create)):
            made.append(name)
    return made


async def _made(look: Callable[[], Awaitable[object]], create: Callable[[], Awaitable[object]]) -> bool:
    """Whether ``create`` had to make what ``look`` did not find."""
    try:
        await look()
        return False
    except (NotFoundError, BucketNotFoundError):
        await create()
        return True
