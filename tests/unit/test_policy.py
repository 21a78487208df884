"""The embedded Rego engine over the project's bundle."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from policy import DEFAULT_BUNDLE_DIR, Bundle, PolicyError, RegorusEngine, run_tests

RESULTS = run_tests()


@pytest.mark.parametrize("result", RESULTS, ids=[f"{r.package}.{r.name}" for r in RESULTS])
def test_bundle_rego_unit_test_passes(result: object) -> None:
    assert getattr(result, "outcome", None) == "pass", result


def test_bundle_has_rego_tests_for_every_package() -> None:
    assert {r.package for r in RESULTS} >= {"fleet.tools_test", "fleet.routing_test"}


def test_a_failing_rego_test_is_reported_as_failed(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    (bundle / "broken_test.rego").write_text(
        "package fleet.broken_test\n\ntest_that_is_false if {\n\t1 == 2\n}\n"
    )
    outcomes = {r.name: r.outcome for r in run_tests(bundle)}
    assert outcomes["test_that_is_false"] == "fail"


def test_tool_call_without_scope_is_denied_with_a_reason() -> None:
    engine = RegorusEngine(Bundle.load())
    decision = engine.decide(
        "fleet.tools.decision",
        {"server": "mcp-sql", "tool": "query", "tenant": "acme", "scopes": [], "arguments": {}},
    )
    assert not decision.allow
    assert decision.reasons == ("the token lacks scope sql:query",)
    assert decision.revision == engine.revision


def test_bundle_that_does_not_compile_is_refused_at_load(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    (bundle / "tools.rego").write_text("package fleet.tools\n\nallow {\n")
    with pytest.raises(PolicyError, match="does not compile"):
        RegorusEngine(Bundle.load(bundle))


def test_rule_without_a_decision_fails_closed() -> None:
    engine = RegorusEngine(Bundle.load())
    with pytest.raises(PolicyError):
        engine.decide("fleet.tools.rule", {"server": "mcp-sql", "tool": "query"})


def test_revision_changes_with_the_bundle_content(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    before = Bundle.load(bundle).revision
    (bundle / "data.json").write_text('{"config": {"tools": {}, "routing": []}}')
    assert Bundle.load(bundle).revision != before
