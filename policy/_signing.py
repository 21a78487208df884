"""Who may push policy, and the signature every process checks before it swaps a bundle in.

The trust root is the operator's public key (``FLEET_OPERATOR_JWK_FILE``), which every service
process is given; nothing read from the bus is trusted on its own. A push carries:

- ``author``: who signed it: ``operator``, or an author the operator certified;
- ``signature``: a JWS (``typ`` ``policy-push+jwt``) by the author's key over the bundle's revision,
  the SHA-256 of its whole content and the push's facts (``pushed_by``, ``pushed_at``, ``note``,
  ``restores``, ``author``): none of them can be changed without breaking it;
- ``certificate`` (an author other than the operator): a JWS (``typ`` ``policy-author+jwt``) by the
  operator's key that names the author, its public JWK and the right ``policy:push``, with
  ``iat`` and ``exp`` (``fleet policy authorize``). It travels inside the push, so every process
  verifies it offline.

A certificate must have been valid when the push was signed (its ``pushed_at``), not when a process
reads the push: a process that starts a month later still enforces a bundle pushed while its author
was certified. A push dated more than ``MAX_CLOCK_SKEW_S`` ahead is refused, and a process refuses
a push not newer than the one it enforces (:mod:`policy.live`), so an author whose certificate
expired cannot replace any push made after the expiry by backdating. A certificate cannot be taken
back before it expires: keep lifetimes short (``fleet policy authorize --days``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fleet.keys import ALGORITHM, SigningKey, jwk_thumbprint, public_jwk_of, public_key_from_jwk
from policy._bundle import Bundle
from policy.errors import PolicyError

AUDIENCE = "fleet-policy"
PUSH_TYP = "policy-push+jwt"
AUTHOR_TYP = "policy-author+jwt"
PUSH_RIGHT = "policy:push"
OPERATOR_AUTHOR = "operator"
MAX_CLOCK_SKEW_S = 300.0
DEFAULT_AUTHOR_LIFETIME_S = 90 * 24 * 3600
SIGNED_FACTS = ("author", "pushed_by", "pushed_at", "note", "restores")
PUSH_FIELDS = frozenset({*SIGNED_FACTS, "signature", "certificate"})


class PushRefused(PolicyError):
    """A pushed bundle this process will not enforce; ``reason`` is stable: ``unsigned``,
    ``bad_signature``, ``unauthorized`` (not the operator, no valid certificate), ``no_trust_root``
    (this process was given no operator key), ``stale`` (not newer than the push in force)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PolicySigner:
    """Who signs a push: the operator's key, or an author's key with its operator certificate."""

    author: str
    key: SigningKey
    certificate: str | None = None

    @classmethod
    def operator(cls, key: SigningKey) -> PolicySigner:
        return cls(OPERATOR_AUTHOR, key)

    @classmethod
    def author_of(cls, key: SigningKey, certificate: str) -> PolicySigner:
        """An author's signer; its id is the one the (unverified here) certificate names."""
        try:
            claims = jwt.decode(certificate, options={"verify_signature": False})
            return cls(str(claims["sub"]), key, certificate)
        except (jwt.PyJWTError, KeyError) as exc:
            raise PolicyError(f"not a policy author certificate: {type(exc).__name__}") from exc

    def sign(self, bundle: Bundle, facts: dict[str, Any]) -> dict[str, Any]:
        """The fields a push adds to ``facts`` (which hold every one of ``SIGNED_FACTS`` but the
        author): the author, the signature, and the certificate if any."""
        claims = {**facts, "author": self.author}
        signed = {k: claims.get(k) for k in SIGNED_FACTS}
        payload = {**signed, "aud": AUDIENCE, "revision": bundle.revision, "sha256": bundle.digest}
        fields = {"author": self.author, "signature": self.key.sign(payload, typ=PUSH_TYP)}
        return fields | ({"certificate": self.certificate} if self.certificate else {})


def certify_author(
    operator: SigningKey,
    author: str,
    jwk: dict[str, Any],
    *,
    lifetime_s: float = DEFAULT_AUTHOR_LIFETIME_S,
    issued_at: float | None = None,
) -> str:
    """The operator's certificate that ``author``, holding the key of ``jwk``, may push policy
    from ``issued_at`` (default: now) for ``lifetime_s``."""
    if not author or author == OPERATOR_AUTHOR:
        raise PolicyError(f"an author's id must be neither empty nor {OPERATOR_AUTHOR!r}")
    public = public_jwk_of(public_key_from_jwk(jwk))
    now = int(time.time() if issued_at is None else issued_at)
    claims = {
        "iss": OPERATOR_AUTHOR,
        "sub": author,
        "aud": AUDIENCE,
        "jwk": public,
        "rights": [PUSH_RIGHT],
        "iat": now,
        "exp": now + int(lifetime_s),
    }
    return operator.sign(claims, typ=AUTHOR_TYP)


