"""Event producers outside the fleet: credentials the operator issues for one tenant and some
sources, until an expiry, and takes back.

A producer holds an nkey (its seed never leaves the machine where ``fleet producers issue`` made
it); the registry keeps the public key with the producer's tenant, sources and expiry
(:class:`~registry._records.ProducerRecord`). The bus lets the key in (:mod:`registry._callout`) and
lets it publish on ``fleet.events.<tenant>.<source>.>`` for its own tenant and sources only: the
tenant and source of every event it publishes come from these credentials, never from what the event
says.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError

from fleet import natsjwt
from fleet.errors import ErrorCode, FleetError
from fleet.revocations import Revocation
from registry._records import ProducerRecord
from registry._store import RegistryStore

MAX_LIFETIME_S = 366 * 24 * 3600.0
DEFAULT_LIFETIME_S = 30 * 24 * 3600.0


def producer_from(body: dict[str, Any], issued_by: str, now: float) -> ProducerRecord:
    """The record of a producer asked for in ``body`` (id, nkey, tenant, sources, lifetime_s)."""
    nkey = str(body.get("nkey", ""))
    try:
        natsjwt.decode_public(nkey, natsjwt.PREFIX_USER)
    except natsjwt.NkeyError as exc:
        raise FleetError(ErrorCode.INVALID_REQUEST, "nkey must be a user nkey's public key (U...)") from exc
    lifetime = body.get("lifetime_s", DEFAULT_LIFETIME_S)
    if not isinstance(lifetime, int | float) or not 0 < float(lifetime) <= MAX_LIFETIME_S:
        raise FleetError(
            ErrorCode.INVALID_REQUEST, f"lifetime_s must be more than 0 and at most {MAX_LIFETIME_S:.0f}"
        )
    try:
        return ProducerRecord(
            id=str(body.get("id", "")),
            nkey=nkey,
            tenant=str(body.get("tenant", "")),
            sources=list(body.get("sources") or []),
            issued_by=issued_by,
            issued_at=now,
            expires_at=now + float(lifetime),
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        raise FleetError(ErrorCode.INVALID_REQUEST, f"{field}: {error['msg']}") from exc


async def issue(store: RegistryStore, body: dict[str, Any], issued_by: str) -> ProducerRecord:
    """Record a producer's credentials; an nkey is issued once (a new one for a new producer)."""
    record = producer_from(body, issued_by, time.time())
    if await store.producer(record.nkey) is not None:
        raise FleetError(ErrorCode.CONFLICT, "this nkey was issued before: make a new one")
    await store.put_producer(record)
    return record


async def revoke(store: RegistryStore, producer_id: str, by: str, reason: str) -> list[Revocation]:
    """Take back every credential of producer ``producer_id``; the revocations to publish."""
    revoked = []
    now = time.time()
    for record in await store.producers():
        if record.id != producer_id or record.revoked:
            continue
        await store.put_producer(record.model_copy(update={"revoked": True}))
        revoked.append(Revocation(record.nkey, f"producer:{record.id}", now, by, reason[:200]))
    if not revoked:
        raise FleetError(ErrorCode.NOT_FOUND, f"no producer {producer_id!r} holds credentials")
    return revoked
