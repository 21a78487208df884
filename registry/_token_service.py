"""The token service: client credentials with ``private_key_jwt`` (RFC 7523) in, short-lived access
tokens bound to one audience, one tenant and the granted scopes out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jwt

from fleet.keys import ALGORITHM, SigningKey, public_key_from_jwk
from fleet.revocations import Revocations
from fleet.tokens import ACCESS_TOKEN_TTL_S, CLIENT_ASSERTION_TYPE
from registry._records import IdentityRecord
from registry._store import RegistryStore

MAX_ASSERTION_LIFETIME_S = 300
IDENTITY_CACHE_S = 2.0
LEEWAY_S = 10
REGISTRY_AUDIENCE = "registry"


class OAuthError(Exception):
    """An RFC 6749 error response: ``error`` is the standard code, ``status`` the HTTP status."""

    def __init__(self, error: str, description: str, status: int = 400) -> None:
        super().__init__(description)
        self.error = error
        self.description = description
        self.status = status


@dataclass(frozen=True, slots=True)
class IssuedToken:
    access_token: str
    expires_in: int
    scope: str


class TokenService:
    """Verifies client assertions against enrolled keys and mints access tokens."""

    def __init__(
        self,
        store: RegistryStore,
        key: SigningKey,
        issuer: str,
        token_url: str,
        revocations: Revocations | None = None,
    ) -> None:
        self._store = store
        self.key = key  # the issuer's signing key; replaced when the registry rotates it
        self._issuer = issuer
        self._token_url = token_url
        self._revocations = revocations
        self._identities: dict[str, tuple[float, IdentityRecord]] = {}

    async def _identity(self, identity_id: str, kid: str | None = None) -> IdentityRecord | None:
        """The identity's record, read again at most every ``IDENTITY_CACHE_S``; at once if it does
        not hold ``kid`` (a key enrolled a moment ago). A revoked key is refused by the revocation
        list, which is followed live, whatever the cached record says."""
        cached = self._identities.get(identity_id)
        fresh = cached is not None and time.monotonic() - cached[0] < IDENTITY_CACHE_S
        if cached is not None and fresh and (kid is None or kid in cached[1].keys):
            return cached[1]
        found = await self._store.identity(identity_id)
        if found is None:
            self._identities.pop(identity_id, None)
        else:
            self._identities[identity_id] = (time.monotonic(), found)
        return found

    async def client_credentials(self, form: Mapping[str, str]) -> IssuedToken:
        if form.get("grant_type") != "client_credentials":
            raise OAuthError("unsupported_grant_type", "only client_credentials is supported")
        if form.get("client_assertion_type") != CLIENT_ASSERTION_TYPE:
            raise OAuthError("invalid_client", "a private_key_jwt client assertion is required", 401)
        client, client_kid = await self._authenticate(form.get("client_assertion", ""))
        audience = form.get("audience", "")
        tenant = form.get("tenant", "")
        scopes = sorted(set(form.get("scope", "").split()))
        await self._check_grant(client, audience, tenant, scopes)
        return self.issue(client.id, audience, tenant, scopes, client_kid)

    async def _authenticate(self, assertion: str) -> tuple[IdentityRecord, str]:
        """The client and the key id it proved it holds."""
        try:
            header = jwt.get_unverified_header(assertion)
            unverified = jwt.decode(assertion, options={"verify_signature": False})
        except jwt.PyJWTError as exc:
            raise OAuthError("invalid_client", "malformed client assertion", 401) from exc
        client_id = unverified.get("sub")
        if not isinstance(client_id, str) or unverified.get("iss") != client_id:
            raise OAuthError("invalid_client", "assertion iss and sub must name the client", 401)
        kid = str(header.get("kid"))
        identity = await self._identity(client_id, kid)
        jwk = identity.usable_keys(time.time()).get(kid) if identity else None
        if identity is None or jwk is None:
            raise OAuthError("invalid_client", "unknown client or key (or a retired one)", 401)
        if self._revocations is not None and self._revocations.check(kid):
            raise OAuthError("invalid_client", "the client's key was revoked", 401)
        claims = self._verify_assertion(assertion, jwk)
        if not await self._store.use_nonce("assertion", f"{client_id}.{claims['jti']}"):
            raise OAuthError("invalid_client", "client assertion was already used", 401)
        return identity, kid

    def _verify_assertion(self, assertion: str, jwk: dict[str, Any]) -> dict[str, Any]:
        try:
            claims: dict[str, Any] = jwt.decode(
                assertion,
                public_key_from_jwk(jwk),
                algorithms=[ALGORITHM],
                audience=self._token_url,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "jti", "iss", "sub", "aud"]},
            )
        except jwt.PyJWTError as exc:
            raise OAuthError(
                "invalid_client", f"client assertion rejected: {type(exc).__name__}", 401
            ) from exc
        if int(claims["exp"]) - int(claims["iat"]) > MAX_ASSERTION_LIFETIME_S:
            raise OAuthError("invalid_client", "client assertion lives too long", 401)
        if not all(c.isalnum() or c in "-_" for c in str(claims["jti"])):
            raise OAuthError("invalid_client", "client assertion jti has unsupported characters", 401)
        return claims

    async def _check_grant(
        self, client: IdentityRecord, audience: str, tenant: str, scopes: list[str]
    ) -> None:
        if not audience:
            raise OAuthError("invalid_request", "audience is required")
        if not tenant:
            raise OAuthError("invalid_request", "tenant is required")
        if audience != REGISTRY_AUDIENCE:
            target = await self._identity(audience)
            if target is None or target.kind == "operator":
                raise OAuthError("invalid_target", f"unknown audience {audience!r}")
        if not client.allows_tenant(tenant):
            raise OAuthError("unauthorized_client", f"{client.id} may not act for tenant {tenant!r}")
        refused = [scope for scope in scopes if not client.allows_scope(scope)]
        if refused:
            raise OAuthError("invalid_scope", f"scopes not granted to {client.id}: {' '.join(refused)}")

    def issue(
        self, subject: str, audience: str, tenant: str, scopes: list[str], client_kid: str
    ) -> IssuedToken:
        """An access token (the grant is checked already). ``client_kid``: the key the client
        authenticated with; a verifier refuses the token once that key is revoked."""
        now = int(time.time())
        scope = " ".join(scopes)
        token = self.key.sign(
            {
                "iss": self._issuer,
                "sub": subject,
                "client_id": subject,
                "aud": audience,
                "tenant": tenant,
                "scope": scope,
                "iat": now,
                "nbf": now,
                "exp": now + ACCESS_TOKEN_TTL_S,
                "jti": uuid.uuid4().hex,
                "client_kid": client_kid,
            },
            typ="at+jwt",
        )
        return IssuedToken(token, ACCESS_TOKEN_TTL_S, scope)
