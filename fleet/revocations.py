"""Revoked keys, known to every process within a second of the revocation.

The registry records a revocation in the NATS KV bucket ``fleet-revocations`` (key ``kid.<kid>``,
value: who revoked it, when, why). Every service that verifies tokens keeps the whole list in memory
and follows the bucket's stream (an ordered consumer from the first entry), so a revocation is
pushed to it, not polled: a token signed by a revoked key, or issued to a client on a revoked key
(its ``client_kid`` claim), is refused from then on, though it has not expired.

Until the list has been read once, a verifier does not know what is revoked and refuses every token
(``dependency_unavailable``, retryable): it fails closed. Once read, a broker outage keeps the last
list (and is logged): revocations made meanwhile arrive when the connection is back.

Each entry is signed by the registry (a JWS of type ``revocation+jwt`` by one of its signing keys,
stored with the operator's certificate of that key: :mod:`fleet.issuer_certs`), so it verifies with
the operator's key alone, whenever it was made and whichever registry key made it. An entry that
does not verify (unsigned, signed by another key, by a key revoked before it, or unreadable) is
ignored and reported (:attr:`Revocations.ignored`): whoever can write the bucket cannot revoke a key,
and least of all the registry's own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jwt
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from fleet.errors import ErrorCode, FleetError
from fleet.issuer_certs import CertifiedKey, IssuerTrust
from fleet.keys import ALGORITHM, public_key_from_jwk
from fleet.natsconn import key_value

log = logging.getLogger(__name__)

REVOCATIONS_BUCKET = "fleet-revocations"
_STREAM = f"KV_{REVOCATIONS_BUCKET}"
_PREFIX = f"$KV.{REVOCATIONS_BUCKET}.kid."
REVOCATION_TYP = "revocation+jwt"


@dataclass(frozen=True, slots=True)
class Revocation:
    kid: str
    identity: str
    revoked_at: float
    by: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kid": self.kid,
            "identity": self.identity,
            "revoked_at": self.revoked_at,
            "by": self.by,
            "reason": self.reason,
        }


def signed_revocation(revocation: Revocation, signer: CertifiedKey, issuer: str) -> bytes:
    """The bucket entry of ``revocation``: signed by ``signer``, with its certificate."""
    claims = {**revocation.to_json(), "iss": issuer, "iat": int(time.time())}
    jws = signer.key.sign(claims, typ=REVOCATION_TYP)
    return json.dumps({"schema_version": 2, "revocation": jws, "issuer_cert": signer.cert}).encode()


async def record_revocation(client: NATS, revocation: Revocation, signer: CertifiedKey, issuer: str) -> None:
    """Make ``revocation`` known to every process (the registry's half), signed by ``signer`` (the
    registry's current key) as ``issuer``."""
    bucket = await key_value(client, REVOCATIONS_BUCKET, history=1)
    await bucket.put(f"kid.{revocation.kid}", signed_revocation(revocation, signer, issuer))


class Revocations:
    """The revoked key ids, followed live from the bucket (see the module's doc). ``trust``: the
    operator's key, which entries are verified with."""

    def __init__(self, trust: IssuerTrust) -> None:
        self._trust = trust
        self.ignored = 0  # entries that did not verify (see the module's doc)
        self._revoked: dict[str, Revocation] = {}
        self._synced = asyncio.Event()
        self._listeners: list[Callable[[Revocation], None]] = []
        self._subscription: Any = None

    @property
    def synced(self) -> bool:
        """Whether the list has been read once (before that, nothing can be trusted)."""
        return self._synced.is_set()

    def on_revoke(self, listener: Callable[[Revocation], None]) -> None:
        """Call ``listener`` for each revocation from now on (e.g. to drop a cached key)."""
        self._listeners.append(listener)

    def check(self, *kids: str | None) -> Revocation | None:
        """The revocation of the first of ``kids`` that is revoked, if any. Refuses to answer
        (``dependency_unavailable``) until the list has been read once."""
        if not self.synced:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "the list of revoked keys is not loaded yet", retryable=True
            )
        for kid in kids:
            if kid is not None and kid in self._revoked:
                return self._revoked[kid]
        return None

    def revoked(self) -> list[Revocation]:
        return sorted(self._revoked.values(), key=lambda r: r.revoked_at)

    async def follow(self, client: NATS, timeout_s: float = 10.0) -> None:
        """Read every revocation so far, then keep following new ones; returns once synced."""
        await key_value(client, REVOCATIONS_BUCKET, history=1)  # exists before anyone reads it
        js = client.jetstream()
        try:
            info = await js.stream_info(_STREAM)
            empty = info.state.messages == 0
        except NotFoundError:
            empty = True
        if empty:
            self._synced.set()

        async def arrived(msg: Msg) -> None:
            self._take(msg)
            if msg.metadata.num_pending == 0:  # the last of what was there; new ones follow live
                self._synced.set()

        self._subscription = await js.subscribe(
            _PREFIX + ">", cb=arrived, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
        except TimeoutError as exc:
            await self.stop()  # a retry subscribes afresh
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "cannot read the list of revoked keys", retryable=True
            ) from exc

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    def _take(self, msg: Msg) -> None:
        if not msg.data:  # a deleted entry: revocations are never taken back
            return
        revocation, why = self._verified(msg.data, msg.subject.removeprefix(_PREFIX))
        if revocation is None:
            self.ignored += 1
            log.warning("ignoring a revocation entry on %s: %s", msg.subject, why)
            return
        self.note(revocation)

    def _verified(self, data: bytes, subject_kid: str) -> tuple[Revocation | None, str]:
        """The revocation an entry holds, if the registry signed it; else why not."""
        try:
            envelope = json.loads(data)
            jws, cert = envelope["revocation"], envelope["issuer_cert"]
            header = jwt.get_unverified_header(jws)
        except (ValueError, KeyError, TypeError, jwt.PyJWTError):
            return None, "not a signed revocation"
        signer = self._trust.certified_jwk(cert)
        if signer is None or header.get("kid") != signer["kid"] or header.get("typ") != REVOCATION_TYP:
            return None, "not signed by a key the operator certified for the registry"
        if signer["kid"] in self._revoked:
            return None, f"signed by {signer['kid']}, which was revoked before"
        try:
            body = jwt.decode(
                jws,
                public_key_from_jwk(signer),
                algorithms=[ALGORITHM],
                issuer=self._trust.issuer,
                options={"require": ["iss", "kid"], "verify_aud": False, "verify_exp": False},
            )
            revocation = Revocation(
                kid=str(body["kid"]),
                identity=str(body.get("identity", "")),
                revoked_at=float(body.get("revoked_at", time.time())),
                by=str(body.get("by", "")),
                reason=str(body.get("reason", "")),
            )
        except (jwt.PyJWTError, ValueError, KeyError, TypeError):
            return None, "its signature does not verify"
        if revocation.kid != subject_kid or revocation.kid == signer["kid"]:
            return None, f"it revokes {revocation.kid}, which it cannot from this entry"
        return revocation, ""

    def note(self, revocation: Revocation) -> None:
        """Take ``revocation`` into the list now (the process that made it need not wait for the
        broker to bring it back); its arrival from the bucket later changes nothing."""
        if revocation.kid in self._revoked:
            return
        self._revoked[revocation.kid] = revocation
        log.warning("key %s of %s revoked by %s: %s", revocation.kid, revocation.identity, revocation.by,
                    revocation.reason or "no reason given")  # fmt: skip
        for listener in self._listeners:
            listener(revocation)
