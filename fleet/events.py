"""Ambient events: the subjects producers publish on, the envelope, and how to publish one.

Subjects: ``fleet.events.<tenant>.<source>.<name>...`` (e.g. ``fleet.events.acme.erp.invoices.received``);
the tenant and the source are one token each (letters, digits, ``_`` and ``-``, 1-64 characters) and at
least one name token follows. The tenant and the source of an event are those of its subject, never the
payload's word: the broker's permissions let a producer publish only under its own tenant and sources.
Trigger rules and event waits name the *logical* subject, ``fleet.events.<name>...`` (tenant and source
taken out), which is :attr:`Event.subject`.

Everything under ``fleet.events.>`` is kept in the JetStream stream ``FLEET_EVENTS``. Two content modes
of the CloudEvents NATS binding are accepted:

* structured: the payload is the JSON envelope ::

      {"specversion": "1.0", "id": "inv-2031", "source": "erp", "type": "invoice.received",
       "time": "2026-11-29T02:00:00+00:00", "data": {...}}

* binary: the attributes are headers (``ce-specversion``, ``ce-id``, ``ce-source``, ``ce-type``,
  optional ``ce-time`` and ``ce-subject``), ``content-type`` is JSON and the payload is the data.

``id`` and ``type`` are required; ``data`` is an object. ``source`` and ``tenant`` may be left out; if
present they must equal the subject's tokens (CloudEvents' ``source`` maps to the subject's source token
as it is), or the event is refused. An event is unique by (tenant, source, id): the run it starts has an
id derived from the three, so an event that arrives twice never makes a second run, and the same id from
another tenant or source is another event. ``ce-subject`` is accepted and not used.

    async with await connect(url, "erp") as nc:
        await publish_event(nc, "fleet.events.invoices.received", tenant="acme", source="erp",
                            type_="invoice.received", data={"invoice": "INV-7"}, event_id="inv-7")
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import uuid
from collections.abc import Mapping
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
EVENTS_PREFIX = "fleet.events."
DEAD_LETTER_STREAM = "FLEET_DEAD_LETTERS"
DEAD_LETTER_SUBJECT = "fleet.dead.events"
DUPLICATE_WINDOW_S = 3600.0  # the dead-letter stream (and the streams of others using ensure_stream)
# The events stream's de-duplication window: the smallest nats-server accepts (100 ms). Any producer
# can set any Nats-Msg-Id, so the stream's de-duplication cannot be trusted across producers (one could
# shadow another tenant's id); the ingest is idempotent by (tenant, source, id) instead.
EVENTS_DUPLICATE_WINDOW_S = 0.1
MAX_EVENT_BYTES = 256 * 1024
TOKEN_PATTERN = r"[A-Za-z0-9_-]{1,64}"  # a tenant or a source in a subject
_TOKEN = re.compile(rf"^{TOKEN_PATTERN}$")
_ID = re.compile(r"^[A-Za-z0-9._:@/-]{1,200}$")
_SUBJECT = re.compile(r"^fleet\.events(\.[A-Za-z0-9_-]+)+$")
_WIRE_SUBJECT = re.compile(rf"^fleet\.events\.({TOKEN_PATTERN})\.({TOKEN_PATTERN})((\.[A-Za-z0-9_-]+)+)$")
_RUN_NAMESPACE = uuid.UUID("5b0f4f39-7f3e-4b8e-9d0c-6a4f3c2e9e11")
_JSON_TYPES = ("application/json", "text/json")


class EventError(FleetError):
    """An event that can never be accepted as it is (it goes to the dead-letter subject)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_REQUEST, message)


@dataclass(frozen=True, slots=True)
class Event:
    """An accepted event. ``subject`` is the logical subject (``fleet.events.<name>...``, tenant and
    source taken out); ``tenant`` and ``source`` are those of the NATS subject it came on."""

    subject: str
    id: str
    source: str
    type: str
    tenant: str
    time: str
    data: dict[str, Any]

    def run_id(self) -> str:
        """The id of the run this event starts: the same for the same tenant, source and event id."""
        return str(uuid.uuid5(_RUN_NAMESPACE, f"{self.tenant}/{self.source}/{self.id}"))

    def nats_subject(self) -> str:
        """The subject the event is published on (``fleet.events.<tenant>.<source>.<name>...``)."""
        return event_subject(self.subject, tenant=self.tenant, source=self.source)

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


