"""Revocations on a real NATS: a verifier refuses nothing until it has read the list, then refuses
tokens signed by a revoked key or issued to a client on one, as soon as the revocation is recorded
by another connection (another process, in the fleet)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from nats.js.errors import NotFoundError

from fleet.errors import AuthError, ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.revocations import REVOCATIONS_BUCKET, Revocation, Revocations, record_revocation
from fleet.tokens import TokenVerifier


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
        await record_revocation(writer, Revocation("old-leak", "agent-0", time.time(), "operator", "leaked"))
        issuer, client_key = SigningKey.generate(), SigningKey.generate()
        public = issuer.private_key.public_key()

        async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
            return public if kid == issuer.kid else None

        revocations = Revocations()
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
            writer, Revocation(client_key.kid, "agent-1", time.time(), "operator", "leaked")
        )
        await asyncio.wait_for(arrived[client_key.kid].wait(), 5)
        with pytest.raises(AuthError) as refused:
            await verifier.verify(token)  # unexpired, but issued to a client on a revoked key
        assert "revoked" in refused.value.message
        assert forgotten == ["old-leak", client_key.kid]

        verified_before = issuer.sign(claims())
        assert (await verifier.verify(verified_before)).sub == "agent-1"  # now remembered as verified
        await record_revocation(
            writer, Revocation(issuer.kid, "fleet-registry", time.time(), "operator", "rotated")
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
