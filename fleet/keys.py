"""Signing keys: every agent, service and operator has its own EC P-256 key pair (JWS ``ES256``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

ALGORITHM = "ES256"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def jwk_thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638 thumbprint of an EC public JWK (used as the key id)."""
    canonical = json.dumps(
        {"crv": jwk["crv"], "kty": jwk["kty"], "x": jwk["x"], "y": jwk["y"]},
        separators=(",", ":"),
        sort_keys=True,
    )
    return _b64url(hashlib.sha256(canonical.encode()).digest())


def public_jwk_of(public_key: ec.EllipticCurvePublicKey) -> dict[str, Any]:
    """The public JWK of ``public_key`` with ``kid`` (its thumbprint), ``alg`` and ``use``."""
    jwk: dict[str, Any] = ECAlgorithm.to_jwk(public_key, as_dict=True)
    jwk = {k: jwk[k] for k in ("kty", "crv", "x", "y")}
    jwk.update(kid=jwk_thumbprint(jwk), alg=ALGORITHM, use="sig")
    return jwk


def public_key_from_jwk(jwk: dict[str, Any]) -> ec.EllipticCurvePublicKey:
    """Load an EC public key from a JWK, refusing anything that is not P-256."""
    if jwk.get("kty") != "EC" or jwk.get("crv") != "P-256":
        raise ValueError("only EC P-256 keys are accepted")
    key = ECAlgorithm.from_jwk(json.dumps({k: jwk[k] for k in ("kty", "crv", "x", "y")}))
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError("JWK is not a public key")
    return key


@dataclass(frozen=True, slots=True)
class SigningKey:
    """A private signing key with its key id."""

    private_key: ec.EllipticCurvePrivateKey
    kid: str

    @classmethod
    def generate(cls) -> SigningKey:
        private = ec.generate_private_key(ec.SECP256R1())
        return cls(private, jwk_thumbprint(public_jwk_of(private.public_key())))

    @classmethod
    def load_or_create(cls, path: Path) -> SigningKey:
        """Load the PEM key at ``path``; create it (mode 0600) if it does not exist yet."""
        if path.exists():
            loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
            if not isinstance(loaded, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{path} is not an EC private key")
            return cls(loaded, jwk_thumbprint(public_jwk_of(loaded.public_key())))
        key = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = key.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(pem)
        return key

    def public_jwk(self) -> dict[str, Any]:
        return public_jwk_of(self.private_key.public_key())

    def derived_secret(self, purpose: str) -> bytes:
        """A 32-byte secret for ``purpose`` that only the holder of this key can make (HMAC-SHA256
        keyed by the private scalar): e.g. to seal what an identity hands out and takes back."""
        scalar = self.private_key.private_numbers().private_value.to_bytes(32, "big")
        return hmac.new(scalar, f"agent-fleet/{purpose}".encode(), hashlib.sha256).digest()

    def sign(self, claims: dict[str, Any], *, typ: str = "JWT") -> str:
        """A compact JWS over ``claims`` with this key's ``kid``."""
        return jwt.encode(
            claims, self.private_key, algorithm=ALGORITHM, headers={"kid": self.kid, "typ": typ}
        )
