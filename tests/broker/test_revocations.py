"""Revocations on a real NATS: a verifier refuses nothing until it has read the list, then refuses
tokens signed by a revoked key or issued to a client on one, as soon as the revocation is recorded
by another connection (another process, in the fleet). Only entries the registry signed count:
anything else written to the bucket is ignored and counted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from nats.js.errors import NotFoundError

from fleet.errors import AuthError, ErrorCode, FleetError
from fleet.issuer_certs import CertifiedKey, IssuerTrust, certify_issuer_key
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.revocations import (
    REVOCATIONS_BUCKET,
    Revocation,
    Revocations,
    record_revocation,
    signed_revocation,
)
from fleet.tokens import TokenVerifier

ISSUER = "fleet-registry"
OPERATOR = SigningKey.generate()
TRUST = IssuerTrust(OPERATOR.public_jwk(), ISSUER)


def certified(key: SigningKey | None = None, operator: SigningKey = OPERATOR) -> CertifiedKey:
    key = key or SigningKey.generate()
    return CertifiedKey(key, certify_issuer_key(operator, ISSUER, key.public_jwk()))


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    return {
        "iss": "fleet-registry", "sub": "agent-1", "aud": "coordinator", "tenant": "acme", "scope": "",
        "iat": now, "exp": now + 300, "jti": uuid.uuid4().hex, **overrides,
    }  # fmt: skip


async def test_a_revocation_reaches_a_verifier_that_follows_the_list(nats_url: str) -> None:
    writer, reader = await connect(nats_url, "registry"), await connect(nats_url, "service")
    try:
        with contextlib.suppress(NotFoundError):
            await writer.jetstream().delete_key_value(REVOCATIONS_BUCKET)  # this test's own list
        registry = certified()
        await record_revocation(
            writer, Revocation("old-leak", "agent-0", time.time(), "operator", "leaked"), registry, ISSUER
        )
        issuer, client_key = SigningKey.generate(), SigningKey.generate()
        public = issuer.private_key.public_key()

        async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
            return public if kid == issuer.kid else None

        revocations = Revocations(TRUST)
        verifier = TokenVerifier(
            lookup, issuer="fleet-registry", audience="coordinator", revocations=revocations
        )
        token = issuer.sign(claims(client_kid=client_key.kid))
        with pytest.raises(FleetError) as unsure:
            await verifier.verify(token)  # the list is not read yet: nothing is trusted
        assert unsure.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE

        forgotten: list[str] = []
        arrived: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

        def noted(revocation: Revocation) -> None:
            forgotten.append(revocation.kid)
            arrived[revocation.kid].set()

        revocations.on_revoke(noted)
        await revocations.follow(reader)
        assert revocations.check("old-leak") is not None  # what was revoked before it started
        assert (await verifier.verify(token)).sub == "agent-1"

        await record_revocation(
            writer, Revocation(client_key.kid, "agent-1", time.time(), "operator", "leaked"), registry, ISSUER
        )
        await asyncio.wait_for(arrived[client_key.kid].wait(), 5)
        with pytest.raises(AuthError) as refused:
            await verifier.verify(token)  # unexpired, but issued to a client on a revoked key
        assert "revoked" in refused.value.message
        assert forgotten == ["old-leak", client_key.kid]

        verified_before = issuer.sign(claims())
        assert (await verifier.verify(verified_before)).sub == "agent-1"  # now remembered as verified
        await record_revocation(
            writer,
            Revocation(issuer.kid, "fleet-registry", time.time(), "operator", "rotated"),
            registry,
            ISSUER,
        )
        await asyncio.wait_for(arrived[issuer.kid].wait(), 5)
        for token in (issuer.sign(claims()), verified_before):
            with pytest.raises(AuthError) as signed:
                await verifier.verify(token)
            assert signed.value.message == "token signed by a revoked key"
        await revocations.stop()
    finally:
        await writer.drain()
        await reader.drain()


async def _fresh_list(nats_url: str) -> tuple[Any, Any]:
    writer, reader = await connect(nats_url, "registry"), await connect(nats_url, "service")
    with contextlib.suppress(NotFoundError):
        await writer.jetstream().delete_key_value(REVOCATIONS_BUCKET)  # this test's own list
    return writer, reader


async def test_entries_the_registry_did_not_sign_are_ignored_and_counted(nats_url: str) -> None:
    writer, reader = await _fresh_list(nats_url)
    try:
        registry, foreign = certified(), certified(operator=SigningKey.generate())
        bucket = await writer.jetstream().create_key_value(bucket=REVOCATIONS_BUCKET)
        target = registry.key.kid
        plain = Revocation(target, ISSUER, time.time(), "attacker", "forged")
        forged = {
            "unsigned": json.dumps(plain.to_json()).encode(),
            "foreign": signed_revocation(plain, foreign, ISSUER),  # certified by another operator
            "garbage": b"{not json",
        }
        for n, value in enumerate(forged.values()):
            await bucket.put(f"kid.{target}" if n == 0 else f"kid.x{n}", value)
        # a genuine entry moved to another key: it revokes what it names, not what its key says
        await bucket.put(
            f"kid.{target}-moved", signed_revocation(Revocation("other", ISSUER, 0, "", ""), registry, ISSUER)
        )
        revocations = Revocations(TRUST)
        await revocations.follow(reader)
        assert revocations.check(target, "other") is None
        assert revocations.ignored == 4
        await revocations.stop()
    finally:
        await writer.drain()
        await reader.drain()


async def test_a_revocation_signed_by_a_retired_key_still_counts_but_not_by_a_key_revoked_before(
    nats_url: str,
) -> None:
    writer, reader = await _fresh_list(nats_url)
    try:
        old, new = certified(), certified()
        # signed by the key in use then (retired since, its grace long over): still good
        await record_revocation(writer, Revocation("leaked-1", "agent-1", 0, "operator", ""), old, ISSUER)
        await record_revocation(writer, Revocation(old.key.kid, ISSUER, 0, "operator", "leaked"), new, ISSUER)
        # made with the old key after it was revoked (it leaked): ignored
        await record_revocation(writer, Revocation(new.key.kid, ISSUER, 0, "attacker", ""), old, ISSUER)
        revocations = Revocations(TRUST)
        await revocations.follow(reader)
        assert revocations.check("leaked-1") is not None and revocations.check(old.key.kid) is not None
        assert revocations.check(new.key.kid) is None and revocations.ignored == 1
        await revocations.stop()
    finally:
        await writer.drain()
        await reader.drain()
