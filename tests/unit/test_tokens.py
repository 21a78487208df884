"""Token verification: the checks every service relies on."""

from __future__ import annotations

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
from fleet.tokens import ExternalTokenVerifier, FederatedVerifier, TokenVerifier, bearer_token

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
