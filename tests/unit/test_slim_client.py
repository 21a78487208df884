"""The slim client speaks the fleet's formats without the fleet's code: the same key ids, client
assertions, event envelopes and error envelopes as the platform's own helpers (checked here against
them). What it may import: tests/test_import_boundaries.py."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import httpx
import jwt
import pytest
from fleet_client import ClientCredentials, FleetClientError, event_envelope
from fleet_client._tokens import key_id

from fleet.errors import ErrorCode, FleetError
from fleet.events import event_message
from fleet.keys import SigningKey


def test_its_key_id_and_assertion_are_the_fleet_s(tmp_path: Path) -> None:
    key = SigningKey.load_or_create(tmp_path / "bot.pem")
    credentials = ClientCredentials(
        "https://registry.example/oauth/token", "billing-bot", tmp_path / "bot.pem"
    )
    assert key_id(key.private_key) == key.kid
    assertion = credentials.assertion()
    assert jwt.get_unverified_header(assertion)["kid"] == key.kid
    claims = jwt.decode(
        assertion, key.private_key.public_key(), algorithms=["ES256"], audience=credentials.token_url
    )
    assert claims["iss"] == claims["sub"] == "billing-bot" and claims["exp"] - claims["iat"] == 60


def test_its_event_envelope_is_the_fleet_s() -> None:
    when = dt.datetime(2026, 12, 4, 9, 30, tzinfo=dt.UTC)
    given = {
        "tenant": "acme",
        "source": "erp",
        "type_": "invoice.late",
        "data": {"n": 1},
        "event_id": "inv-42",
        "time": when,
    }
    ours = event_message("fleet.events.invoices.late", **given)  # type: ignore[arg-type]
    wire, payload, headers = event_envelope("fleet.events.invoices.late", **given)  # type: ignore[arg-type]
    assert (wire, payload, headers) == (ours.subject, ours.payload, ours.headers)
    with pytest.raises(FleetClientError) as caught:
        event_envelope("fleet.events.x", tenant="acme corp", source="erp", type_="t", data={})
    assert caught.value.code == "invalid_request"


@pytest.mark.parametrize("code", list(ErrorCode))
def test_it_reads_every_error_the_fleet_answers_with_its_code_and_retryability(code: ErrorCode) -> None:
    error = FleetError(
        code, "refused for a reason", retryable=code == ErrorCode.RATE_LIMITED, details={"k": 1}
    )
    request = httpx.Request("GET", "https://coordinator.example/v1/runs/r")
    response = httpx.Response(error.http_status, json=error.problem(), request=request)
    read = FleetClientError.from_response(response)
    assert (read.code, read.retryable, read.message, read.details) == (
        str(code),
        error.retryable,
        error.message,
        {"k": 1},
    )


def test_an_answer_that_is_not_the_fleet_s_reads_by_its_status() -> None:
    request = httpx.Request("GET", "https://coordinator.example/v1/runs/r")
    assert (
        FleetClientError.from_response(httpx.Response(404, text="nope", request=request)).code == "not_found"
    )
    assert (
        FleetClientError.from_response(httpx.Response(502, text="<html>", request=request)).code
        == "dependency_unavailable"
    )
