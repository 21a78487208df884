"""What an approval grant is bound to, and the facts a gate goes by: computed from the run's own
record, never from a step's input."""

from __future__ import annotations

from typing import Any

from coordinator.engine.graph import GraphState, computed_facts, facts_for
from coordinator.planning.plan import UNTRUSTED
from fleet.approvals import ApprovalRequest, args_sha256

REPORT = "artifact:sha256:" + "a" * 64
OTHER = "artifact:sha256:" + "b" * 64


def state(steps: list[dict[str, Any]], results: dict[str, Any]) -> GraphState:
    return GraphState(run_id="r", tenant="acme", steps=steps, results=results)


def test_the_argument_hash_is_canonical_and_leaves_the_grant_out() -> None:
    one = {"b": 1, "a": {"y": [1, 2], "x": "é"}}
    assert args_sha256(one) == args_sha256({"a": {"x": "é", "y": [1, 2]}, "b": 1})
    assert args_sha256({**one, "approval_grant": "eyJ..."}) == args_sha256(one)
    assert args_sha256({**one, "b": 2}) != args_sha256(one)
    # A2A carries numbers as doubles: a whole number is the same argument either way.
    assert args_sha256({"amount_cents": 25000.0, "n": [1.0]}) == args_sha256(
        {"amount_cents": 25000, "n": [1]}
    )
    assert args_sha256({"amount_cents": 25000.5}) != args_sha256({"amount_cents": 25000})


def test_an_approval_request_is_hashed_from_its_arguments_not_from_what_it_claims() -> None:
    asked = {
        "server": "mcp-cases",
        "tool": "issue_refund",
        "arguments": {"amount_cents": 5},
        "args_sha256": "0" * 64,
    }
    request = ApprovalRequest.of(asked)
    assert request is not None and request.args_sha256 == args_sha256({"amount_cents": 5})
    assert ApprovalRequest.of({"server": "s", "tool": "t", "arguments": {"approval_grant": "x"}}) is None
    assert ApprovalRequest.of({"server": "s", "arguments": {}}) is None
    assert ApprovalRequest.of("pending") is None


def test_the_score_of_a_report_comes_from_the_scoring_step_that_made_it() -> None:
    steps = [
        {"id": "score", "skill": "score-anomalies", "input": {}},
        {"id": "publish", "skill": "publish-report", "input": {"anomaly_score": 0, "report": REPORT}},
    ]
    facts = computed_facts(state(steps, {"score": {"report_artifact": REPORT, "max_score": 9.1}}))
    assert facts == {"report_scores": {REPORT: 9.1}}
    publish = ApprovalRequest("mcp-outbox", "publish_artifact", {"artifact": REPORT, "name": "n"})
    assert facts_for(publish, facts) == {"anomaly_score": 9.1}
    # A report no scoring step of the run made has no computed score, whatever anything states.
    other = ApprovalRequest("mcp-outbox", "publish_artifact", {"artifact": OTHER, "anomaly_score": 0})
    assert facts_for(other, facts) == {}


def test_a_score_from_another_skill_or_an_untrusted_answer_is_no_computed_fact() -> None:
    steps = [
        {"id": "fake", "skill": "run-python", "input": {}},
        {"id": "outside", "skill": "score-anomalies", "input": {}},
    ]
    results = {
        "fake": {"report_artifact": REPORT, "max_score": 0.0},
        "outside": {"report_artifact": REPORT, "max_score": 0.0, UNTRUSTED: "partner"},
    }
    assert computed_facts(state(steps, results)) == {}
