"""What the coordinator concludes from how a call to an agent failed, from a budget decision and from
the activity policy: pure rules, checked without a stack."""

from __future__ import annotations

import httpx
import pytest
from a2a.client import A2AClientError, A2AClientTimeoutError

from coordinator.control.run_api import budget_decision
from coordinator.engine.delegation import _fate_open
from coordinator.engine.dispatch import ActivityClock
from fleet.errors import FleetError


def _caused(cause: BaseException, message: str = "failed") -> A2AClientError:
    error = A2AClientError(message)
    error.__cause__ = cause
    return error


def _status(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://agent/")
    return httpx.HTTPStatusError("status", request=request, response=httpx.Response(code, request=request))


@pytest.mark.parametrize(
    ("error", "open_"),
    [
        (_caused(httpx.ReadError("cut")), True),  # sent, answer lost
        (_caused(httpx.RemoteProtocolError("closed mid-stream")), True),
        (A2AClientTimeoutError("timed out"), True),
        (_caused(_status(500)), True),  # a server error may come after the work was done
        (_caused(_status(503)), True),
        (_caused(ValueError("bad JSON")), True),  # an answer nobody can read
        (A2AClientError("SSE stream error event received: boom"), True),
        (A2AClientError("JSON-RPC Error -32603: internal error"), True),  # it may have acted first
        (_caused(_status(400)), False),  # refused: nothing was done
        (_caused(_status(401)), False),
        (_caused(_status(404)), False),
        (A2AClientError("JSON-RPC Error -32602: invalid params"), False),
    ],
)
def test_a_call_whose_fate_is_open_is_reconciled_and_a_refusal_is_a_failure(
    error: A2AClientError, open_: bool
) -> None:
    assert _fate_open(error) is open_


def test_a_budget_decision_is_a_tranche_or_a_close_with_limits_only_for_a_tranche() -> None:
    assert budget_decision({"decision": "close"}) == {"decision": "close", "note": ""}
    granted = budget_decision({"decision": "tranche", "note": "go", "limits": {"max_steps": 5}})
    assert granted == {"decision": "tranche", "note": "go", "limits": {"max_steps": 5}}
    for bad in (
        {},
        {"decision": "approve"},
        {"decision": "close", "limits": {"max_steps": 5}},
        {"decision": "tranche", "limits": {"max_steps": -1}},
        {"decision": "tranche", "limits": {"max_steps": True}},
        {"decision": "tranche", "limits": {"on_exhausted": "tranche"}},
        {"decision": "tranche", "note": 3},
    ):
        with pytest.raises(FleetError) as refused:
            budget_decision(bad)
        assert refused.value.code == "invalid_request"


def test_the_activity_clock_comes_from_the_budget_policy_with_safe_defaults() -> None:
    assert ActivityClock.of(None) == ActivityClock()
    policy = {"limits": {"activity": {"quiet_after_s": 5, "max_renewals": 2, "on_stuck": "ask"}}}
    assert ActivityClock.of(policy) == ActivityClock(quiet_after_s=5.0, max_renewals=2, on_stuck="ask")
