"""Keys over time: an identity's replaced key verifies until its grace ends; the JWKS cache trusts
a key for the document's max-age, looks up a new key (waiting its turn rather than refusing), and
never trusts a forgotten (revoked) key again; a single-use token is good once."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet.errors import AuthError
from fleet.keys import SigningKey
from fleet.tokens import JwksCache, MemoryReplayGuard, TokenVerifier
from registry._records import IdentityRecord


def test_a_replaced_key_verifies_until_its_grace_ends_and_a_removed_one_not_at_all() -> None:
    first, second, third = (SigningKey.generate().public_jwk() for _ in range(3))
    record = IdentityRecord(id="agent", kind="specialist", keys={first["kid"]: first}, enrolled_at=0)
    rotated = record.with_key(second, now=1000.0, grace_s=600)
    assert set(rotated.usable_keys(1500.0)) == {first["kid"], second["kid"]}
    assert set(rotated.usable_keys(1601.0)) == {second["kid"]}  # the grace is over
    again = rotated.with_key(third, now=1100.0, grace_s=600)  # a second rotation keeps the first deadline
    assert again.retiring == {first["kid"]: 1600.0, second["kid"]: 1700.0}
    assert set(again.without_key(second["kid"]).usable_keys(1200.0)) == {first["kid"], third["kid"]}


class Issuer:
    """A JWKS endpoint whose keys the test changes, counting fetches."""

    def __init__(self, max_age: int) -> None:
        self.keys: list[dict[str, Any]] = []
        self.fetches: list[float] = []
        self.max_age = max_age
        self.fetched = asyncio.Event()

    def app(self) -> Starlette:
        async def jwks(request: Request) -> JSONResponse:
            self.fetches.append(time.monotonic())
            self.fetched.set()
            return JSONResponse({"keys": self.keys}, headers={"Cache-Control": f"max-age={self.max_age}"})

        return Starlette(routes=[Route("/jwks.json", jwks)])


@pytest.fixture
def issuer() -> Issuer:
    return Issuer(max_age=1)


def cache_for(issuer: Issuer, http: httpx.AsyncClient, interval_s: float = 0.5) -> JwksCache:
    return JwksCache("http://issuer/jwks.json", http, min_refresh_interval_s=interval_s)


async def test_the_cache_drops_a_retired_key_after_max_age_and_finds_a_new_one(issuer: Issuer) -> None:
    old, new = SigningKey.generate(), SigningKey.generate()
    issuer.keys = [old.public_jwk()]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=issuer.app())) as http:
        cache = cache_for(issuer, http)
        assert isinstance(await cache.get(old.kid), ec.EllipticCurvePublicKey)
        # The issuer rotates at once: the new key is asked for within the refetch interval. The
        # cache waits for its turn and finds it (no refusal), fetching at the allowed rate.
        issuer.keys = [old.public_jwk(), new.public_jwk()]
        assert await cache.get(new.kid) is not None
        assert len(issuer.fetches) == 2 and issuer.fetches[1] - issuer.fetches[0] >= 0.45
        # The old key leaves the JWKS: trusted until the document's max-age, then not.
        issuer.keys = [new.public_jwk()]
        assert await cache.get(old.kid) is not None
        await asyncio.sleep(1.05)
        assert await cache.get(old.kid) is None
        assert await cache.get("never-published") is None


async def test_a_forgotten_key_is_not_trusted_though_the_issuer_still_lists_it(issuer: Issuer) -> None:
    key = SigningKey.generate()
    issuer.keys = [key.public_jwk()]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=issuer.app())) as http:
        cache = cache_for(issuer, http)
        assert await cache.get(key.kid) is not None
        cache.forget(key.kid)
        assert await cache.get(key.kid) is None
        await asyncio.sleep(1.05)  # a refetch lists it again: still not trusted
        assert await cache.get(key.kid) is None


async def test_a_single_use_token_is_good_once() -> None:
    key = SigningKey.generate()
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    verifier = TokenVerifier(lookup, issuer="fleet-registry", audience="push", single_use=MemoryReplayGuard())
    now = int(time.time())
    claims = {"iss": "fleet-registry", "sub": "coordinator", "aud": "push", "tenant": "acme",
              "iat": now, "exp": now + 60, "jti": uuid.uuid4().hex}  # fmt: skip
    token = key.sign(claims)
    assert (await verifier.verify(token)).sub == "coordinator"
    with pytest.raises(AuthError) as replayed:
        await verifier.verify(token)
    assert replayed.value.message == "token was already used"
    assert (await verifier.verify(key.sign({**claims, "jti": uuid.uuid4().hex}))).sub == "coordinator"


async def test_unknown_kids_cost_one_fetch_per_interval_and_never_hold_up_a_stale_refresh(
    issuer: Issuer,
) -> None:
    """A caller floods the verifier with tokens naming kids no one published (L3). A kid already
    looked up is refused without another fetch; new ones share at most one fetch per interval; and
    a good token whose key went stale is verified after one fetch, not behind the flood's waits."""
    key = SigningKey.generate()
    issuer.keys = [key.public_jwk()]
    interval_s = 2.0
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=issuer.app())) as http:
        cache = cache_for(issuer, http, interval_s=interval_s)
        assert await cache.get(key.kid) is not None
        assert await cache.get("bogus") is None  # waits its turn, fetches once
        fetched = len(issuer.fetches)
        assert await asyncio.gather(*(cache.get("bogus") for _ in range(50))) == [None] * 50
        assert len(issuer.fetches) == fetched  # known to be unknown: no fetch

        async def flood() -> None:
            while True:
                await cache.get(uuid.uuid4().hex)

        flooding = [asyncio.create_task(flood()) for _ in range(20)]
        try:
            issuer.fetched.clear()
            await asyncio.wait_for(issuer.fetched.wait(), 10)  # the flood's fetch: the next is an interval on
            await asyncio.sleep(1.1)  # the good key's max-age (1 s) passes: it needs a refresh
            started = time.monotonic()
            assert await cache.get(key.kid) is not None
            waited = time.monotonic() - started
            during = time.monotonic()
            await asyncio.sleep(interval_s * 2)
        finally:
            for task in flooding:
                task.cancel()
            await asyncio.gather(*flooding, return_exceptions=True)
    assert waited < interval_s / 4, waited  # behind the flood's turn: the rest of the interval (0.9 s)
    assert len([t for t in issuer.fetches if t >= during]) <= 3  # one per interval, whatever the flood
