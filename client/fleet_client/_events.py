"""Events on the fleet's bus, as a producer publishes them: structured-mode CloudEvents on
``fleet.events.<tenant>.<source>.<name>...``, de-duplicated by (tenant, source, id)."""

from __future__ import annotations

import datetime as dt
import json
import re
import ssl
import uuid
from pathlib import Path
from typing import Any

import nats

from fleet_client._errors import FleetClientError

EVENTS_PREFIX = "fleet.events."
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SUBJECT = re.compile(r"fleet\.events(\.[A-Za-z0-9_-]{1,64})+")
_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,200}")


def event_envelope(
    subject: str,
    *,
    tenant: str,
    source: str,
    type_: str,
    data: dict[str, Any],
    event_id: str | None = None,
    time: dt.datetime | None = None,
) -> tuple[str, bytes, dict[str, str]]:
    """(NATS subject, payload, headers) of an event of ``tenant`` from ``source`` on the logical
    ``subject`` (``fleet.events.invoices.closed`` is sent on ``fleet.events.acme.erp.invoices.closed``)."""
    if not _SUBJECT.fullmatch(subject):
        raise FleetClientError("invalid_request", "the subject must be fleet.events.<token>[.<token>...]")
    for what, token in (("tenant", tenant), ("source", source)):
        if not _TOKEN.fullmatch(token):
            raise FleetClientError(
                "invalid_request", f"{what}: 1-64 letters, digits, _ and - (one subject token)"
            )
    event_id = event_id or uuid.uuid4().hex
    if not _ID.fullmatch(event_id):
        raise FleetClientError("invalid_request", "id: 1-200 characters of letters, digits and ._:@/-")
    envelope = {
        "specversion": "1.0",
        "id": event_id,
        "source": source,
        "type": type_,
        "tenant": tenant,
        "time": (time or dt.datetime.now(dt.UTC)).isoformat(),
        "data": data,
    }
    wire = f"{EVENTS_PREFIX}{tenant}.{source}.{subject.removeprefix(EVENTS_PREFIX)}"
    return wire, json.dumps(envelope).encode(), {"Nats-Msg-Id": f"{tenant}/{source}/{event_id}"}


async def publish_event(
    nats_url: str,
    seed_file: str | Path,
    producer: str,
    subject: str,
    *,
    tenant: str,
    source: str,
    type_: str,
    data: dict[str, Any],
    event_id: str | None = None,
    tls_ca: str | Path | None = None,
) -> tuple[str, bool]:
    """Publish one event as ``producer`` (its seed from ``fleet producers issue``); (the event's
    id, whether the bus kept it: False for a duplicate of an event it already has)."""
    wire, payload, headers = event_envelope(
        subject, tenant=tenant, source=source, type_=type_, data=data, event_id=event_id
    )
    options: dict[str, Any] = {
        "nkeys_seed": str(seed_file),  # nats-py reads the seed from the file
        "inbox_prefix": f"_INBOX.{producer}",
        "connect_timeout": 5,
        "max_reconnect_attempts": 3,
    }
    if tls_ca is not None:
        options["tls"] = ssl.create_default_context(cafile=str(tls_ca))
    try:
        client = await nats.connect(nats_url, **options)
    except Exception as exc:  # nats-py raises several kinds; the caller gets one
        raise FleetClientError(
            "dependency_unavailable", f"cannot connect to {nats_url}: {exc!r}", retryable=True
        ) from exc
    try:
        ack = await client.jetstream().publish(wire, payload, headers=headers)
    except Exception as exc:
        raise FleetClientError("forbidden", f"the bus refused the event: {exc!r}") from exc
    finally:
        await client.close()
    return headers["Nats-Msg-Id"].rsplit("/", 1)[-1], not ack.duplicate
