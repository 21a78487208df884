"""Enrollment: an identity registers its public key, vouched for by a one-time token that the
operator signed (``fleet up`` mints one per service it starts)."""

from __future__ import annotations

import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from fleet.errors import ErrorCode, FleetError
from fleet.keys import ALGORITHM, public_jwk_of, public_key_from_jwk
from registry._records import IdentityRecord
from registry._store import RegistryStore

ENROLLMENT_AUDIENCE = "fleet-enrollment"
OPERATOR_ISSUER = "operator"
ENROLLABLE_KINDS = ("coordinator", "worker", "specialist", "mcp_server", "console")
KEY_GRACE_S = 600.0  # how long a replaced key still verifies (longer than any token it signed lives)


def _refuse(message: str) -> FleetError:
    return FleetError(ErrorCode.UNAUTHENTICATED, message)


class Enrollment:
    """Checks enrollment requests against the operator's public key."""

    def __init__(self, store: RegistryStore, operator_key: ec.EllipticCurvePublicKey) -> None:
        self._store = store
        self._operator_key = operator_key

    async def enroll(self, body: dict[str, Any]) -> IdentityRecord:
        identity_id = body.get("id")
        jwk = body.get("public_jwk")
        if not isinstance(identity_id, str) or not isinstance(jwk, dict):
            raise FleetError(ErrorCode.INVALID_REQUEST, "id and public_jwk are required")
        claims = self._verify(str(body.get("enrollment_token", "")), identity_id)
        try:
            # Store only the public members, with the key id we compute (never the caller's).
            public = public_jwk_of(public_key_from_jwk(jwk))
        except (KeyError, ValueError, jwt.PyJWTError) as exc:
            raise FleetError(ErrorCode.INVALID_REQUEST, "public_jwk is not an EC P-256 public key") from exc
        if not await self._store.use_nonce("enroll", str(claims["jti"])):
            raise _refuse("enrollment token was already used")
        now = time.time()
        record = IdentityRecord(
            id=identity_id,
            kind=claims["kind"],
            keys={public["kid"]: public},
            scopes=[str(s) for s in claims.get("scopes", [])],
            tenants=[str(t) for t in claims.get("tenants", [])],
            skills=_skills_of(claims),
            enrolled_at=now,
            external=claims.get("external") is True,
        )
        before = await self._store.identity(identity_id)
        if before is not None and before.kind == record.kind:
            # Enrolled again (a restart, or a new key): keys enrolled before stay usable for a grace
            # period, so that what they signed a moment ago (tokens, cards) still verifies.
            record = before.with_key(public, now, KEY_GRACE_S).model_copy(
                update={
                    "scopes": record.scopes,
                    "tenants": record.tenants,
                    "skills": record.skills,
                    "enrolled_at": now,
                    "external": record.external,
                }
            )
        await self._store.put_identity(record)
        return record

    def _verify(self, token: str, identity_id: str) -> dict[str, Any]:
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self._operator_key,
                algorithms=[ALGORITHM],
                audience=ENROLLMENT_AUDIENCE,
                issuer=OPERATOR_ISSUER,
                options={"require": ["exp", "iat", "jti", "sub", "kind"]},
            )
        except jwt.PyJWTError as exc:
            raise _refuse(f"enrollment token rejected: {type(exc).__name__}") from exc
        if claims["sub"] != identity_id:
            raise _refuse("enrollment token was issued for another identity")
        if claims["kind"] not in ENROLLABLE_KINDS:
            raise _refuse("enrollment token names an unknown kind")
        _skills_of(claims)
        return claims


def _skills_of(claims: dict[str, Any]) -> list[str]:
    """The skills an enrollment token lets the identity offer (none if it names none)."""
    skills = claims.get("skills", [])
    if not isinstance(skills, list) or not all(isinstance(s, str) and s for s in skills):
        raise _refuse("enrollment token names skills that are not a list of skill ids")
    return sorted(set(skills))
