"""Token verification: the checks every service relies on."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from fleet.errors import AuthError, ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.settings import ExternalIssuer
from fleet.tokens import (
    Claims,
    ExternalTokenVerifier,
    FederatedVerifier,
    MemoryReplayGuard,
    TokenVerifier,
    bearer_token,
    decode_es256,
)

ISSUER = "fleet-registry"


@pytest.fixture
def key() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture
def verifier(key: SigningKey) -> TokenVerifier:
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    return TokenVerifier(lookup, issuer=ISSUER, audience="coordinator")


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base: dict[str, Any] = {
        "iss": ISSUER,
        "sub": "operator",
        "aud": "coordinator",
        "tenant": "acme",
        "scope": "agent:invoke",
        "iat": now,
        "exp": now + 300,
        "jti": uuid.uuid4().hex,
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


async def test_valid_token_yields_its_claims(key: SigningKey, verifier: TokenVerifier) -> None:
    verified = await verifier.verify(key.sign(claims()), required_scopes=["agent:invoke"])
    assert (verified.sub, verified.tenant, verified.scopes) == ("operator", "acme", {"agent:invoke"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"exp": int(time.time()) - 60}, "token expired"),
        ({"aud": "stats"}, "token is not meant for this service"),
        ({"iss": "someone-else"}, "token from another issuer"),
        ({"tenant": None}, "token lacks the tenant claim"),
        ({"jti": None}, "token lacks the jti claim"),
    ],
)
async def test_bad_claims_are_rejected(
    key: SigningKey, verifier: TokenVerifier, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(AuthError) as caught:
        await verifier.verify(key.sign(claims(**overrides)))
    assert caught.value.message == message
    assert caught.value.code == ErrorCode.UNAUTHENTICATED


async def test_token_signed_by_an_unknown_key_is_rejected(verifier: TokenVerifier) -> None:
    with pytest.raises(AuthError, match="unknown key"):
        await verifier.verify(SigningKey.generate().sign(claims()))


async def test_symmetric_algorithm_confusion_is_rejected(verifier: TokenVerifier) -> None:
    forged = jwt.encode(claims(), "s" * 32, algorithm="HS256", headers={"kid": "x"})
    with pytest.raises(AuthError, match="algorithm not allowed"):
        await verifier.verify(forged)


async def test_unsigned_token_is_rejected(verifier: TokenVerifier) -> None:
    forged = jwt.encode(claims(), None, algorithm="none")  # type: ignore[arg-type]
    with pytest.raises(AuthError):
        await verifier.verify(forged)


async def test_missing_scope_is_forbidden_not_unauthenticated(
    key: SigningKey, verifier: TokenVerifier
) -> None:
    with pytest.raises(FleetError) as caught:
        await verifier.verify(key.sign(claims(scope="registry:read")), required_scopes=["agent:invoke"])
    assert caught.value.code == ErrorCode.FORBIDDEN


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer ", "token"])
def test_authorization_header_must_be_a_bearer_token(header: str | None) -> None:
    with pytest.raises(AuthError):
        bearer_token(header)


def _outside(**overrides: Any) -> ExternalIssuer:
    return ExternalIssuer.model_validate(
        {
            "name": "partner",
            "issuer": "https://idp.partner.example",
            "jwks_url": "http://127.0.0.1:1/jwks.json",
            "audience": "agent-fleet",
            "tenant": "globex",
            **overrides,
        }
    )


async def test_an_outside_token_is_mapped_and_nothing_else_of_it_is_taken(key: SigningKey) -> None:
    verifier = ExternalTokenVerifier(_outside(), httpx.AsyncClient())
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    verifier._jwks.get = lookup  # type: ignore[method-assign]  # the keys, without an HTTP server
    now = int(time.time())
    outside = {
        "iss": "https://idp.partner.example",
        "aud": "agent-fleet",
        "sub": "alice",
        "iat": now,
        "exp": now + 60,
    }
    token = key.sign(
        {**outside, "tenant": "acme", "act": {"sub": "coordinator"}, "run_id": "r", "scope": "*"}
    )
    claims = await verifier.verify(token, required_scopes=["agent:invoke"])
    assert (claims.sub, claims.tenant, claims.scopes) == (
        "partner:alice",
        "globex",
        frozenset({"agent:invoke"}),
    )
    assert claims.actors == () and "run_id" not in claims.raw and claims.token == token
    with pytest.raises(AuthError, match="lives longer than 3600"):
        await verifier.verify(key.sign({**outside, "exp": now + 7200}))
    with pytest.raises(AuthError, match="algorithm not allowed"):
        await ExternalTokenVerifier(_outside(algorithms=["RS256"]), httpx.AsyncClient()).verify(token)


async def test_a_federated_verifier_refuses_an_issuer_it_does_not_know(
    verifier: TokenVerifier, key: SigningKey
) -> None:
    federated = FederatedVerifier(verifier, [ExternalTokenVerifier(_outside(), httpx.AsyncClient())])
    assert (await federated.verify(key.sign(claims()))).sub == "operator"  # the fleet's own
    with pytest.raises(AuthError, match="another issuer"):
        await federated.verify(key.sign(claims(iss="https://idp.elsewhere.example")))


def _pyjwt_accepts(token: str, key: SigningKey) -> bool:
    try:
        jwt.decode(
            token,
            key.private_key.public_key(),
            algorithms=["ES256"],
            audience="coordinator",
            issuer=ISSUER,
            leeway=10,
            options={"require": ["exp", "iat", "iss", "aud", "sub", "jti", "tenant"]},
        )
    except jwt.PyJWTError:
        return False
    return True


def _ours_accepts(token: str, key: SigningKey) -> bool:
    required = ("exp", "iat", "iss", "aud", "sub", "jti", "tenant")
    try:
        decode_es256(token, key.private_key.public_key(), "coordinator", ISSUER, 10, required)
    except AuthError:
        return False
    return True


def _variants(key: SigningKey) -> dict[str, str]:
    """Tokens that differ from a good one in one way each: what a forger or a bug would produce."""
    now = int(time.time())
    good = key.sign(claims())
    header, payload, signature = good.split(".")
    other = SigningKey.generate()
    made = {
        "good": good,
        "aud as a list with ours": key.sign(claims(aud=["mcp-sql", "coordinator"])),
        "aud as a list without ours": key.sign(claims(aud=["mcp-sql"])),
        "aud empty": key.sign(claims(aud="")),
        "aud not a string": key.sign(claims(aud=7)),
        "wrong audience": key.sign(claims(aud="mcp-sql")),
        "wrong issuer": key.sign(claims(iss="https://evil.example")),
        "expired": key.sign(claims(iat=now - 900, exp=now - 600)),
        "expired within leeway": key.sign(claims(exp=now - 5)),
        "nbf in the future": key.sign(claims(nbf=now + 600)),
        "nbf within leeway": key.sign(claims(nbf=now + 5)),
        "iat in the future": key.sign(claims(iat=now + 600)),
        "exp a float": key.sign(claims(exp=now + 300.5)),
        "exp a list": key.sign(claims(exp=[now + 300])),
        "exp infinite": key.sign(claims(exp=float("inf"))),
        "sub not a string": key.sign(claims(sub=42)),
        "jti not a string": key.sign(claims(jti=42)),
        "another key": other.sign(claims()),
        "tampered payload": f"{header}.{key.sign(claims(tenant='globex')).split('.')[1]}.{signature}",
        "signature cut": f"{header}.{payload}.{signature[:-4]}",
        "signature of another token": f"{header}.{payload}.{key.sign(claims()).split('.')[2]}",
        "padding added": f"{header}.{payload}=.{signature}",
        "a character outside base64url": f"{header}.{payload[:-1]}+.{signature}",
        "four parts": f"{good}.x",
        "payload not an object": key.sign({"x": 1}).split(".")[0]
        + "."
        + base64.urlsafe_b64encode(b"[1]").decode().rstrip("=")
        + "."
        + signature,
        "HS256": jwt.encode(claims(), "k" * 32, algorithm="HS256", headers={"kid": key.kid}),
        "alg none": jwt.encode(claims(), None, algorithm="none"),
    }
    for claim in ("exp", "iat", "iss", "aud", "sub", "jti", "tenant"):
        made[f"no {claim}"] = key.sign(claims(**{claim: None}))
    return made


def test_the_fast_es256_path_decides_as_pyjwt_does_on_every_variant(key: SigningKey) -> None:
    disagreements = {
        name: (ours, theirs)
        for name, token in _variants(key).items()
        if (ours := _ours_accepts(token, key)) != (theirs := _pyjwt_accepts(token, key))
    }
    assert disagreements == {}
    accepted = {name for name, token in _variants(key).items() if _ours_accepts(token, key)}
    assert accepted == {
        "good",
        "aud as a list with ours",
        "expired within leeway",
        "nbf within leeway",
        "exp a float",
    }


def test_the_fast_path_is_stricter_than_pyjwt_only_about_times_that_are_not_numbers(key: SigningKey) -> None:
    token = key.sign(claims(iat=str(int(time.time()))))
    assert _pyjwt_accepts(token, key)  # PyJWT takes int("...") of a string
    assert not _ours_accepts(token, key)


async def test_a_token_verified_before_is_still_checked_for_expiry_and_scopes(key: SigningKey) -> None:
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    verifier = TokenVerifier(lookup, issuer=ISSUER, audience="coordinator", leeway_s=0)
    expires = int(time.time()) + 2
    token = key.sign(claims(exp=expires))
    assert (await verifier.verify(token)).sub == "operator"
    assert (await verifier.verify(token, required_scopes=["agent:invoke"])).sub == "operator"
    with pytest.raises(FleetError) as lacking:
        await verifier.verify(token, required_scopes=["registry:write"])  # remembered, not widened
    assert lacking.value.code == ErrorCode.FORBIDDEN
    await asyncio.sleep(max(0.0, expires - time.time()) + 0.2)
    with pytest.raises(AuthError, match="token expired"):
        await verifier.verify(token)


async def test_a_single_use_verifier_sees_every_use(key: SigningKey) -> None:
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    verifier = TokenVerifier(lookup, issuer=ISSUER, audience="coordinator", single_use=MemoryReplayGuard())
    token = key.sign(claims())
    await verifier.verify(token)
    with pytest.raises(AuthError, match="already used"):
        await verifier.verify(token)


async def test_a_signal_grant_is_no_access_token_and_a_grant_verifier_takes_nothing_else(
    key: SigningKey, verifier: TokenVerifier
) -> None:
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    grant = key.sign(claims(token_use="signal_grant"), typ="signal-grant+jwt")
    with pytest.raises(AuthError, match="signal grant is not an access token"):
        await verifier.verify(grant)
    untyped = key.sign(claims(token_use="signal_grant"))  # the claim alone says so too
    with pytest.raises(AuthError, match="not an access token"):
        await verifier.verify(untyped)
    exchanging = TokenVerifier(lookup, issuer=ISSUER, audience="coordinator", run_grants=True)
    with pytest.raises(AuthError, match="not an access token"):
        await exchanging.verify(grant)  # never the subject of an exchange
    signals = TokenVerifier(lookup, issuer=ISSUER, audience="coordinator", grant="signal_grant")
    assert (await signals.verify(grant)).sub == "operator"
    for other in (key.sign(claims()), key.sign(claims(token_use="run_grant"), typ="run-grant+jwt")):
        with pytest.raises(AuthError, match="not a signal grant"):
            await signals.verify(other)
    forged_use = key.sign(claims(token_use="access"), typ="signal-grant+jwt")
    with pytest.raises(AuthError, match="not a signal grant"):
        await signals.verify(forged_use)


def test_claims_name_their_run_or_none() -> None:
    def claims(raw: dict[str, object]) -> Claims:
        return Claims("agent", "acme", "mcp-sql", frozenset(), "j", 0, raw)

    assert claims({"run_id": "r-1"}).run_id == "r-1"
    assert claims({}).run_id == ""
    assert claims({"run_id": None}).run_id == ""
