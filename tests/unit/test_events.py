"""The event envelope and trigger templates: what is accepted, what is refused and why."""

from __future__ import annotations

import json

import pytest

from coordinator.triggers import fill_template
from fleet.events import MAX_EVENT_BYTES, EventError, parse_event

SUBJECT = "fleet.events.invoices.closed"


def _raw(**fields: object) -> bytes:
    body = {"id": "e-1", "source": "erp", "type": "invoices.closed", "tenant": "acme", "data": {"n": 3}}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def test_a_valid_envelope_parses_and_its_run_id_is_stable_per_tenant_source_and_id() -> None:
    event = parse_event(SUBJECT, _raw())
    assert (event.id, event.tenant, event.data) == ("e-1", "acme", {"n": 3})
    assert event.run_id() == parse_event(SUBJECT, _raw(data={"other": 1})).run_id()
    assert event.run_id() != parse_event(SUBJECT, _raw(tenant="globex")).run_id()
    assert event.run_id() != parse_event(SUBJECT, _raw(source="crm")).run_id()


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (_raw(tenant=None), "'tenant'"),
        (_raw(id=""), "'id'"),
        (_raw(id="has spaces in it"), "id:"),
        (_raw(data=[1]), "data must be an object"),
        (b"{" + b" " * MAX_EVENT_BYTES + b"}", "larger than"),
    ],
)
def test_a_malformed_event_is_refused_with_the_reason(payload: bytes, says: str) -> None:
    with pytest.raises(EventError) as refused:
        parse_event(SUBJECT, payload)
    assert says in refused.value.message
    assert refused.value.code == "invalid_request"


def test_templates_take_event_fields_and_refuse_missing_ones() -> None:
    event = parse_event(SUBJECT, _raw(data={"night": "2026-11-28", "lines": [1, 2]}))
    template = [
        {"id": "a", "skill": "s", "input": {"night": {"$event": "data.night"}, "who": {"$event": "tenant"}}}
    ]
    assert fill_template(template, event)[0]["input"] == {"night": "2026-11-28", "who": "acme"}
    with pytest.raises(EventError, match=r"data\.missing"):
        fill_template({"x": {"$event": "data.missing"}}, event)
