"""The event's subject, envelope and binary mode, and trigger templates: what is accepted, what is
refused and why. The tenant and source are always the subject's."""

from __future__ import annotations

import json

import pytest

from coordinator.control.triggers import batch_item_key, fill_template
from coordinator.planning.plan import PlanError, parse_steps
from fleet.events import (
    MAX_EVENT_BYTES,
    EventError,
    event_message,
    event_subject,
    message_id,
    parse_event,
    split_subject,
)

SUBJECT = "fleet.events.acme.erp.invoices.closed"


def _raw(**fields: object) -> bytes:
    body = {"id": "e-1", "source": "erp", "type": "invoices.closed", "tenant": "acme", "data": {"n": 3}}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def _binary(**headers: str) -> dict[str, str]:
    base = {"ce-specversion": "1.0", "ce-id": "e-1", "ce-source": "erp", "ce-type": "invoices.closed"}
    base.update(headers)
    return {k: v for k, v in base.items() if v}


def test_the_tenant_and_source_come_from_the_subject_and_rules_see_the_logical_subject() -> None:
    event = parse_event(SUBJECT, _raw(tenant=None, source=None))
    assert (event.tenant, event.source, event.subject) == ("acme", "erp", "fleet.events.invoices.closed")
    assert (event.id, event.data) == ("e-1", {"n": 3})
    assert event.nats_subject() == SUBJECT
    assert split_subject("fleet.events.t-1.src_2.a.b.c") == ("t-1", "src_2", "fleet.events.a.b.c")


def test_the_run_id_is_stable_per_tenant_source_and_id() -> None:
    event = parse_event(SUBJECT, _raw())
    assert event.run_id() == parse_event(SUBJECT, _raw(data={"other": 1})).run_id()
    other_tenant = parse_event("fleet.events.globex.erp.invoices.closed", _raw(tenant=None))
    other_source = parse_event("fleet.events.acme.crm.invoices.closed", _raw(source=None))
    assert len({event.run_id(), other_tenant.run_id(), other_source.run_id()}) == 3
    assert len({batch_item_key(event), batch_item_key(other_source)}) == 2


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tenant": "globex"}, "names tenant 'globex' but its subject's tenant is 'acme'"),
        ({"source": "crm"}, "names source 'crm' but its subject's source is 'erp'"),
        ({"tenant": ["acme"]}, "names tenant"),
    ],
)
def test_an_envelope_claiming_another_tenant_or_source_than_its_subject_is_refused(
    fields: dict[str, object], says: str
) -> None:
    with pytest.raises(EventError) as refused:
        parse_event(SUBJECT, _raw(**fields))
    assert says in refused.value.message


@pytest.mark.parametrize(
    "subject",
    [
        "fleet.events.invoices.closed",  # the old layout: no name token after tenant and source
        "fleet.events.acme.erp",
        "fleet.events.acme.erp.",
        f"fleet.events.{'t' * 65}.erp.invoices.closed",
        "fleet.events.ac me.erp.x",
        "other.events.acme.erp.x",
    ],
)
def test_a_subject_without_tenant_source_and_name_is_refused(subject: str) -> None:
    with pytest.raises(EventError, match=r"fleet\.events\.<tenant>\.<source>\.<name>"):
        parse_event(subject, _raw())


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (_raw(id=""), "'id'"),
        (_raw(type=None), "'type'"),
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


def test_a_binary_mode_event_takes_its_attributes_from_headers_and_its_data_from_the_payload() -> None:
    headers = _binary(**{"ce-time": "2026-11-29T02:00:00+00:00", "content-type": "application/json"})
    event = parse_event(SUBJECT, b'{"invoice": "INV-7"}', headers)
    assert (event.id, event.type, event.time) == ("e-1", "invoices.closed", "2026-11-29T02:00:00+00:00")
    assert (event.tenant, event.source, event.data) == ("acme", "erp", {"invoice": "INV-7"})
    # Header names are case-insensitive, and a body-less event has empty data.
    shouted = {key.upper(): value for key, value in _binary(**{"ce-source": ""}).items()}
    assert parse_event(SUBJECT, b"", shouted).data == {}


@pytest.mark.parametrize(
    ("headers", "payload", "says"),
    [
        (_binary(**{"ce-source": "crm"}), b"{}", "names source 'crm'"),
        (_binary(**{"ce-tenant": "globex"}), b"{}", "names tenant 'globex'"),
        (_binary(**{"ce-specversion": "0.3"}), b"{}", "ce-specversion"),
        (_binary(**{"ce-id": ""}), b"{}", "'id'"),
        (_binary(**{"ce-type": ""}), b"{}", "'type'"),
        (_binary(**{"content-type": "text/plain"}), b"{}", "must be JSON"),
        (_binary(), b"[1]", "data must be an object"),
        (_binary(), b"nope", "not JSON"),
    ],
)
def test_a_bad_binary_mode_event_is_refused_with_the_reason(
    headers: dict[str, str], payload: bytes, says: str
) -> None:
    with pytest.raises(EventError) as refused:
        parse_event(SUBJECT, payload, headers)
    assert says in refused.value.message


def test_the_fleets_messages_go_on_the_tenant_and_source_subject_with_a_key_of_all_three() -> None:
    message = event_message(
        "fleet.events.invoices.closed", tenant="acme", source="erp", type_="t", data={}, event_id="e-1"
    )
    assert message.subject == SUBJECT
    assert (
        message.headers
        == {"Nats-Msg-Id": message_id("acme", "erp", "e-1")}
        == {"Nats-Msg-Id": "acme/erp/e-1"}
    )
    parsed = parse_event(message.subject, message.payload, message.headers)
    assert (parsed.tenant, parsed.source, parsed.id) == ("acme", "erp", "e-1")
    for bad in (
        {"subject": "fleet.events.a.*", "tenant": "acme", "source": "erp"},
        {"subject": "fleet.events.x", "tenant": "ac.me", "source": "erp"},
        {"subject": "fleet.events.x", "tenant": "acme", "source": ""},
    ):
        with pytest.raises(EventError):
            event_subject(bad["subject"], tenant=bad["tenant"], source=bad["source"])


def test_an_event_wait_may_name_a_source_token() -> None:
    (step,) = parse_steps([{"id": "g", "wait": {"event": "fleet.events.po.approved", "source": "erp"}}])
    assert step.wait == {"event": "fleet.events.po.approved", "source": "erp"}
    with pytest.raises(PlanError, match=r"wait\.source"):
        parse_steps([{"id": "g", "wait": {"event": "fleet.events.po.approved", "source": "e.rp"}}])


def test_templates_take_event_fields_and_refuse_missing_ones() -> None:
    event = parse_event(SUBJECT, _raw(data={"night": "2026-11-28", "lines": [1, 2]}))
    template = [
        {"id": "a", "skill": "s", "input": {"night": {"$event": "data.night"}, "who": {"$event": "tenant"}}}
    ]
    assert fill_template(template, event)[0]["input"] == {"night": "2026-11-28", "who": "acme"}
    with pytest.raises(EventError, match=r"data\.missing"):
        fill_template({"x": {"$event": "data.missing"}}, event)
