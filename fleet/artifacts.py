"""Artifacts: large outputs kept by content, referenced from events and tool results by hash.

An artifact is named by the SHA-256 of its bytes (``artifact:sha256:<hex>``), inside its tenant's
space: the same bytes stored twice are stored once, a reference cannot be made to point at other
bytes, and a tenant can neither read nor learn of another tenant's artifact by guessing its hash.

What is stored is sealed with the tenant's key (:mod:`fleet.tenant_keys`): AES-256-GCM bound to the
tenant, the object's name and the key's version, under a name that is a keyed hash of the plaintext's
hash (``<tenant>/<HMAC(k_T, sha256)>``). So whoever can read the bucket (a bus identity with rights on
it, a stolen backup) sees ciphertext and names that reveal no hash; bytes changed, moved or planted
at rest do not open and are refused, and the hash is checked again on every read. Every call takes the
tenant's :class:`~fleet.tenant_keys.TenantKey`: no key, no artifact. The store keeps this format only:
objects written before it (plaintext, named by their hash) are not read.

``ArtifactStore`` is the interface (an S3-style store fits it); ``NatsArtifactStore`` is the one the
fleet ships, on the JetStream object store of the fleet's NATS (file storage, replicated by the
stream in production).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import ObjectStore

from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import patiently, replicas
from fleet.tenant_keys import TenantKey

BUS_PATIENCE_S = 15.0  # how long an artifact waits for the bus to answer before the call fails

ARTIFACTS_BUCKET = "fleet_artifacts"
MAX_ARTIFACT_BYTES = 64 * 1024 * 1024
SEAL_PURPOSE = "artifact"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
URI_PREFIX = "artifact:sha256:"


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """What a tool result or an event carries instead of the bytes."""

    sha256: str
    size: int
    media_type: str = "application/octet-stream"

    @property
    def uri(self) -> str:
        return URI_PREFIX + self.sha256

    def to_json(self) -> dict[str, object]:
        return {"uri": self.uri, "sha256": self.sha256, "size": self.size, "media_type": self.media_type}


def parse_ref(value: str) -> str:
    """The hash in ``artifact:sha256:<hex>`` or a bare hex digest; anything else is refused."""
    digest = value.removeprefix(URI_PREFIX).strip().lower()
    if not _SHA256.match(digest):
        raise FleetError(
            ErrorCode.INVALID_REQUEST, "an artifact reference is artifact:sha256:<64 hex digits>"
        )
    return digest


class ArtifactStore(Protocol):
    async def put(self, key: TenantKey, data: bytes, media_type: str = ...) -> ArtifactRef: ...

    async def get(self, key: TenantKey, sha256: str) -> bytes: ...

    async def exists(self, key: TenantKey, sha256: str) -> bool: ...


def object_name(key: TenantKey, sha256: str) -> str:
    """Where the artifact of ``key``'s tenant with this hash is kept: the hash itself is not in it."""
    return f"{key.tenant}/{key.name(SEAL_PURPOSE, sha256)}"


class NatsArtifactStore:
    """Artifacts in a JetStream object store bucket, one sealed object per (tenant, hash)."""

    def __init__(self, store: ObjectStore, *, max_bytes: int = MAX_ARTIFACT_BYTES) -> None:
        self._store = store
        self._max_bytes = max_bytes

    @classmethod
    async def open(
        cls, client: NATS, *, bucket: str = ARTIFACTS_BUCKET, max_bytes: int = MAX_ARTIFACT_BYTES
    ) -> NatsArtifactStore:
        js = client.jetstream()
        try:
            store = await js.object_store(bucket)
        except BucketNotFoundError:
            store = await js.create_object_store(
                bucket,
                ObjectStoreConfig(
                    bucket=bucket,
                    storage=StorageType.FILE,
                    description="fleet artifacts",
                    replicas=replicas(js),
                ),
            )
        return cls(store, max_bytes=max_bytes)

    async def exists(self, key: TenantKey, sha256: str) -> bool:
        try:
            info = await self._store.get_info(object_name(key, parse_ref(sha256)))
        except NotFoundError:
            return False
        return not info.deleted

    async def put(
        self, key: TenantKey, data: bytes, media_type: str = "application/octet-stream"
    ) -> ArtifactRef:
        if len(data) > self._max_bytes:
            raise FleetError(
                ErrorCode.INVALID_REQUEST, f"an artifact is at most {self._max_bytes} bytes, not {len(data)}"
            )
        digest = hashlib.sha256(data).hexdigest()
        ref = ArtifactRef(digest, len(data), media_type)
        if not await patiently(
            "looking up an artifact", lambda: self.exists(key, digest), patience_s=BUS_PATIENCE_S
        ):
            name = object_name(key, digest)
            sealed = key.seal(SEAL_PURPOSE, name, data)
            # Safe to repeat: the same name gets the same content. A stream without a leader for a
            # moment (a node of the bus coming back from a partition) answers no one: wait for it.
            await patiently(
                "storing an artifact",
                lambda: self._store.put(name, sealed, meta=ObjectMeta(name=name, description="sealed")),
                patience_s=BUS_PATIENCE_S,
            )
        return ref

    async def get(self, key: TenantKey, sha256: str) -> bytes:
        digest = parse_ref(sha256)
        name = object_name(key, digest)
        try:
            result = await self._store.get(name)
        except NotFoundError as exc:
            raise FleetError(ErrorCode.NOT_FOUND, f"no artifact {URI_PREFIX}{digest}") from exc
        data = key.open(SEAL_PURPOSE, name, bytes(result.data or b""))
        if hashlib.sha256(data).hexdigest() != digest:
            raise FleetError(
                ErrorCode.INTEGRITY_FAILED, f"artifact {URI_PREFIX}{digest} does not match its hash"
            )
        return data
