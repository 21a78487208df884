"""The worked examples of docs/policy.md, applied to a copy of the bundle as an author would: each
edit plus its test must pass with the rest of the bundle's tests (so the guide stays true)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from policy import DEFAULT_BUNDLE_DIR, run_tests

HEADER = "package fleet.example_test\n\nimport data.fleet.memory\nimport data.fleet.routing\nimport data.fleet.tools\n\n"


def no_pii_in_procedural(config: dict[str, Any]) -> None:
    config["memory"]["tenants"] = {"acme": {"deny_pii_in": ["procedural"]}}


def approval_above_an_amount(config: dict[str, Any]) -> None:
    config["tools"]["mcp-outbox"]["post_webhook"]["approval_over_cents"] = 100000


def finance_to_the_analyst(config: dict[str, Any]) -> None:
    config["routing"].insert(
        0, {"keywords": ["finance"], "steps": [{"id": "totals", "skill": "invoice-totals"}]}
    )


def cap_runs(config: dict[str, Any]) -> None:
    config["run_call_limits"] = {"default": None, "tenants": {"acme": 25}}


EXAMPLES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "pii": (
        no_pii_in_procedural,
        """
test_acme_keeps_pii_out_of_procedural_memory if {
	call := {"tenant": "acme", "agent": "research", "tier": "procedural", "source": {"trust": "trusted"},
		"provenance": {"support_runs": 5}, "findings": [{"type": "EMAIL_ADDRESS", "score": 1}]}
	memory.decision.action == "deny" with input as call
}
""",
    ),
    "approval": (
        approval_above_an_amount,
        """
test_a_large_webhook_needs_approval if {
	call := {"server": "mcp-outbox", "tool": "post_webhook", "tenant": "acme", "subject": "publisher",
		"scopes": ["outbox:write"], "arguments": {"destination": "ops", "amount_cents": 250000}}
	d := tools.decision with input as call
	d.allow
	d.approval_required
	small := tools.decision with input as object.union(call, {"arguments": {"destination": "ops", "amount_cents": 900}})
	not small.approval_required
}
""",
    ),
    "routing": (
        finance_to_the_analyst,
        """
test_finance_goes_to_the_analyst if {
	d := routing.decision with input as {"text": "finance summary for March", "tenant": "acme"}
	d.steps[0].skill == "invoice-totals"
}
""",
    ),
    "cap": (
        cap_runs,
        """
test_acme_runs_are_capped_at_25_tool_calls if {
	call := {"server": "mcp-sql", "tool": "query", "tenant": "acme", "subject": "a", "scopes": ["sql:query"],
		"arguments": {"sql_length": 10}}
	d := tools.decision with input as call
	d.run_call_limit == 25
}
""",
    ),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_worked_example_of_the_guide_passes_with_the_bundle(tmp_path: Path, name: str) -> None:
    edit, test = EXAMPLES[name]
    root = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, root)
    data = json.loads((root / "data.json").read_text())
    edit(data["config"])
    (root / "data.json").write_text(json.dumps(data))
    (root / "example_test.rego").write_text(HEADER + test)
    results = run_tests(root)
    failing = [(r.name, r.outcome, r.detail) for r in results if r.outcome != "pass"]
    assert failing == []
    assert any(r.package == "fleet.example_test" for r in results)
