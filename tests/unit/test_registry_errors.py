"""Which answers of the registry are a failover to wait out, and which keep their own error code."""

from __future__ import annotations

import httpx
import pytest

from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.tokens import _token_error
from registry.client import _raise_for


def answer(status: int, body: object | None = None, text: str = "") -> httpx.Response:
    if body is not None:
        return httpx.Response(status, json=body)
    return httpx.Response(status, text=text)


def error(code: str, message: str = "m") -> dict[str, object]:
    return {"error": {"code": code, "message": message}}


@pytest.mark.parametrize(
    "response",
    [
        answer(503, error("dependency_unavailable", "the registry's store (NATS) did not answer")),
        answer(502, text="<html>bad gateway</html>"),  # a proxy in front of the registry
        answer(504, text=""),
    ],
)
def test_the_registry_or_its_proxy_failing_over_is_waited_out(response: httpx.Response) -> None:
    with pytest.raises(DependencyUnavailable):
        _raise_for(response, "discovery failed")


@pytest.mark.parametrize(
    ("response", "code"),
    [
        (answer(503, error("policy_unavailable")), ErrorCode.POLICY_UNAVAILABLE),  # fails closed
        (answer(500, error("internal")), ErrorCode.INTERNAL),
        (answer(404, error("not_found")), ErrorCode.NOT_FOUND),
        (answer(404, text="<html>no</html>"), ErrorCode.NOT_FOUND),  # not its answer: read from the status
    ],
)
def test_any_other_refusal_keeps_its_code_and_is_not_waited_for(
    response: httpx.Response, code: ErrorCode
) -> None:
    with pytest.raises(FleetError) as raised:
        _raise_for(response, "discovery failed")
    assert not isinstance(raised.value, DependencyUnavailable)
    assert raised.value.code is code


def test_a_token_service_that_cannot_evaluate_its_policy_is_not_a_failover() -> None:
    oauth = {"error": "temporarily_unavailable", "error_description": "token policy unavailable"}
    assert not isinstance(_token_error(answer(503, oauth)), DependencyUnavailable)
    assert not isinstance(_token_error(answer(500, error("internal"))), DependencyUnavailable)
    assert isinstance(_token_error(answer(503, error("dependency_unavailable"))), DependencyUnavailable)
    assert isinstance(_token_error(answer(502, text="bad gateway")), DependencyUnavailable)
