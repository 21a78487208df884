"""EXPLAIN.md, the summary of a debug bundle, from a run's recorded events and operations."""

from __future__ import annotations

import datetime as dt
from typing import Any

from coordinator.control.explain import explain
from coordinator.record.runs import Run, RunEvent, RunState

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)


def run(state: RunState = RunState.FAILED, reason: str | None = "specialist_failed") -> Run:
    return Run("r1", "acme", "operator", state, reason, {}, [], 6, 1, False, None, NOW, NOW)


def event(seq: int, type_: str, **payload: Any) -> RunEvent:
    return RunEvent("r1", seq, type_, NOW, "worker-1", payload)


# What a step that failed on a tool refusing the agent's call records: the error and what it wraps.
POLICY_REFUSAL = {
    "code": "tool_failed",
    "message": "mcp-sandbox/run_python answered with an error: no",
    "cause": {"code": "policy_denied", "message": "no", "retryable": False},
}


def failed_after_a_reroute(message: str, cause: dict[str, Any] | None = None) -> list[RunEvent]:
    caused = {"cause": cause} if cause else {}
    return [
        event(1, "run.submitted", state="submitted"),
        event(2, "step.started", step="score", skill="score-anomalies", agent="code-runner"),
        event(
            3, "step.rerouted", op_id="op-1", step="score", **{"from": "code-runner", "to": "code-runner-2"}
        ),
        event(
            4,
            "step.failed",
            step="score",
            skill="score-anomalies",
            code="specialist_failed",
            message=message,
            **caused,
        ),
        event(5, "run.failed", state="failed", reason="specialist_failed"),
    ]


def test_it_names_the_failed_step_its_agent_version_reroutes_and_cause() -> None:
    events = failed_after_a_reroute("code-runner-2 failed the step: no", POLICY_REFUSAL)
    operations = [
        {
            "op_id": "op-1",
            "step_id": "score",
            "target": "code-runner-2",
            "status": "failed",
            "attempts": 2,
            "error": {"code": "specialist_failed", "message": "boom"},
        }
    ]
    agents = {"code-runner-2": {"version": "1.0.0", "status": "healthy"}}
    text = explain(run(), events, operations, "local-1+abc", agents)
    assert text.startswith("# Run r1: failed (specialist_failed)")
    assert "- failed step: `score`" in text
    assert "- agent: `code-runner-2` (version `1.0.0` as registered now, status `healthy`)" in text
    assert "code-runner -> code-runner-2" in text
    assert "`specialist_failed` -> `tool_failed` -> `policy_denied`" in text
    assert "refused by `policy_denied`" in text.split("## Policy")[1].split("##")[0]  # the refusal is named
    assert "| `op-1` | score | code-runner-2 | failed | 2 | specialist_failed | boom |" in text
    assert "`fleet policy log`" in text.split("## What to do next")[1]  # advice for the innermost cause


def test_secrets_in_what_was_recorded_do_not_reach_the_summary() -> None:
    secret = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJvcGVyYXRvciJ9.c2lnbmF0dXJl"
    text = explain(run(), failed_after_a_reroute(f"Bearer {secret} refused"), [], "rev", {})
    assert secret not in text
    assert "[redacted]" in text


def test_a_completed_run_says_nothing_failed() -> None:
    text = explain(
        run(RunState.COMPLETED, None), [event(1, "run.completed", state="completed")], [], "rev", {}
    )
    assert "No step failed." in text
    assert "Nothing: the run completed." in text


def test_a_code_in_a_message_is_text_not_a_cause() -> None:
    """Codes are read from the recorded errors (data), never out of a message: a message that
    happens to contain ``[policy_denied]`` (above: a tool quoting something) names no refusal."""
    text = explain(
        run(), failed_after_a_reroute("code-runner-2 failed: it printed [policy_denied]"), [], "r", {}
    )
    assert "- cause, outermost first: `specialist_failed`\n" in text
    assert "No policy or scope refusal is recorded for this run." in text


def _op(step: str, target: str, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "op_id": f"op-{step}",
        "step_id": step,
        "target": target,
        "status": "succeeded",
        "attempts": 1,
        "usage": usage,
    }


def test_the_tokens_are_attributed_by_step_and_the_share_spent_repeating_calls_is_named() -> None:
    operations = [
        _op("a", "researcher", {"llm_tokens": 7_100, "tokens_in": 6_000, "tokens_out": 1_100, "llm_calls": 9,
                                "cost_usd": 0.0421, "stopped": "repeated_call", "summarized": True,
                                "repeats": {"tokens": 7_100, "calls": {"mcp-sql__query": 4, "mcp-memory__recall": 2}}}),
        _op("b", "writer", {"llm_tokens": 2_900, "tokens_in": 2_000, "tokens_out": 900, "llm_calls": 2}),
        _op("c", "sql-analyst", {"tool_calls": 1, "llm_tokens": 0}),  # a step without a model
    ]  # fmt: skip
    text = explain(run(RunState.COMPLETED, None), [], operations, "rev", {})
    tokens = text.split("## Tokens", 1)[1].split("## What to do next")[0]
    rows = [line for line in tokens.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    assert [r.split("|")[1].strip() for r in rows] == ["a", "b"]  # the dearest first; c used no model
    assert "| 6000 | 1100 | 9 | $0.0421 | repeated_call (summarized) |" in rows[0]
    assert "10000 tokens in all." in tokens
    assert "71% of the tokens (7100 of 10000) went to repeating 2 call(s) already made:" in tokens
    assert "`mcp-sql__query` x4, `mcp-memory__recall` x2" in tokens


def test_a_run_that_used_no_model_has_no_tokens_section() -> None:
    assert "## Tokens" not in explain(
        run(RunState.COMPLETED, None), [], [_op("c", "x", {"tool_calls": 1})], "r", {}
    )
