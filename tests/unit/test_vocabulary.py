"""The run's vocabulary (``fleet.vocabulary``): one list of event types and signal actions, which the
code uses and the Rego bundles read from data generated from it."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from fleet.vocabulary import ENDING, PAYLOADS, EventType, SignalAction, payload_problems, policy_data
from policy import DEFAULT_BUNDLE_DIR, Bundle, RegorusEngine
from policy.vocabulary import DATA_FILE, render

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fleet", "fleetctl", "coordinator", "specialists", "mcp_servers", "registry", "memory", "policy")


def test_the_policy_data_file_is_the_one_the_code_generates() -> None:
    """``python -m policy.vocabulary`` regenerates it after a change to the vocabulary."""
    assert DATA_FILE.read_text() == render()
    assert json.loads(DATA_FILE.read_text())["signal_actions"] == [a.value for a in SignalAction]


def test_the_approvals_policy_knows_exactly_the_code_s_signal_actions() -> None:
    engine = RegorusEngine(Bundle.load())
    assert set(engine.evaluate("fleet.approvals.actions", {})) == set(SignalAction)
    refused = engine.decide_now("fleet.approvals.decision", _signal("pause"), log_decision=False)
    assert not refused.allow and "unknown action pause" in refused.reasons


def test_the_approvals_policy_reads_its_actions_from_the_data(tmp_path: Path) -> None:
    """An action added to the vocabulary reaches policy through the data file alone."""
    bundle = tmp_path / "fleet"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    data = policy_data()
    data["signal_actions"].append("pause")
    (bundle / "vocabulary" / "data.json").write_text(json.dumps(data))
    engine = RegorusEngine(Bundle.load(bundle))
    assert "pause" in engine.evaluate("fleet.approvals.actions", {})
    decision = engine.decide_now("fleet.approvals.decision", _signal("pause"), log_decision=False)
    assert "unknown action pause" not in decision.reasons


def test_run_events_are_named_by_the_vocabulary_not_by_strings_in_the_code() -> None:
    """No module but the vocabulary writes an event type as a string: a typo in one would be an
    event nobody follows (the demo once waited for ``run.expired``, which no run records)."""
    names = {e.value for e in EventType if "." in e.value}  # "artifact" is also a plain word
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "fleet" / "vocabulary.py"
        for node in _code_strings(path)
        if node.value in names
    ]
    assert found == []


def test_the_events_that_end_a_run_are_the_terminal_states() -> None:
    assert {e.value for e in ENDING} == {"run.completed", "run.failed", "run.canceled", "run.rejected"}
    assert EventType.of_state("rejected") is EventType.RUN_REJECTED
    assert EventType.of_operation("needs_human") is EventType.OPERATION_NEEDS_HUMAN


def _signal(action: str) -> dict[str, object]:
    return {
        "action": action,
        "tenant": "acme",
        "signer": {"sub": "operator", "tenant": "acme", "scopes": ["runs:approve"]},
        "run": {"owner": "someone"},
        "wait": {"type": "approval", "skill": "issue-refund"},
    }


def _code_strings(path: Path) -> list[ast.Constant]:
    """The string constants of ``path`` that are code: not docstrings, not parts of f-strings."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in ast.walk(node))
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            skip.add(id(body[0].value))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    ]


def test_the_payload_types_say_what_is_wrong_and_let_through_what_is_right() -> None:
    failed = {"step": "s1", "skill": "sql-query", "code": "tool_failed", "message": "no"}
    assert (
        payload_problems(EventType.STEP_FAILED, {**failed, "cause": {"code": "sql_refused"}, "more": 1}) == []
    )
    assert payload_problems("step.failed", {**failed, "code": 3}) == ["code: Input should be a valid string"]
    assert payload_problems("step.failed", {"step": "s1"}) == [
        "skill: Field required",
        "code: Field required",
        "message: Field required",
    ]
    ended = {"state": "failed", "reason": "tool_failed", "failure": {**failed, "message": None}}
    assert payload_problems(EventType.RUN_FAILED, ended) == [
        "failure.message: Input should be a valid string"
    ]
    assert payload_problems("wait.expired", {"anything": "goes"}) == []  # no type declared for it
    assert set(PAYLOADS) <= set(EventType) and set(PAYLOADS) >= ENDING
