"""Per-tenant keys and the envelope that seals what the fleet keeps for a tenant on the shared bus.

The registry holds one master secret (:class:`MasterSecret`) and derives each tenant's key from it
(HKDF-SHA256, ``info`` = ``"fleet artifacts v1 " + tenant``). It gives a tenant's key only to an
enrolled service that policy lets hold such keys and that shows a caller's token of that tenant,
addressed to itself (``POST /v1/tenant-keys``). So a key is at a service only while that tenant's
callers reach it.

With a :class:`TenantKey` a service:

* seals bytes (:meth:`TenantKey.seal`, AES-256-GCM, a random 96-bit nonce) bound by the AEAD's
  associated data to the tenant, a purpose, the name the bytes are kept under and the key's version:
  sealed bytes moved under another name, tenant or purpose do not open (:meth:`TenantKey.open`);
* names things by keyed hash (:meth:`TenantKey.name`, HMAC-SHA256): a stored name reveals neither the
  plaintext's hash nor the run it belongs to.

The encryption and naming keys are derived apart from the tenant key (HKDF again), so neither use
weakens the other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fleet.errors import ErrorCode, FleetError

KEY_INFO_PREFIX = "fleet artifacts v1 "
MAGIC = b"FTK1"  # a sealed envelope: MAGIC, version length (1 byte), version, nonce, ciphertext + tag
NONCE_BYTES = 12
KEY_BYTES = 32
_VERSION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _expand(secret: bytes, info: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info.encode()).derive(secret)


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One tenant's key, of one version of the registry's master secret. Its ``repr`` shows no key."""

    tenant: str
    version: str
    secret: bytes = field(repr=False)
    _enc: bytes = field(init=False, repr=False, compare=False)
    _names: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tenant or self.tenant == "*":
            raise FleetError(ErrorCode.INVALID_REQUEST, "a tenant key is for one tenant")
        if not _VERSION.match(self.version) or len(self.secret) != KEY_BYTES:
            raise FleetError(ErrorCode.INVALID_REQUEST, "a tenant key is a version and 32 bytes")
        object.__setattr__(self, "_enc", _expand(self.secret, "fleet tenant seal"))
        object.__setattr__(self, "_names", _expand(self.secret, "fleet tenant names"))

    def name(self, purpose: str, value: str) -> str:
        """A keyed hash of ``value`` (hex): what is stored instead of ``value`` itself."""
        message = f"{purpose}\x00{value}".encode()
        return hmac.new(self._names, message, hashlib.sha256).hexdigest()

    def seal(self, purpose: str, name: str, plaintext: bytes) -> bytes:
        """``plaintext`` encrypted and authenticated, bound to this tenant, ``purpose`` and ``name``."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = AESGCM(self._enc).encrypt(nonce, plaintext, self._aad(purpose, name))
        version = self.version.encode()
        return MAGIC + bytes([len(version)]) + version + nonce + sealed

    def open(self, purpose: str, name: str, envelope: bytes) -> bytes:
        """The plaintext of an envelope :meth:`seal` made for the same tenant, purpose and name; an
        ``integrity_failed`` :class:`FleetError` for anything else (changed, moved, forged, another
        tenant's, not an envelope, or of another key version)."""
        if not envelope.startswith(MAGIC) or len(envelope) < len(MAGIC) + 1:
            raise FleetError(ErrorCode.INTEGRITY_FAILED, f"{purpose} {name} is not sealed")
        size = envelope[len(MAGIC)]
        start = len(MAGIC) + 1
        version = envelope[start : start + size].decode(errors="replace")
        if version != self.version:
            raise FleetError(
                ErrorCode.INTEGRITY_FAILED,
                f"{purpose} {name} is sealed with key version {version!r}, not {self.version!r}",
            )
        nonce = envelope[start + size : start + size + NONCE_BYTES]
        try:
            return AESGCM(self._enc).decrypt(
                nonce, envelope[start + size + NONCE_BYTES :], self._aad(purpose, name)
            )
        except (InvalidTag, ValueError) as exc:
            raise FleetError(
                ErrorCode.INTEGRITY_FAILED, f"{purpose} {name} does not verify with its tenant's key"
            ) from exc

    def _aad(self, purpose: str, name: str) -> bytes:
        return "\x00".join(("fleet sealed v1", purpose, self.tenant, name, self.version)).encode()

    def to_json(self) -> dict[str, str]:
        """What the registry answers (the key in base64url)."""
        return {
            "tenant": self.tenant,
            "version": self.version,
            "key": base64.urlsafe_b64encode(self.secret).decode().rstrip("="),
        }

    @classmethod
    def from_json(cls, body: object) -> TenantKey:
        """The key in a registry's answer; ``invalid_request`` if it is not one."""
        try:
            assert isinstance(body, dict)
            encoded = str(body["key"])
            secret = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            return cls(str(body["tenant"]), str(body["version"]), secret)
        except (AssertionError, KeyError, ValueError) as exc:
            raise FleetError(ErrorCode.INVALID_REQUEST, "not a tenant key") from exc


@dataclass(frozen=True, slots=True)
class MasterSecret:
    """The registry's secret that every tenant key is derived from, with its version id."""

    version: str
    secret: bytes = field(repr=False)

    def tenant_key(self, tenant: str) -> TenantKey:
        """Tenant ``tenant``'s key: HKDF-SHA256(master, info = "fleet artifacts v1 " + tenant)."""
        return TenantKey(tenant, self.version, _expand(self.secret, KEY_INFO_PREFIX + tenant))

    @classmethod
    def load_or_create(cls, path: Path) -> MasterSecret:
        """The master secret kept in ``path`` (JSON, mode 0600), made there on first use. Losing it
        makes every sealed artifact and workspace head unreadable: back it up with the registry's key."""
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            body = {
                "version": "m" + secrets.token_hex(4),
                "secret": base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode(),
            }
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass  # another process made it first: use that one
            else:
                with os.fdopen(fd, "w") as handle:
                    json.dump(body, handle)
        try:
            body = json.loads(path.read_text())
            secret = base64.b64decode(body["secret"], validate=True)
            version = str(body["version"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"{path} is not a tenant-key master secret") from exc
        if len(secret) != KEY_BYTES or not _VERSION.match(version):
            raise FleetError(ErrorCode.INVALID_REQUEST, f"{path} is not a tenant-key master secret")
        return cls(version, secret)
