"""The artifact store on a real NATS: what is stored is sealed with the tenant's key under a name that
reveals no hash, reads check the seal and the hash, and bytes changed at rest are refused."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from fleet.artifacts import NatsArtifactStore, object_name
from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import connect
from fleet.tenant_keys import MasterSecret

MASTER = MasterSecret("m-test", bytes(range(32)))
ACME, GLOBEX = MASTER.tenant_key("acme"), MASTER.tenant_key("globex")
SECRET = b"acme's quarterly numbers: 4,211,007"


@pytest.fixture
async def client(nats_url: str) -> AsyncIterator[NATS]:
    made = await connect(nats_url, "sealed-artifacts")
    yield made
    await made.close()


async def store_of(client: NATS) -> NatsArtifactStore:
    return await NatsArtifactStore.open(client, bucket=f"artifacts_{uuid.uuid4().hex[:8]}")


async def test_a_stored_artifact_is_ciphertext_under_a_name_without_its_hash(client: NATS) -> None:
    store = await store_of(client)
    ref = await store.put(ACME, SECRET, "text/plain")
    assert ref.uri == "artifact:sha256:" + hashlib.sha256(SECRET).hexdigest()
    raw = store._store  # the bucket as anyone with bus rights on it reads it
    names = [info.name for info in await raw.list()]
    assert names == [object_name(ACME, ref.sha256)] and ref.sha256 not in names[0]
    stored = (await raw.get(names[0])).data or b""
    assert SECRET not in stored and len(stored) > len(SECRET)
    assert await store.get(ACME, ref.uri) == SECRET


async def test_another_tenant_neither_finds_nor_reads_it(client: NATS) -> None:
    store = await store_of(client)
    ref = await store.put(ACME, SECRET)
    assert not await store.exists(GLOBEX, ref.sha256)
    with pytest.raises(FleetError) as caught:
        await store.get(GLOBEX, ref.sha256)
    assert caught.value.code == ErrorCode.NOT_FOUND


async def test_bytes_changed_or_planted_at_rest_are_refused(client: NATS) -> None:
    store = await store_of(client)
    ref = await store.put(ACME, SECRET)
    name = object_name(ACME, ref.sha256)
    await store._store.put(name, b"planted plaintext")
    with pytest.raises(FleetError) as caught:
        await store.get(ACME, ref.sha256)
    assert caught.value.code == ErrorCode.INTEGRITY_FAILED
    # Another of the tenant's own sealed objects moved under this name: the seal names its place.
    other = await store.put(ACME, b"another artifact")
    moved = (await store._store.get(object_name(ACME, other.sha256))).data or b""
    await store._store.put(name, moved)
    with pytest.raises(FleetError) as caught:
        await store.get(ACME, ref.sha256)
    assert caught.value.code == ErrorCode.INTEGRITY_FAILED


async def test_the_same_bytes_are_stored_once_per_tenant(client: NATS) -> None:
    store = await store_of(client)
    await store.put(ACME, SECRET)
    await store.put(ACME, SECRET)
    await store.put(GLOBEX, SECRET)
    assert len(await store._store.list()) == 2