def public_jwk_from_file(path: Path) -> dict[str, Any]:
    """A public JWK from a file holding a JWK, a public PEM key, or a private PEM key."""
    text = path.read_bytes()
    if text.lstrip().startswith(b"{"):
        return public_jwk_of(public_key_from_jwk(json.loads(text)))
    try:
        key: Any = serialization.load_pem_public_key(text)
    except ValueError:
        key = serialization.load_pem_private_key(text, password=None).public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError(f"{path} does not hold an EC P-256 key")
    return public_jwk_of(key)


class PushVerifier:
    """Checks a push against the operator's public key, offline."""

    def __init__(self, operator_jwk: dict[str, Any]) -> None:
        self._operator = public_key_from_jwk(operator_jwk)
        self.operator_kid = jwk_thumbprint(operator_jwk)

    @classmethod
    def from_file(cls, path: Path) -> PushVerifier:
        """The verifier of the operator's public JWK in ``path``; :class:`PolicyError` if unusable."""
        try:
            return cls(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PolicyError(f"cannot read the operator's public key {path}: {exc}") from exc

    def verify(self, bundle: Bundle, facts: dict[str, Any], *, now: float | None = None) -> str:
        """The author of this push of ``bundle``, if its signature covers this bundle and these
        facts and its author may push; :class:`PushRefused` otherwise."""
        signature, author = facts.get("signature"), facts.get("author")
        if not isinstance(signature, str) or not isinstance(author, str):
            raise PushRefused("unsigned", "the push is not signed")
        unsigned = set(facts) - PUSH_FIELDS
        if unsigned:
            raise PushRefused(
                "bad_signature", f"the push has facts its signature does not cover: {sorted(unsigned)}"
            )
        key, certificate = self._key_of(author, facts.get("certificate"))
        claims = _decode(signature, key, PUSH_TYP, "the push's signature")
        if claims.get("revision") != bundle.revision or claims.get("sha256") != bundle.digest:
            raise PushRefused("bad_signature", "the signature is of another bundle (its content was changed)")
        if any(claims.get(k) != facts.get(k) for k in SIGNED_FACTS):
            raise PushRefused("bad_signature", "the push's facts are not the ones signed")
        pushed_at = claims.get("pushed_at")
        if not isinstance(pushed_at, int | float) or not math.isfinite(pushed_at):
            raise PushRefused("bad_signature", "the signature has no pushed_at")
        if pushed_at > (time.time() if now is None else now) + MAX_CLOCK_SKEW_S:
            raise PushRefused("bad_signature", "the push is dated in the future")
        if certificate is not None:
            _check_certified_at(certificate, author, float(pushed_at))
        return author

    def _key_of(self, author: str, certificate: Any) -> tuple[Any, dict[str, Any] | None]:
        """The key that must have signed ``author``'s push, and its certificate's claims."""
        if certificate is None:
            if author != OPERATOR_AUTHOR:
                raise PushRefused(
                    "unauthorized", f"{author} is not the operator and has no author certificate"
                )
            return self._operator, None
        if not isinstance(certificate, str):
            raise PushRefused("unauthorized", "the author certificate is not a JWS")
        claims = _decode(
            certificate, self._operator, AUTHOR_TYP, "the author certificate", reason="unauthorized"
        )
        if claims.get("sub") != author or PUSH_RIGHT not in (claims.get("rights") or []):
            raise PushRefused("unauthorized", f"the operator did not certify {author} to push policy")
        try:
            return public_key_from_jwk(claims["jwk"]), claims
        except (KeyError, TypeError, ValueError) as exc:
            raise PushRefused("unauthorized", "the author certificate names no usable key") from exc


def _check_certified_at(certificate: dict[str, Any], author: str, pushed_at: float) -> None:
    """The certificate was valid when the push was signed (not necessarily now)."""
    iat, exp = certificate.get("iat"), certificate.get("exp")
    if not isinstance(iat, int | float) or not isinstance(exp, int | float):
        raise PushRefused("unauthorized", "the author certificate has no validity period")
    if not iat - MAX_CLOCK_SKEW_S <= pushed_at <= exp:
        raise PushRefused("unauthorized", f"{author}'s certificate was not valid when the push was signed")


def _decode(token: str, key: Any, typ: str, what: str, *, reason: str = "bad_signature") -> dict[str, Any]:
    """The claims of ``token``, a JWS of type ``typ`` by ``key`` for this audience. Expiry is not
    checked here: what counts is the time of the push (see the module's docstring)."""
    try:
        if jwt.get_unverified_header(token).get("typ") != typ:
            raise PushRefused(reason, f"{what} is not a {typ}")
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=[ALGORITHM],
            audience=AUDIENCE,
            options={"verify_exp": False, "verify_iat": False},
        )
    except jwt.PyJWTError as exc:
        raise PushRefused(reason, f"{what} does not verify: {type(exc).__name__}") from exc
    return claims
