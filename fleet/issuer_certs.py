"""The registry's signing keys, pinned to the operator's key.

Every process knows the operator's public key (``FLEET_OPERATOR_JWK_FILE``). A key of the registry
(the token issuer) is trusted only with an *issuer certificate*: a JWS of type ``issuer-cert+jwt``
signed by the operator, naming the issuer (``sub``) and exactly that key (``jwk``, whose thumbprint
is its ``kid``). The registry publishes each key's certificate in its JWKS (the member
``issuer_cert`` of the JWK, which other consumers ignore), and puts it beside whatever else it signs
(revocations, registry records), so that what it signed verifies with the operator's key alone.

A key added to the JWKS by anyone but the operator has no valid certificate and is ignored (and
reported, once per key id).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from fleet.keys import ALGORITHM, SigningKey, jwk_thumbprint, public_jwk_of, public_key_from_jwk

log = logging.getLogger(__name__)

ISSUER_CERT_TYP = "issuer-cert+jwt"
CERT_MEMBER = "issuer_cert"  # the JWK member that carries a key's certificate
PURPOSE = "token-signing"
OPERATOR_ISSUER = "operator"  # the iss of what the operator signs (enrollment tokens, certificates)
_MEMO_SIZE = 256


def certify_issuer_key(operator: SigningKey, issuer: str, jwk: dict[str, Any]) -> str:
    """The operator's certificate for ``jwk`` as a signing key of ``issuer`` (the token issuer)."""
    public = public_jwk_of(public_key_from_jwk(jwk))
    claims = {
        "iss": OPERATOR_ISSUER,
        "sub": issuer,
        "iat": int(time.time()),
        "purpose": PURPOSE,
        "kid": public["kid"],
        "jwk": public,
    }
    return operator.sign(claims, typ=ISSUER_CERT_TYP)


def with_cert(jwk: dict[str, Any], cert: str) -> dict[str, Any]:
    """``jwk`` carrying its certificate (as stored in the registry's record and served in its JWKS)."""
    return {**jwk, CERT_MEMBER: cert}


@dataclass(frozen=True, slots=True)
class CertifiedKey:
    """A signing key of the registry and the operator's certificate for it."""

    key: SigningKey
    cert: str

    def public_jwk(self) -> dict[str, Any]:
        return with_cert(self.key.public_jwk(), self.cert)


class IssuerTrust:
    """Which keys may sign for ``issuer``: those the operator certified (see the module's doc).
    Without the operator's key (``operator_jwk`` None) no key is trusted: every token is refused."""

    def __init__(self, operator_jwk: dict[str, Any] | None, issuer: str) -> None:
        self.issuer = issuer
        self._operator = public_key_from_jwk(operator_jwk) if operator_jwk is not None else None
        self._certs: dict[str, dict[str, Any]] = {}  # certificate -> the JWK it certifies
        self._reported: set[str] = set()

    @classmethod
    def from_file(cls, operator_jwk_file: Path | None, issuer: str) -> IssuerTrust:
        if operator_jwk_file is None:
            log.error("no FLEET_OPERATOR_JWK_FILE: no key of %s is trusted, every token is refused", issuer)
            return cls(None, issuer)
        return cls(json.loads(operator_jwk_file.read_text()), issuer)

    def certified_jwk(self, cert: object) -> dict[str, Any] | None:
        """The public JWK that ``cert`` certifies for this issuer, if the operator signed it."""
        if not isinstance(cert, str) or self._operator is None:
            return None
        known = self._certs.get(cert)
        if known is not None:
            return known
        jwk = self._verify(cert, self._operator)
        if jwk is not None:
            if len(self._certs) >= _MEMO_SIZE:
                self._certs.clear()
            self._certs[cert] = jwk
        return jwk

    def certified(self, jwk: dict[str, Any], cert: object = None) -> ec.EllipticCurvePublicKey | None:
        """The key of ``jwk`` if ``cert`` (by default the JWK's own ``issuer_cert``) certifies
        exactly it; else None, reported once per key id."""
        cert = jwk.get(CERT_MEMBER) if cert is None else cert
        try:
            key = public_key_from_jwk(jwk)
            kid = jwk_thumbprint(jwk)
        except (KeyError, ValueError):
            return None
        named = self.certified_jwk(cert)
        if named is None or named["kid"] != kid or jwk.get("kid", kid) != kid:
            self._report(str(jwk.get("kid")), "it has no valid operator certificate")
            return None
        return key

    def parse(self, jwk: dict[str, Any]) -> ec.EllipticCurvePublicKey:
        """:meth:`certified`, as a ``JwksCache`` parser: ``ValueError`` for a key not certified."""
        key = self.certified(jwk)
        if key is None:
            raise ValueError("not certified by the operator")
        return key

    def _verify(self, cert: str, operator: ec.EllipticCurvePublicKey) -> dict[str, Any] | None:
        try:
            if jwt.get_unverified_header(cert).get("typ") != ISSUER_CERT_TYP:
                return None
            claims = jwt.decode(
                cert,
                operator,
                algorithms=[ALGORITHM],
                issuer=OPERATOR_ISSUER,
                options={"require": ["iss", "sub", "iat", "jwk", "purpose"], "verify_aud": False},
            )
            if claims["sub"] != self.issuer or claims["purpose"] != PURPOSE:
                return None
            jwk = public_jwk_of(public_key_from_jwk(claims["jwk"]))
        except (jwt.PyJWTError, KeyError, ValueError, TypeError):
            return None
        return jwk if claims.get("kid") == jwk["kid"] else None

    def _report(self, kid: str, why: str) -> None:
        if kid not in self._reported:
            self._reported.add(kid)
            log.warning("ignoring key %s offered as a signing key of %s: %s", kid, self.issuer, why)
