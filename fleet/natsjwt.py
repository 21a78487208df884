"""NATS keys (nkeys) and NATS JWTs, on ``cryptography``'s Ed25519.

What the bus's authentication needs from NATS's own formats, and no more:

* an nkey is an Ed25519 key written the NATS way: a role prefix (``U`` user, ``A`` account, ``N``
  server, ``O`` operator), the 32 raw bytes and a CRC-16, in unpadded base32; a seed is the private
  half, written ``S`` + role;
* a NATS JWT is a JWS with header ``{"typ":"JWT","alg":"ed25519-nkey"}`` signed by the nkey named
  in its ``iss``;
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# Role prefixes (the first character of the encoded key).
PREFIX_SEED = 18 << 3  # 'S'
PREFIX_OPERATOR = 14 << 3  # 'O'
PREFIX_SERVER = 13 << 3  # 'N'
PREFIX_ACCOUNT = 0  # 'A'
PREFIX_USER = 20 << 3  # 'U'
_ROLES = {PREFIX_OPERATOR, PREFIX_SERVER, PREFIX_ACCOUNT, PREFIX_USER}

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}


class NkeyError(ValueError):
    """A key, seed, JWT or creds file that is not what it claims to be."""


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def _b32encode(raw: bytes) -> str:
    return base64.b32encode(raw).decode("ascii").rstrip("=")


def _b32decode(text: str) -> bytes:
    try:
        return base64.b32decode(text + "=" * (-len(text) % 8))
    except (binascii.Error, ValueError) as exc:
        raise NkeyError("not base32") from exc


def _with_crc(raw: bytes) -> bytes:
    return raw + _crc16(raw).to_bytes(2, "little")


def _checked(text: str) -> bytes:
    raw = _b32decode(text)
    if len(raw) < 3 or _crc16(raw[:-2]) != int.from_bytes(raw[-2:], "little"):
        raise NkeyError("bad checksum")
    return raw[:-2]


def decode_public(key: str, prefix: int | None = None) -> tuple[int, bytes]:
    """(role prefix, 32 raw bytes) of a public nkey; ``prefix``: the role it must have."""
    raw = _checked(key)
    if len(raw) != 33 or raw[0] not in _ROLES or (prefix is not None and raw[0] != prefix):
        raise NkeyError("not a public nkey of the expected role")
    return raw[0], raw[1:]


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An nkey pair: what signs (a user's nonce, an issuer's JWTs)."""

    prefix: int
    private: Ed25519PrivateKey

    @classmethod
    def generate(cls, prefix: int) -> KeyPair:
        return cls(prefix, Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: str | bytes) -> KeyPair:
        text = seed.decode("ascii") if isinstance(seed, bytes) else seed
        raw = _checked(text.strip())
        if len(raw) != 34 or raw[0] & 0xF8 != PREFIX_SEED:
            raise NkeyError("not an nkey seed")
        prefix = ((raw[0] & 0x07) << 5) | ((raw[1] & 0xF8) >> 3)
        if prefix not in _ROLES:
            raise NkeyError("a seed of an unknown role")
        return cls(prefix, Ed25519PrivateKey.from_private_bytes(raw[2:]))

    @property
    def seed(self) -> str:
        raw = self.private.private_bytes_raw()
        head = bytes([PREFIX_SEED | (self.prefix >> 5), (self.prefix & 31) << 3])
        return _b32encode(_with_crc(head + raw))

    @property
    def public_key(self) -> str:
        raw = self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return _b32encode(_with_crc(bytes([self.prefix]) + raw))

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)


def verify(public_key: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s over ``data``."""
    try:
        _, raw = decode_public(public_key)
        Ed25519PublicKey.from_public_bytes(raw).verify(signature, data)
    except (NkeyError, InvalidSignature, ValueError):
        return False
    return True


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise NkeyError("not base64url") from exc


def encode(claims: dict[str, Any], signer: KeyPair) -> str:
    """A NATS JWT of ``claims`` signed by ``signer`` (``iss``, ``iat`` and ``jti`` are set here)."""
    body = dict(claims)
    body.setdefault("iat", int(time.time()))
    body["iss"] = signer.public_key
    body.pop("jti", None)
    body["jti"] = _b32encode(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest())
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = _b64(signer.sign(f"{head}.{payload}".encode()))
    return f"{head}.{payload}.{signature}"


def decode(token: str, *, issuer: str | None = None, now: float | None = None) -> dict[str, Any]:
    """The claims of a NATS JWT whose signature verifies with its ``iss`` (which must be ``issuer``
    if given) and which has not expired; :class:`NkeyError` otherwise."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise NkeyError("not a JWT")
    try:
        header = json.loads(_unb64(parts[0]))
        claims = json.loads(_unb64(parts[1]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise NkeyError("not a JWT") from exc
    if not isinstance(header, dict) or header.get("alg") != HEADER["alg"] or not isinstance(claims, dict):
        raise NkeyError("not a NATS JWT")
    signer = claims.get("iss")
    if not isinstance(signer, str) or (issuer is not None and signer != issuer):
        raise NkeyError("signed by someone else")
    if not verify(signer, f"{parts[0]}.{parts[1]}".encode(), _unb64(parts[2])):
        raise NkeyError("the signature does not verify")
    exp = claims.get("exp")
    if exp is not None and (not isinstance(exp, int | float) or exp <= (now or time.time())):
        raise NkeyError("expired")
    return claims