@dataclass(frozen=True, slots=True)
class EventMessage:
    """An event ready to publish: its NATS subject, its ``Nats-Msg-Id`` header and its bytes."""

    subject: str
    id: str
    payload: bytes
    headers: dict[str, str]


def event_subject(subject: str, *, tenant: str, source: str) -> str:
    """The NATS subject of an event of ``tenant`` from ``source`` on the logical ``subject``
    (``fleet.events.invoices.closed`` -> ``fleet.events.acme.erp.invoices.closed``)."""
    if not _SUBJECT.match(subject):
        raise EventError("the subject must be fleet.events.<token>[.<token>...]")
    for what, token in (("tenant", tenant), ("source", source)):
        if not _TOKEN.match(token):
            raise EventError(f"{what}: 1-64 characters of letters, digits, _ and - (one subject token)")
    return f"{EVENTS_PREFIX}{tenant}.{source}.{subject.removeprefix(EVENTS_PREFIX)}"


def split_subject(subject: str) -> tuple[str, str, str]:
    """(tenant, source, logical subject) of a NATS subject ``fleet.events.<tenant>.<source>.<name>...``."""
    found = _WIRE_SUBJECT.match(subject)
    if found is None:
        raise EventError(
            "the subject must be fleet.events.<tenant>.<source>.<name>[.<name>...] (tenant and source:"
            " 1-64 letters, digits, _ or -)"
        )
    return found[1], found[2], f"fleet.events{found[3]}"


def message_id(tenant: str, source: str, event_id: str) -> str:
    """The ``Nats-Msg-Id`` the fleet's helpers give an event: unique by (tenant, source, id)."""
    return f"{tenant}/{source}/{event_id}"


def parse_event(subject: str, payload: bytes, headers: Mapping[str, str] | None = None) -> Event:
    """The event in a message (structured or binary mode), or :class:`EventError` saying what is
    wrong with it. Its tenant and source are the subject's."""
    tenant, source, logical = split_subject(subject)
    if len(payload) > MAX_EVENT_BYTES:
        raise EventError(f"the event is larger than {MAX_EVENT_BYTES} bytes")
    lowered = {key.lower(): value for key, value in (headers or {}).items()}
    if "ce-specversion" in lowered:
        attributes, data = _binary(lowered, payload)
    else:
        attributes, data = _structured(payload)
    for key, actual in (("tenant", tenant), ("source", source)):
        claimed = attributes.get(key)
        if claimed is not None and claimed != actual:
            raise EventError(
                f"the event names {key} {str(claimed)[:80]!r} but its subject's {key} is {actual!r}"
            )
    for key in ("id", "type"):
        if not isinstance(attributes.get(key), str) or not attributes[key]:
            raise EventError(f"the event needs a non-empty string {key!r}")
    if not _ID.match(attributes["id"]):
        raise EventError("id: 1-200 characters of letters, digits and ._:@/-")
    time = attributes.get("time") or dt.datetime.now(dt.UTC).isoformat()
    if not isinstance(time, str):
        raise EventError("time must be an RFC 3339 string")
    return Event(logical, attributes["id"], source, attributes["type"], tenant, time, data)


