"""How a run's grant is kept: packed losslessly to about a third, or kept as it is."""

from __future__ import annotations

import time
import uuid

import jwt

from coordinator.record.grant_storage import PACKED_V1, pack_grant, unpack_grant
from fleet.keys import SigningKey


def _grant(key: SigningKey, **extra: object) -> str:
    now = int(time.time())
    claims = {
        "iss": "fleet-registry",
        "sub": "operator",
        "client_id": "coordinator",
        "aud": "coordinator",
        "tenant": "acme",
        "scope": "agent:invoke",
        "iat": now,
        "nbf": now,
        "exp": now + 14 * 86400,
        "jti": uuid.uuid4().hex,
        "client_kid": SigningKey.generate().kid,
        "act": {"sub": "coordinator"},
        "chain_kids": [SigningKey.generate().kid],
        "sub_kind": "operator",
        "run_id": str(uuid.uuid4()),
        "token_use": "run_grant",
        **extra,
    }
    return key.sign(claims, typ="run-grant+jwt")


def test_a_grant_is_packed_to_well_under_half_and_unpacked_to_the_same_token() -> None:
    key = SigningKey.generate()
    for _ in range(20):
        token = _grant(key)
        packed = pack_grant(token)
        assert packed[0] == PACKED_V1 and len(packed) < 0.45 * len(token)
        assert unpack_grant(packed) == token
        # and it still verifies: the very same bytes were signed
        jwt.decode(
            unpack_grant(packed), key.private_key.public_key(), algorithms=["ES256"], audience="coordinator"
        )


def test_claims_the_dictionary_does_not_know_are_packed_too() -> None:
    token = _grant(SigningKey.generate(), note="é" * 300, chain_kids=["a", "b", "c"], sub="someone-else")
    assert unpack_grant(pack_grant(token)) == token


def test_what_would_not_come_back_the_same_is_kept_as_text() -> None:
    token = _grant(SigningKey.generate())
    header, claims, signature = token.split(".")
    padded = f"{header}.{claims}==.{signature}"  # decodes to the same claims, but is not this text
    for odd in ("not a token", "a.b", "!!.??.**", padded, ""):
        stored = pack_grant(odd)
        assert stored == odd.encode() and unpack_grant(stored) == odd


def test_a_grant_stored_before_packing_reads_as_it_was() -> None:
    token = _grant(SigningKey.generate())
    assert unpack_grant(token.encode()) == token
