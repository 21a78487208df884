"""Registry records signed by the registry, so that a record written to the bucket by anyone else
is not believed.

A record is stored as ``{"sealed": JWS, "issuer_cert": CERT}``: the JWS (type
``registry-record+jwt``, by the registry's current signing key) holds the record and the KV key it
was written under (so it cannot be moved to another key), and the certificate is the operator's for
that signing key (:mod:`fleet.issuer_certs`). A record verifies with the operator's key alone, so
records signed before a rotation still verify after it, until their signing key is revoked (the
registry signs every record again before it revokes one of its own keys). A record that does not
verify reads as absent, and is reported.

Reads are frequent (the token service reads identities), so what verified is remembered by its
exact bytes (the same bytes verify the same way); a revocation of the signing key still applies.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jwt

from fleet.issuer_certs import CertifiedKey, IssuerTrust
from fleet.keys import ALGORITHM, public_key_from_jwk

log = logging.getLogger(__name__)

RECORD_TYP = "registry-record+jwt"
_MEMO_SIZE = 4096


class RecordSeal:
    """Signs records as they are written and verifies them as they are read (see the module's doc).
    ``revoked``: whether a key id is revoked. ``signer`` is set once the registry's key is known
    (reading needs only the operator's key)."""

    def __init__(self, trust: IssuerTrust, revoked: Callable[[str], bool]) -> None:
        self._trust = trust
        self._revoked = revoked
        self.signer: CertifiedKey | None = None
        self.refused = 0  # records that did not verify
        self._memo: OrderedDict[bytes, tuple[str, str, dict[str, Any]]] = OrderedDict()

    def seal(self, key: str, record: dict[str, Any]) -> bytes:
        if self.signer is None:
            raise RuntimeError("the registry's signing key is not known yet")
        claims = {"key": key, "record": record, "iat": int(time.time())}
        jws = self.signer.key.sign(claims, typ=RECORD_TYP)
        return json.dumps({"sealed": jws, "issuer_cert": self.signer.cert}).encode()

    def signer_of(self, value: bytes) -> str | None:
        """The key id that signed ``value`` (unverified: to decide whether to sign it again)."""
        try:
            kid = jwt.get_unverified_header(json.loads(value)["sealed"]).get("kid")
        except (ValueError, KeyError, TypeError, jwt.PyJWTError):
            return None
        return kid if isinstance(kid, str) else None

    def open(self, key: str, value: bytes) -> dict[str, Any] | None:
        """The record stored as ``value`` under ``key``, if the registry signed it there."""
        seen = self._memo.get(value)
        if seen is not None and seen[0] == key and not self._revoked(seen[1]):
            self._memo.move_to_end(value)
            return seen[2]
        record, signer, why = self._verify(key, value)
        if record is None:
            self.refused += 1
            log.warning("ignoring the registry record %s: %s", key, why)
            return None
        self._memo[value] = (key, signer, record)
        if len(self._memo) > _MEMO_SIZE:
            self._memo.popitem(last=False)
        return record

    def _verify(self, key: str, value: bytes) -> tuple[dict[str, Any] | None, str, str]:
        try:
            envelope = json.loads(value)
            jws, cert = envelope["sealed"], envelope["issuer_cert"]
            header = jwt.get_unverified_header(jws)
        except (ValueError, KeyError, TypeError, jwt.PyJWTError):
            return None, "", "not signed by the registry"
        signer = self._trust.certified_jwk(cert)
        if signer is None or header.get("kid") != signer["kid"] or header.get("typ") != RECORD_TYP:
            return None, "", "not signed by a key the operator certified for the registry"
        if self._revoked(signer["kid"]):
            return None, "", f"signed by the revoked key {signer['kid']}"
        try:
            claims = jwt.decode(
                jws,
                public_key_from_jwk(signer),
                algorithms=[ALGORITHM],
                options={"require": ["key", "record"], "verify_aud": False, "verify_exp": False},
            )
        except jwt.PyJWTError:
            return None, "", "its signature does not verify"
        if claims["key"] != key or not isinstance(claims["record"], dict):
            return None, "", f"it was signed for {claims['key']!r}"
        return claims["record"], signer["kid"], ""