def _structured(payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(attributes, data) of a structured-mode event: the payload is the JSON envelope."""
    body = _json(payload, "the event")
    if not isinstance(body, dict):
        raise EventError("the event must be a JSON object (the envelope)")
    data = body.get("data", {})
    if not isinstance(data, dict):
        raise EventError("data must be an object")
    return body, data


def _binary(headers: dict[str, str], payload: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """(attributes, data) of a binary-mode event: ``ce-`` headers, and the payload is the data."""
    if headers["ce-specversion"] != "1.0":
        raise EventError("ce-specversion must be 1.0")
    media_type = headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media_type not in _JSON_TYPES and not media_type.endswith("+json"):
        raise EventError(f"content-type {media_type!r}: the data of an event must be JSON")
    data = _json(payload, "the event's data") if payload.strip() else {}
    if not isinstance(data, dict):
        raise EventError("data must be an object")
    attributes = {key.removeprefix("ce-"): value for key, value in headers.items() if key.startswith("ce-")}
    return attributes, data


def _json(payload: bytes, what: str) -> Any:
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EventError(f"{what} is not JSON: {exc}") from exc


def event_message(
    subject: str,
    *,
    tenant: str,
    source: str,
    type_: str,
    data: dict[str, Any],
    event_id: str | None = None,
    time: dt.datetime | None = None,
) -> EventMessage:
    """A new structured-mode event of ``tenant`` from ``source`` on the logical ``subject``, which
    happened at ``time`` (now by default)."""
    nats_subject = event_subject(subject, tenant=tenant, source=source)
    event_id = event_id or uuid.uuid4().hex
    if not _ID.match(event_id):
        raise EventError("id: 1-200 characters of letters, digits and ._:@/-")
    envelope = {
        "specversion": "1.0",
        "id": event_id,
        "source": source,
        "type": type_,
        "tenant": tenant,
        "time": (time or dt.datetime.now(dt.UTC)).isoformat(),
        "data": data,
    }
    headers = {"Nats-Msg-Id": message_id(tenant, source, event_id)}
    return EventMessage(nats_subject, event_id, json.dumps(envelope).encode(), headers)


async def ensure_event_streams(js: JetStreamContext) -> None:
    """The events stream (with the smallest de-duplication window) and the dead-letter stream."""
    await ensure_stream(
        js,
        EVENTS_STREAM,
        EVENTS_SUBJECTS,
        max_age_s=7 * 24 * 3600.0,
        duplicate_window_s=EVENTS_DUPLICATE_WINDOW_S,
    )
    await ensure_stream(js, DEAD_LETTER_STREAM, "fleet.dead.>", max_age_s=7 * 24 * 3600.0)


async def ensure_stream(
    js: JetStreamContext,
    name: str,
    subjects: str,
    *,
    max_age_s: float,
    duplicate_window_s: float = DUPLICATE_WINDOW_S,
    max_msgs_per_subject: int = -1,
) -> None:
    """A file-backed JetStream stream over ``subjects`` that drops a message whose ``Nats-Msg-Id``
    it has seen within ``duplicate_window_s`` (and keeps at most ``max_msgs_per_subject`` per
    subject, -1: any); created if missing, its window set if it differs."""

    async def get_or_create() -> None:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            await js.add_stream(
                StreamConfig(
                    name=name,
                    subjects=[subjects],
                    retention=RetentionPolicy.LIMITS,
                    storage=StorageType.FILE,
                    duplicate_window=duplicate_window_s,
                    max_age=max_age_s,
                    max_msgs_per_subject=max_msgs_per_subject,
                    num_replicas=replicas(js),
                )
            )
            return
        if abs((info.config.duplicate_window or 0.0) - duplicate_window_s) > 0.001:
            # e.g. the events stream of a version that trusted the broker's de-duplication
            await js.update_stream(dataclasses.replace(info.config, duplicate_window=duplicate_window_s))

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
    """Publish an event of ``tenant`` from ``source`` on the logical ``subject`` (its NATS subject
    is ``fleet.events.<tenant>.<source>.<name>...``, see :func:`event_subject`); (its id, whether the
    stream kept it: False for a duplicate within the stream's short window)."""
    message = event_message(
        subject, tenant=tenant, source=source, type_=type_, data=data, event_id=event_id, time=time
    )
    return message.id, await publish_message(client, message)


async def publish_message(client: NATS, message: EventMessage) -> bool:
    """Publish an :class:`EventMessage`; whether the stream kept it."""
    return await publish_raw(client, message.subject, message.payload, headers=message.headers)


async def publish_raw(
    client: NATS,
    subject: str,
    payload: bytes,
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> bool:
    """Publish bytes on the NATS ``subject`` as they are (with ``msg_id`` as the ``Nats-Msg-Id``, if
    given); whether the stream kept them."""
    js = client.jetstream()
    await ensure_event_streams(js)
    sent = dict(headers or {})
    if msg_id is not None:
        sent["Nats-Msg-Id"] = msg_id
    ack = await js.publish(subject, payload, headers=sent or None)
    return not ack.duplicate
