"""The registry's records on a real NATS: what the registry wrote reads back; what anyone else
wrote to the bucket (a plain record, a signed one moved to another key, one by a key the operator
did not certify) reads as absent and is counted; a record whose signing key is revoked reads as
absent unless the registry signed it again first."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from fleet.issuer_certs import CertifiedKey, IssuerTrust, certify_issuer_key
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.tokens import CLIENT_ASSERTION_TYPE, client_assertion
from policy import RegorusEngine
from registry._records import IdentityRecord, McpServerRecord
from registry._seal import RecordSeal
from registry._store import RECORDS_BUCKET, RegistryStore
from registry._token_service import OAuthError, TokenService

ISSUER = "fleet-registry"


def certified(operator: SigningKey) -> CertifiedKey:
    key = SigningKey.generate()
    return CertifiedKey(key, certify_issuer_key(operator, ISSUER, key.public_jwk()))


@contextlib.asynccontextmanager
async def registry_bucket(nats_url: str) -> AsyncIterator[NATS]:
    client = await connect(nats_url, "registry")
    with contextlib.suppress(NotFoundError):
        await client.jetstream().delete_key_value(RECORDS_BUCKET)  # this test's own records
    try:
        yield client
    finally:
        await client.drain()


def server(url: str) -> McpServerRecord:
    return McpServerRecord(id="mcp-sql", url=url, audience="mcp-sql", registered_at=time.time())


async def test_only_records_the_registry_signed_under_their_own_key_read_back(nats_url: str) -> None:
    operator = SigningKey.generate()
    revoked: set[str] = set()
    async with registry_bucket(nats_url) as client:
        seal = RecordSeal(IssuerTrust(operator.public_jwk(), ISSUER), revoked.__contains__)
        seal.signer = certified(operator)
        store = await RegistryStore.open(client, seal)
        await store.put_mcp_server(server("http://mcp-sql/mcp"))
        found = await store.mcp_server("mcp-sql")
        assert found is not None and found.url == "http://mcp-sql/mcp"
        bucket = await client.jetstream().key_value(RECORDS_BUCKET)
        genuine = (await bucket.get("mcp.mcp-sql")).value
        assert genuine is not None
        await bucket.put("mcp.mcp-other", genuine)  # moved: it was signed for mcp.mcp-sql
        await bucket.put("mcp.mcp-plain", server("http://evil/mcp").model_dump_json().encode())
        foreign = RecordSeal(IssuerTrust(operator.public_jwk(), ISSUER), revoked.__contains__)
        foreign.signer = certified(SigningKey.generate())  # certified by another operator
        await bucket.put(
            "mcp.mcp-foreign", foreign.seal("mcp.mcp-foreign", server("http://evil/mcp").model_dump())
        )
        assert [m.id for m in await store.mcp_servers()] == ["mcp-sql"]
        assert seal.refused == 3


async def test_a_revoked_signing_key_leaves_only_the_records_signed_again(nats_url: str) -> None:
    operator = SigningKey.generate()
    revoked: set[str] = set()
    async with registry_bucket(nats_url) as client:
        seal = RecordSeal(IssuerTrust(operator.public_jwk(), ISSUER), revoked.__contains__)
        old, new = certified(operator), certified(operator)
        seal.signer = old
        store = await RegistryStore.open(client, seal)
        for name in ("a", "b"):
            await store.put_identity(IdentityRecord(id=name, kind="specialist", enrolled_at=0))
        assert (await store.identity("a")) is not None  # remembered as verified
        seal.signer = new  # a rotation: what the old key signed still verifies
        assert (await store.identity("b")) is not None
        assert await store.reseal() == 2 and await store.reseal() == 0
        await store.put_identity(IdentityRecord(id="c", kind="specialist", enrolled_at=0))
        revoked.add(old.key.kid)
        assert [i.id for i in await store.identities()] == ["a", "b", "c"]
        revoked.add(new.key.kid)
        assert await store.identities() == []  # the memo does not outlive a revocation


class CountingStore(RegistryStore):
    """The registry's store, counting its reads of identity records."""

    reads = 0

    async def identity(self, identity_id: str) -> IdentityRecord | None:
        self.reads += 1
        return await super().identity(identity_id)


TOKEN_URL = "https://registry.example/oauth/token"


async def outcome(service: TokenService, key: SigningKey, client_id: str) -> str:
    """The OAuth error of a client-credentials request with an assertion by ``key`` ("" if none)."""
    form = {"grant_type": "client_credentials", "client_assertion_type": CLIENT_ASSERTION_TYPE,
            "client_assertion": client_assertion(key, client_id, TOKEN_URL), "audience": client_id,
            "tenant": "acme"}  # fmt: skip
    try:
        await service.grant(form)
    except OAuthError as exc:
        return exc.error
    return ""


async def test_assertions_with_made_up_keys_share_one_identity_read_and_a_new_key_is_still_found(
    nats_url: str,
) -> None:
    """L3: assertions naming a real client with key ids it never enrolled read its record at most
    once per interval, not once each; a key enrolled a moment ago is found at the next read."""
    operator = SigningKey.generate()
    async with registry_bucket(nats_url) as client:
        seal = RecordSeal(IssuerTrust(operator.public_jwk(), ISSUER), lambda kid: False)
        seal.signer = certified(operator)
        store = await CountingStore.open(client, seal)
        assert isinstance(store, CountingStore)
        key = SigningKey.generate()
        record = IdentityRecord(id="agent-x", kind="specialist", keys={key.kid: key.public_jwk()},
                                tenants=["acme"], enrolled_at=0)  # fmt: skip
        await store.put_identity(record)
        service = TokenService(
            store, SigningKey.generate(), ISSUER, TOKEN_URL, policy=RegorusEngine.from_dir()
        )
        assert await outcome(service, key, "agent-x") != "invalid_client"  # authenticated
        before = store.reads
        made_up = [SigningKey.generate() for _ in range(40)]
        refused = await asyncio.gather(*(outcome(service, k, "agent-x") for k in made_up))
        assert refused == ["invalid_client"] * 40
        assert store.reads - before <= 2, store.reads - before  # one each before
        new = SigningKey.generate()
        await store.put_identity(record.with_key(new.public_jwk(), now=time.time(), grace_s=60))
        assert await outcome(service, new, "agent-x") != "invalid_client"
