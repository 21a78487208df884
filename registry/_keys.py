"""Key lifecycle: an identity rotates its key (proving it holds the current one), the registry
rotates its own signing key (in two steps: a pending key, then the operator's certificate for it),
and the operator revokes a key.

* A replaced key keeps verifying for ``KEY_GRACE_S`` (what it signed a moment ago, a token or a
  card, still verifies), then it is gone from the identity's keys and from the JWKS.
* A revoked key stops verifying everywhere at once: it leaves the identity's record, and the
  revocation is published (:mod:`fleet.revocations`), which every verifying process follows.
  Tokens signed by it, or issued to a client on it, are refused before they expire.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from nats.aio.client import Client as NATS

from fleet.errors import ErrorCode, FleetError
from fleet.issuer_certs import CertifiedKey, IssuerTrust
from fleet.keys import ALGORITHM, SigningKey, public_jwk_of, public_key_from_jwk
from fleet.revocations import Revocation, record_revocation
from registry._enrollment import KEY_GRACE_S
from registry._records import IdentityRecord
from registry._store import RegistryStore
from registry._token_service import RUN_GRANT_TTL_S

MAX_PROOF_LIFETIME_S = 300
# A retired registry key keeps verifying what it signed for as long as that lives: access tokens for
# minutes, but run grants for RUN_GRANT_TTL_S (a run may wait that long at a gate). Revoke the key to
# end that sooner.
ISSUER_KEY_GRACE_S = float(RUN_GRANT_TTL_S)


class KeyAdmin:
    """Rotation and revocation against the registry's records (see the module's doc)."""

    def __init__(
        self,
        store: RegistryStore,
        nats: NATS,
        issuer_id: str,
        key_file: Path,
        public_url: str,
        trust: IssuerTrust,
    ) -> None:
        self._store = store
        self.nats = nats
        self.issuer_id = issuer_id
        self._key_file = key_file
        self._public_url = public_url.rstrip("/")
        self._trust = trust
        self.pending: SigningKey | None = None  # a new signing key waiting for its certificate

    def rotation_url(self, identity_id: str) -> str:
        """The audience of a rotation proof: this endpoint, for this identity."""
        return f"{self._public_url}/v1/identities/{identity_id}/keys"

    async def rotate_identity_key(self, identity_id: str, body: dict[str, Any]) -> IdentityRecord:
        """Make ``public_jwk`` the identity's key, given a ``proof`` (a short JWT signed by a key
        the identity holds now, naming the new key's id). The old keys retire after the grace."""
        identity = await self._store.identity(identity_id)
        if identity is None or identity.kind in ("operator", "registry"):
            raise FleetError(ErrorCode.NOT_FOUND, f"no identity {identity_id!r} that can rotate its key")
        jwk, proof = body.get("public_jwk"), body.get("proof")
        if not isinstance(jwk, dict) or not isinstance(proof, str):
            raise FleetError(ErrorCode.INVALID_REQUEST, "public_jwk and proof are required")
        try:
            new = public_jwk_of(public_key_from_jwk(jwk))
        except (KeyError, ValueError, jwt.PyJWTError) as exc:
            raise FleetError(ErrorCode.INVALID_REQUEST, "public_jwk is not an EC P-256 public key") from exc
        now = time.time()
        claims = self._verify_proof(proof, identity, now)
        if claims.get("new_kid") != new["kid"]:
            raise FleetError(ErrorCode.UNAUTHENTICATED, "the proof names another key")
        if not await self._store.use_nonce("rotate", f"{identity_id}.{claims['jti']}"):
            raise FleetError(ErrorCode.UNAUTHENTICATED, "the rotation proof was already used")
        rotated = identity.with_key(new, now, KEY_GRACE_S)
        await self._store.put_identity(rotated)
        return rotated

    def _verify_proof(self, proof: str, identity: IdentityRecord, now: float) -> dict[str, Any]:
        try:
            kid = jwt.get_unverified_header(proof).get("kid")
        except jwt.PyJWTError as exc:
            raise FleetError(ErrorCode.UNAUTHENTICATED, "malformed rotation proof") from exc
        # Only a current key may name its successor: a key being retired (perhaps because it leaked)
        # verifies what it signed before, and can hand the identity to no one.
        jwk = identity.current_keys().get(str(kid))
        if jwk is None:
            raise FleetError(
                ErrorCode.UNAUTHENTICATED, "the proof is not signed by a current key of the identity"
            )
        try:
            claims: dict[str, Any] = jwt.decode(
                proof,
                public_key_from_jwk(jwk),
                algorithms=[ALGORITHM],
                audience=self.rotation_url(identity.id),
                issuer=identity.id,
                leeway=10,
                options={"require": ["exp", "iat", "jti", "iss", "aud", "new_kid"]},
            )
        except jwt.PyJWTError as exc:
            raise FleetError(
                ErrorCode.UNAUTHENTICATED, f"rotation proof rejected: {type(exc).__name__}"
            ) from exc
        if int(claims["exp"]) - int(claims["iat"]) > MAX_PROOF_LIFETIME_S:
            raise FleetError(ErrorCode.UNAUTHENTICATED, "the rotation proof lives too long")
        return claims

    def begin_issuer_rotation(self) -> SigningKey:
        """A new signing key for the registry, pending until the operator certifies it (the same
        one until then: asking again changes nothing). Kept in memory only: a restart forgets it."""
        if self.pending is None:
            self.pending = SigningKey.generate()
        return self.pending

    async def complete_issuer_rotation(self, cert: str) -> CertifiedKey:
        """Sign with the pending key from now on, given the operator's certificate for it (written
        over the key file, published beside the old key, which verifies the tokens it signed
        until the grace ends)."""
        pending = self.pending
        if pending is None:
            raise FleetError(ErrorCode.CONFLICT, "no rotation is pending: POST /v1/issuer/rotate first")
        if not self.trusts(pending, cert):
            raise FleetError(
                ErrorCode.UNAUTHENTICATED, "not an operator certificate for the pending key of this issuer"
            )
        new = CertifiedKey(pending, cert)
        _replace_key_file(self._key_file, pending)
        self.pending = None
        await self.publish_issuer_key(new)
        return new

    async def publish_issuer_key(self, key: CertifiedKey) -> IdentityRecord:
        """Record ``key`` (with its certificate) as the registry identity's current key."""
        identity = await self._issuer_identity(key.key)
        current = identity.with_key(key.public_jwk(), time.time(), ISSUER_KEY_GRACE_S)
        await self._store.put_identity(current)
        return current

    async def certificate_of(self, key: SigningKey) -> str | None:
        """The operator's certificate for ``key`` as the registry's record holds it (a key that a
        rotation made, after a restart), if it verifies."""
        identity = await self._store.identity(self.issuer_id)
        cert = identity.keys.get(key.kid, {}).get("issuer_cert") if identity is not None else None
        return cert if isinstance(cert, str) and self.trusts(key, cert) else None

    def trusts(self, key: SigningKey, cert: str) -> bool:
        """Whether ``cert`` is the operator's certificate for ``key`` as this issuer's."""
        return self._trust.certified(key.public_jwk(), cert) is not None

    async def _issuer_identity(self, key: SigningKey) -> IdentityRecord:
        found = await self._store.identity(self.issuer_id)
        if found is not None:
            return found
        return IdentityRecord(
            id=self.issuer_id,
            kind="registry",
            keys={},
            enrolled_at=time.time(),
        )

    async def revoke(self, kid: str, by: str, reason: str, signer: CertifiedKey, issuer: str) -> Revocation:
        """Revoke ``kid`` wherever it is enrolled (the revocation signed by ``signer`` as
        ``issuer``). The registry's current signing key cannot be revoked (rotate it first: then
        the old one can be); before one of its old keys is, every record is signed again."""
        if kid == signer.key.kid:
            raise FleetError(
                ErrorCode.CONFLICT,
                "this is the registry's current signing key: rotate it, then revoke the old one",
            )
        holders = [i for i in await self._store.identities() if kid in i.keys]
        if not holders:
            raise FleetError(ErrorCode.NOT_FOUND, f"no identity holds key {kid!r}")
        if any(identity.id == self.issuer_id for identity in holders):
            await self._store.reseal()
        for identity in holders:
            await self._store.put_identity(identity.without_key(kid))
        revocation = Revocation(
            kid=kid, identity=holders[0].id, revoked_at=time.time(), by=by, reason=reason[:200]
        )
        await record_revocation(self.nats, revocation, signer, issuer)
        return revocation


def _replace_key_file(path: Path, key: SigningKey) -> None:
    """Write ``key`` over ``path`` atomically (mode 0600): a crash leaves the old key or the new."""
    pem = key.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    staged = path.with_suffix(path.suffix + ".new")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(staged, path)
