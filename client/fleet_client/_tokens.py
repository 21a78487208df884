"""Bearer tokens for the fleet: a caller's own token, or client credentials with ``private_key_jwt``
(RFC 7523) at the fleet's token endpoint, whose address the coordinator's agent card names."""

from __future__ import annotations

import hashlib
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from jwt.utils import base64url_encode

from fleet_client._errors import FleetClientError

CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
REUSE_FOR_S = 240.0  # a token is asked again after this long (or 30 s before it expires)


class TokenSource(Protocol):
    """Where the bearer token of a request to ``audience`` for ``tenant`` comes from."""

    async def token(self, audience: str, tenant: str, scopes: tuple[str, ...]) -> str:
        """A token valid now."""
        ...


class StaticToken:
    """A token you already have (from ``fleet token``, or your identity provider)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def token(self, audience: str, tenant: str, scopes: tuple[str, ...]) -> str:
        """The token, whatever is asked."""
        return self._token


def key_id(key: ec.EllipticCurvePrivateKey) -> str:
    """The key's id as the fleet names it: the RFC 7638 thumbprint of its public JWK."""
    numbers = key.public_key().public_numbers()

    def coordinate(value: int) -> str:
        return base64url_encode(value.to_bytes(32, "big")).decode()

    canonical = f'{{"crv":"P-256","kty":"EC","x":"{coordinate(numbers.x)}","y":"{coordinate(numbers.y)}"}}'
    return base64url_encode(hashlib.sha256(canonical.encode()).digest()).decode()


class ClientCredentials:
    """Tokens from the fleet's token endpoint for an enrolled identity (``client_id`` and its EC
    P-256 key), each request authenticated by a fresh one-minute assertion signed with the key."""

    def __init__(
        self, token_url: str, client_id: str, key_file: str | Path, http: httpx.AsyncClient | None = None
    ) -> None:
        loaded = load_pem_private_key(Path(key_file).read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise FleetClientError("invalid_request", f"{key_file} is not an EC private key")
        self.token_url = token_url
        self.client_id = client_id
        self._key = loaded
        self._kid = key_id(loaded)
        self._http = http
        self._cache: dict[tuple[str, str, str], tuple[str, float]] = {}

    @classmethod
    async def from_card(
        cls, coordinator_url: str, client_id: str, key_file: str | Path, http: httpx.AsyncClient | None = None
    ) -> ClientCredentials:
        """Credentials at the token endpoint the coordinator's agent card names."""
        async with httpx.AsyncClient(timeout=10.0) as own:
            response = await (http or own).get(coordinator_url.rstrip("/") + "/.well-known/agent-card.json")
        if response.status_code != 200:
            raise FleetClientError.from_response(response)
        token_url = _token_url(response.json())
        if token_url is None:
            raise FleetClientError("invalid_request", "the coordinator's card names no token endpoint")
        return cls(token_url, client_id, key_file, http)

    def assertion(self) -> str:
        """A new single-use client assertion, addressed to the token endpoint."""
        now = int(time.time())
        claims = {
            "iss": self.client_id,
            "sub": self.client_id,
            "aud": self.token_url,
            "iat": now,
            "exp": now + 60,
            "jti": uuid.uuid4().hex,
        }
        return jwt.encode(claims, self._key, algorithm="ES256", headers={"kid": self._kid, "typ": "JWT"})

    async def token(self, audience: str, tenant: str, scopes: tuple[str, ...]) -> str:
        """A client-credentials token for ``audience``, ``tenant`` and ``scopes`` (kept and reused
        while it has time left)."""
        scope = " ".join(sorted(set(scopes)))
        key = (audience, tenant, scope)
        cached = self._cache.get(key)
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        form = {
            "grant_type": "client_credentials",
            "audience": audience,
            "tenant": tenant,
            "scope": scope,
            "client_assertion_type": CLIENT_ASSERTION_TYPE,
            "client_assertion": self.assertion(),
        }
        async with httpx.AsyncClient(timeout=10.0) as own:
            try:
                response = await (self._http or own).post(self.token_url, data=form)
            except httpx.TransportError as exc:
                raise FleetClientError(
                    "dependency_unavailable",
                    f"cannot reach {self.token_url}: {type(exc).__name__}",
                    retryable=True,
                ) from exc
        if response.status_code != 200:
            raise _token_error(response)
        body: dict[str, Any] = response.json()
        expires_in = float(body.get("expires_in", 60))
        self._cache[key] = (str(body["access_token"]), time.monotonic() + min(REUSE_FOR_S, expires_in - 30))
        return str(body["access_token"])


def _token_error(response: httpx.Response) -> FleetClientError:
    """A token endpoint's refusal: the fleet's envelope when the body has one (the OAuth error
    otherwise, RFC 6749 5.2)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return FleetClientError.from_response(response)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        description = str(body.get("error_description") or body["error"])
        code = "rate_limited" if response.status_code == 429 else "forbidden"
        return FleetClientError(
            code, description, retryable=code == "rate_limited", details={"oauth_error": body["error"]}
        )
    return FleetClientError.from_response(response)


def _token_url(card: Any) -> str | None:
    """The ``tokenUrl`` of the card's OAuth 2 client-credentials scheme, wherever it nests."""
    if isinstance(card, dict):
        for key, value in card.items():
            if key == "tokenUrl" and isinstance(value, str):
                return value
            found = _token_url(value)
            if found:
                return found
    elif isinstance(card, list):
        for item in card:
            found = _token_url(item)
            if found:
                return found
    return None
