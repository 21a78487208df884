"""What the ledger records for an operation of a canceled run, from what its agent answered to the
cancel (``coordinator.engine.dispatch.settle_pending``; the end-to-end tests cover the round trip)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.engine.dispatch import _settled
from coordinator.record.operations import OpStatus


def canceled(n: int, message: str | None = None) -> dict[str, Any]:
    text = message or f"canceled after {n} tool calls completed"
    return {"status": "canceled", "error": {"code": "canceled", "message": text, "tool_calls": n}}


def test_an_operation_that_ended_before_the_cancel_is_recorded_as_it_ended() -> None:
    assert _settled("desk", {"status": "succeeded", "result": {"n": 1}}) == (
        OpStatus.SUCCEEDED,
        {"n": 1},
        None,
    )
    failed = {"code": "tool_failed", "message": "no"}
    assert _settled("desk", {"status": "failed", "error": failed}) == (OpStatus.FAILED, None, failed)


@pytest.mark.parametrize("n", [0, 3])
def test_a_canceled_operation_fails_with_code_canceled_and_the_count_of_its_tool_calls(n: int) -> None:
    answer = canceled(n)
    assert _settled("desk", answer) == (OpStatus.FAILED, None, answer["error"])


def test_an_operation_canceled_before_it_arrived_fails_with_no_effect() -> None:
    answer = canceled(0, "canceled before it was received; it will not run")
    status, _, error = _settled("desk", answer)
    assert (status, error) == (OpStatus.FAILED, answer["error"])


@pytest.mark.parametrize("state", ["running", "interrupted", "uncertain", "unknown"])
def test_an_operation_whose_effects_nobody_can_vouch_for_goes_to_a_person(state: str) -> None:
    status, result, error = _settled("desk", {"status": state, "error": {"message": "why"}})
    assert (status, result) == (OpStatus.NEEDS_HUMAN, None)
    assert error == {
        "code": "outcome_unknown",
        "message": f"{state} at desk when the run was canceled: why",
        "retryable": False,
    }
