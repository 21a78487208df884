"""Signals as they are parsed, before any run sees them: every malformed one is refused with
``invalid_request`` and a reason; a follow-up message's text or data reads as the signal a person
means."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.a2a_surface.executor import signal_of_message
from coordinator.control.signals import parse_signal
from coordinator.engine.graph import gate_of
from fleet.errors import ErrorCode, FleetError


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([], "a JSON object"),
        ({"action": "delete"}, "action must be one of"),
        ({"action": "approve", "awaited": ""}, "awaited"),
        ({"action": "approve", "note": 7}, "note"),
        ({"action": "approve", "note": "x" * 2001}, "note"),
        ({"action": "approve", "input": [1]}, "input must be a JSON object"),
        ({"action": "input"}, "needs input"),
        ({"action": "reject", "input": {"a": 1}}, "input goes with approve or input"),
        ({"action": "extend"}, "extend needs extend_s"),
        ({"action": "extend", "extend_s": True}, "extend needs extend_s"),
        ({"action": "extend", "extend_s": 0}, "extend needs extend_s"),
        ({"action": "extend", "extend_s": 10**9}, "extend needs extend_s"),
        ({"action": "approve", "extend_s": 5}, "extend_s goes with extend"),
        ({"action": "approve", "id": "has space"}, "id:"),
    ],
)
def test_a_malformed_signal_is_refused_with_its_reason(body: Any, says: str) -> None:
    with pytest.raises(FleetError) as raised:
        parse_signal("run-1", body, "api")
    assert raised.value.code == ErrorCode.INVALID_REQUEST
    assert says in raised.value.message


def test_a_signal_keeps_what_it_says_and_gets_an_id() -> None:
    signal = parse_signal("run-1", {"action": "approve", "input": {"k": 1}, "note": "ok"}, "nats", "sig-1")
    assert (signal.action, signal.input, signal.note, signal.signal_id, signal.via) == (
        "approve",
        {"k": 1},
        "ok",
        "sig-1",
        "nats",
    )
    assert parse_signal("run-1", {"action": "extend", "extend_s": 60}, "api").extend_s == 60.0
    assert parse_signal("run-1", {"action": "cancel"}, "api").signal_id  # a fresh id


@pytest.mark.parametrize(
    ("texts", "data", "action", "given"),
    [
        (["approve"], [], "approve", None),
        (["Yes."], [], "approve", None),
        (["no"], [], "reject", None),
        (["use channel #ops"], [], "input", {"text": "use channel #ops"}),
        ([], [{"channel": "ops"}], "input", {"channel": "ops"}),
        ([], [{"action": "reject", "note": "not owed"}], "reject", None),
    ],
)
def test_a_follow_up_message_reads_as_the_signal_a_person_means(
    texts: list[str], data: list[Any], action: str, given: dict[str, Any] | None
) -> None:
    signal = signal_of_message("task-1", texts, data)
    assert (signal.action, signal.input, signal.via) == (action, given, "a2a")


def test_a_follow_up_message_id_is_the_signal_id_so_a_resent_message_is_one_signal() -> None:
    first = signal_of_message("task-1", ["approve"], [], "m-1")
    again = signal_of_message("task-1", ["approve"], [], "m-1")
    assert first.signal_id == again.signal_id == "a2a:m-1"


def test_an_empty_follow_up_is_refused() -> None:
    with pytest.raises(FleetError) as raised:
        signal_of_message("task-1", ["  "], [])
    assert raised.value.code == ErrorCode.INVALID_REQUEST


@pytest.mark.parametrize(
    ("result", "kind"),
    [
        ({"status": "pending_approval", "why": "over the limit"}, "approval"),
        ({"user_input_required": True, "question": "which channel?"}, "input"),
        ({"status": "input_required", "question": "which channel?"}, "input"),
        ({"status": "auth_required"}, "input"),
        ({"status": "refunded"}, None),
        ({"user_input_required": "yes"}, None),
        ([], None),
    ],
)
def test_a_result_asks_a_person_only_in_the_forms_the_gate_knows(result: Any, kind: str | None) -> None:
    gate = gate_of(result)
    assert (gate["type"] if gate else None) == kind
    if gate is not None:
        assert gate["why"]


def test_a_gate_lifts_the_reason_out_of_the_result_and_keeps_the_rest() -> None:
    asking = {"status": "pending_approval", "why": "over the limit", "amount_cents": 20_000}
    assert gate_of(asking) == {"type": "approval", "why": "over the limit", "asked": {"amount_cents": 20_000}}
    asking = {"user_input_required": True, "question": "which channel?", "options": ["a", "b"]}
    assert gate_of(asking) == {"type": "input", "why": "which channel?", "asked": {"options": ["a", "b"]}}
    assert gate_of({"status": "auth_required"}) == {
        "type": "input",
        "why": "the step needs input",
        "asked": {},
    }
