"""Token verification (used by every service) and token acquisition (client credentials with
``private_key_jwt``, RFC 7523).

Verification is deliberately strict: an explicit algorithm allow-list, required claims, one audience,
a small leeway, and keys looked up by ``kid`` in the issuer's JWKS (cached; an unknown ``kid`` triggers
one rate-limited refetch so that key rotation is picked up).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from fleet.errors import AuthError, ErrorCode, FleetError
from fleet.keys import ALGORITHM, SigningKey, public_key_from_jwk

ALLOWED_ALGORITHMS = (ALGORITHM,)
REQUIRED_CLAIMS = ("exp", "iat", "iss", "aud", "sub", "jti", "tenant")
DEFAULT_LEEWAY_S = 10
ACCESS_TOKEN_TTL_S = 300
CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"


@dataclass(frozen=True, slots=True)
class Claims:
    """The verified claims of an access token."""

    sub: str
    tenant: str
    audience: str
    scopes: frozenset[str]
    jti: str
    expires_at: int
    raw: dict[str, Any] = field(repr=False)

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes


KeyLookup = Callable[[str], Awaitable[ec.EllipticCurvePublicKey | None]]


class JwksCache:
    """Public keys of one issuer, fetched from its JWKS URL and cached by ``kid``."""

    def __init__(
        self,
        jwks_url: str,
        http: httpx.AsyncClient,
        *,
        min_refresh_interval_s: float = 1.0,
    ) -> None:
        self._url = jwks_url
        self._http = http
        self._keys: dict[str, ec.EllipticCurvePublicKey] = {}
        self._last_fetch = 0.0
        self._min_refresh = min_refresh_interval_s
        self._lock = asyncio.Lock()

    async def get(self, kid: str) -> ec.EllipticCurvePublicKey | None:
        key = self._keys.get(kid)
        if key is not None:
            return key
        async with self._lock:
            if kid not in self._keys and time.monotonic() - self._last_fetch >= self._min_refresh:
                await self._refresh()
        return self._keys.get(kid)

    async def _refresh(self) -> None:
        self._last_fetch = time.monotonic()
        try:
            response = await self._http.get(self._url, timeout=5.0)
            response.raise_for_status()
            document = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "cannot fetch the issuer's JWKS", retryable=True
            ) from exc
        keys: dict[str, ec.EllipticCurvePublicKey] = {}
        for jwk in document.get("keys", []):
            try:
                keys[jwk["kid"]] = public_key_from_jwk(jwk)
            except (KeyError, ValueError):
                continue
        self._keys = keys


class TokenVerifier:
    """Verifies access tokens issued by one issuer for one audience."""

    def __init__(
        self,
        keys: KeyLookup,
        *,
        issuer: str,
        audience: str,
        leeway_s: int = DEFAULT_LEEWAY_S,
    ) -> None:
        self._keys = keys
        self._issuer = issuer
        self._audience = audience
        self._leeway = leeway_s

    @property
    def audience(self) -> str:
        return self._audience

    async def verify(self, token: str, *, required_scopes: Iterable[str] = ()) -> Claims:
        """Return the token's claims, or raise :class:`AuthError` (never returns a partial result)."""
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise AuthError("malformed token") from exc
        if header.get("alg") not in ALLOWED_ALGORITHMS:
            raise AuthError("token algorithm not allowed")
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise AuthError("token has no key id")
        key = await self._keys(kid)
        if key is None:
            raise AuthError("token signed by an unknown key")
        try:
            raw: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=list(ALLOWED_ALGORITHMS),
                audience=self._audience,
                issuer=self._issuer,
                leeway=self._leeway,
                options={"require": list(REQUIRED_CLAIMS)},
            )
        except jwt.ExpiredSignatureError as exc:
            raise AuthError("token expired") from exc
        except jwt.InvalidAudienceError as exc:
            raise AuthError("token is not meant for this service") from exc
        except jwt.PyJWTError as exc:
            raise AuthError(f"invalid token: {type(exc).__name__}") from exc
        claims = _claims_of(raw, self._audience)
        missing = [s for s in required_scopes if s not in claims.scopes]
        if missing:
            raise FleetError(ErrorCode.FORBIDDEN, f"token lacks scope {' '.join(missing)}")
        return claims


def _claims_of(raw: dict[str, Any], audience: str) -> Claims:
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise AuthError("token carries no tenant")
    scope = raw.get("scope", "")
    return Claims(
        sub=str(raw["sub"]),
        tenant=tenant,
        audience=audience,
        scopes=frozenset(scope.split()) if isinstance(scope, str) else frozenset(),
        jti=str(raw["jti"]),
        expires_at=int(raw["exp"]),
        raw=raw,
    )


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer ...`` header, or :class:`AuthError`."""
    if not authorization:
        raise AuthError("missing bearer token")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("authorization is not a bearer token")
    return token.strip()


def client_assertion(key: SigningKey, client_id: str, token_url: str) -> str:
    """An RFC 7523 client assertion: a one-minute, single-use JWT signed by the client's own key.

    Its audience is the token endpoint's URL, so an assertion sent to a lookalike endpoint cannot be
    redeemed at the real one."""
    now = int(time.time())
    return key.sign(
        {
            "iss": client_id,
            "sub": client_id,
            "aud": token_url,
            "iat": now,
            "exp": now + 60,
            "jti": uuid.uuid4().hex,
        }
    )


@dataclass(frozen=True, slots=True)
class _Cached:
    token: str
    expires_at: float


class TokenClient:
    """Gets access tokens from the registry's token endpoint and caches them until shortly before
    they expire. One instance per identity (the service's own key)."""

    def __init__(
        self,
        *,
        token_url: str,
        client_id: str,
        key: SigningKey,
        http: httpx.AsyncClient,
    ) -> None:
        self._token_url = token_url
        self._client_id = client_id
        self._key = key
        self._http = http
        self._cache: dict[tuple[str, str, str], _Cached] = {}

    async def token(self, audience: str, tenant: str, scopes: Iterable[str] = ()) -> str:
        scope = " ".join(sorted(set(scopes)))
        cache_key = (audience, tenant, scope)
        cached = self._cache.get(cache_key)
        if cached is not None and cached.expires_at - 30 > time.time():
            return cached.token
        response = await self._http.post(
            self._token_url,
            data={
                "grant_type": "client_credentials",
                "client_assertion_type": CLIENT_ASSERTION_TYPE,
                "client_assertion": client_assertion(self._key, self._client_id, self._token_url),
                "audience": audience,
                "tenant": tenant,
                "scope": scope,
            },
            timeout=10.0,
        )
        if response.status_code != 200:
            raise _token_error(response)
        body = response.json()
        token = str(body["access_token"])
        self._cache[cache_key] = _Cached(token, time.time() + float(body.get("expires_in", 60)))
        return token


def _token_error(response: httpx.Response) -> FleetError:
    try:
        body = response.json()
        detail = f"{body.get('error')}: {body.get('error_description', '')}"
    except ValueError:
        detail = response.text[:200]
    code = (
        ErrorCode.FORBIDDEN if response.status_code in (400, 401, 403) else ErrorCode.DEPENDENCY_UNAVAILABLE
    )
    return FleetError(code, f"token request refused ({response.status_code}) {detail}")
