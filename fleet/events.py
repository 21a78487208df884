"""Ambient events: the envelope producers publish, and how to publish one.

Subjects: ``fleet.events.<domain>.<name>`` (e.g. ``fleet.events.invoices.received``); everything
under ``fleet.events.>`` is kept in the JetStream stream ``FLEET_EVENTS``. The payload is a
CloudEvents-style JSON envelope::

    {"specversion": "1.0", "id": "inv-2031", "source": "erp", "type": "invoice.received",
     "tenant": "acme", "time": "2026-11-29T02:00:00+00:00", "data": {...}}

``id`` (unique per source; also the ``Nats-Msg-Id``, so a republished event is dropped by the stream
within its de-duplication window), ``source``, ``type`` and ``tenant`` are required; ``data`` is an
object. The run an event starts has an id derived from the tenant and the event id, so an event that
arrives twice (outside the window, or redelivered) never makes a second run.

    async with await connect(url, "erp") as nc:
        await publish_event(nc, "fleet.events.invoices.received", tenant="acme", source="erp",
                            type_="invoice.received", data={"invoice": "INV-7"}, event_id="inv-7")
"""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import patiently, replicas

EVENTS_STREAM = "FLEET_EVENTS"
EVENTS_SUBJECTS = "fleet.events.>"
DEAD_LETTER_STREAM = "FLEET_DEAD_LETTERS"
DEAD_LETTER_SUBJECT = "fleet.dead.events"
DUPLICATE_WINDOW_S = 3600.0  # a republished event id within an hour is dropped by the stream itself
MAX_EVENT_BYTES = 256 * 1024
_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,200}$")
_SUBJECT = re.compile(r"^fleet\.events(\.[A-Za-z0-9_-]+)+$")
_RUN_NAMESPACE = uuid.UUID("5b0f4f39-7f3e-4b8e-9d0c-6a4f3c2e9e11")


class EventError(FleetError):
    """An event that can never be accepted as it is (it goes to the dead-letter subject)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_REQUEST, message)


@dataclass(frozen=True, slots=True)
class Event:
    subject: str
    id: str
    source: str
    type: str
    tenant: str
    time: str
    data: dict[str, Any]

    def run_id(self) -> str:
        """The id of the run this event starts: the same for the same tenant and event id."""
        return str(uuid.uuid5(_RUN_NAMESPACE, f"{self.tenant}/{self.source}/{self.id}"))

    def envelope(self) -> dict[str, Any]:
        return {
            "specversion": "1.0",
            "id": self.id,
            "source": self.source,
            "type": self.type,
            "tenant": self.tenant,
            "time": self.time,
            "subject": self.subject,
            "data": self.data,
        }


def parse_event(subject: str, payload: bytes) -> Event:
    """The event in a message, or :class:`EventError` saying what is wrong with it."""
    if len(payload) > MAX_EVENT_BYTES:
        raise EventError(f"the event is larger than {MAX_EVENT_BYTES} bytes")
    try:
        body = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EventError(f"the event is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise EventError("the event must be a JSON object (the envelope)")
    for key in ("id", "source", "type", "tenant"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise EventError(f"the envelope needs a non-empty string {key!r}")
    if not _ID.match(body["id"]):
        raise EventError("id: 1-200 characters of letters, digits and ._:@/-")
    data = body.get("data", {})
    if not isinstance(data, dict):
        raise EventError("data must be an object")
    time = body.get("time") or dt.datetime.now(dt.UTC).isoformat()
    if not isinstance(time, str):
        raise EventError("time must be an RFC 3339 string")
    return Event(subject, body["id"], body["source"], body["type"], body["tenant"], time, data)


def event_payload(
    *,
    tenant: str,
    source: str,
    type_: str,
    data: dict[str, Any],
    event_id: str | None = None,
    time: dt.datetime | None = None,
) -> tuple[str, bytes]:
    """(event id, envelope bytes) for a new event, which happened at ``time`` (now by default)."""
    event_id = event_id or uuid.uuid4().hex
    envelope = {
        "specversion": "1.0",
        "id": event_id,
        "source": source,
        "type": type_,
        "tenant": tenant,
        "time": (time or dt.datetime.now(dt.UTC)).isoformat(),
        "data": data,
    }
    return event_id, json.dumps(envelope).encode()


async def ensure_event_streams(js: JetStreamContext) -> None:
    """The events stream (de-duplicated by ``Nats-Msg-Id``) and the dead-letter stream."""
    await ensure_stream(js, EVENTS_STREAM, EVENTS_SUBJECTS, max_age_s=7 * 24 * 3600.0)
    await ensure_stream(js, DEAD_LETTER_STREAM, "fleet.dead.>", max_age_s=7 * 24 * 3600.0)


async def ensure_stream(js: JetStreamContext, name: str, subjects: str, *, max_age_s: float) -> None:
    """A file-backed JetStream stream over ``subjects`` that drops a message whose ``Nats-Msg-Id``
    it has seen within the de-duplication window; created if missing."""

    async def get_or_create() -> None:
        try:
            await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(
                StreamConfig(
                    name=name,
                    subjects=[subjects],
                    retention=RetentionPolicy.LIMITS,
                    storage=StorageType.FILE,
                    duplicate_window=DUPLICATE_WINDOW_S,
                    max_age=max_age_s,
                    num_replicas=replicas(js),
                )
            )

    await patiently(f"opening stream {name}", get_or_create)


async def publish_event(
    client: NATS,
    subject: str,
    *,
    tenant: str,
    source: str,
    type_: str,
    data: dict[str, Any],
    event_id: str | None = None,
    time: dt.datetime | None = None,
) -> tuple[str, bool]:
    """Publish an event; (its id, whether the stream kept it: False for a duplicate id)."""
    if not _SUBJECT.match(subject):
        raise EventError("the subject must be fleet.events.<token>[.<token>...]")
    event_id, payload = event_payload(
        tenant=tenant, source=source, type_=type_, data=data, event_id=event_id, time=time
    )
    return event_id, await publish_raw(client, subject, payload, event_id)


async def publish_raw(client: NATS, subject: str, payload: bytes, event_id: str) -> bool:
    """Publish bytes as an event with ``event_id`` as its ``Nats-Msg-Id``; whether it was kept."""
    js = client.jetstream()
    await ensure_event_streams(js)
    ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": event_id})
    return not ack.duplicate
