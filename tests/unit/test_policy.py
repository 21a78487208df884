"""The embedded Rego engine over the project's bundle."""

from __future__ import annotations

import gc
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from policy import DEFAULT_BUNDLE_DIR, Bundle, PolicyError, RegorusEngine, run_tests
from policy.regorus_engine import is_pure

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
    decision = engine.decide_now(
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
        engine.decide_now("fleet.tools.rule", {"server": "mcp-sql", "tool": "query"})


def test_revision_changes_with_the_bundle_content(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    before = Bundle.load(bundle).revision
    (bundle / "data.json").write_text('{"config": {"tools": {}, "routing": []}}')
    assert Bundle.load(bundle).revision != before


def test_a_repeated_input_is_a_new_decision_with_the_same_result() -> None:
    engine = RegorusEngine(Bundle.load())
    call = {"server": "mcp-sql", "tool": "query", "tenant": "acme", "scopes": ["sql:query"], "arguments": {}}
    first, second = (engine.decide_now("fleet.tools.decision", call) for _ in range(2))
    assert first.allow and second.allow
    assert first.decision_id != second.decision_id
    second.result["allow"] = False  # a caller's change to its result reaches no later decision
    assert engine.decide_now("fleet.tools.decision", call).allow


def test_a_bundle_that_reads_the_clock_is_evaluated_every_time(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "clock.rego").write_text('package clock\n\ndecision := {"allow": true, "now": time.now_ns()}\n')
    engine = RegorusEngine(Bundle.load(bundle))
    assert not is_pure(engine.bundle)
    assert is_pure(Bundle.load())
    times = {engine.decide_now("clock.decision", {}).result["now"] for _ in range(3)}
    assert len(times) == 3


QUERY = ("fleet.memory.read", {"tenant": "acme", "agent": "research", "tier": "episodic"})


@pytest.fixture
def unraisable() -> Iterator[list[str]]:
    """What is reported as an unraisable error meanwhile: regorus reports an engine dropped on a
    thread other than its own (and leaks it)."""
    reported: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda report: reported.append(str(report.exc_value))
    yield reported
    sys.unraisablehook = previous


def test_an_engine_freed_while_another_thread_holds_one_leaves_it_to_that_thread(
    unraisable: list[str],
) -> None:
    engines = [RegorusEngine(Bundle.load())]
    used, freed = threading.Event(), threading.Event()

    def worker() -> None:
        engines[0].evaluate(*QUERY)  # this thread's own engine
        used.set()
        assert freed.wait(10)
        RegorusEngine(Bundle.load()).evaluate(*QUERY)  # its next evaluation drops what it was left

    thread = threading.Thread(target=worker)
    thread.start()
    assert used.wait(10)
    engines.clear()  # freed here, on the main thread
    freed.set()
    thread.join(10)
    assert unraisable == []


def test_an_engine_in_a_cycle_collected_on_another_thread_is_dropped_by_its_own(
    unraisable: list[str],
) -> None:
    cycle: list[object] = [RegorusEngine(Bundle.load())]
    cycle.append(cycle)
    del cycle
    collector = threading.Thread(target=gc.collect)  # the collector runs where memory is allocated
    collector.start()
    collector.join(10)
    RegorusEngine(Bundle.load()).evaluate(*QUERY)  # the main thread drops what it was left
    assert unraisable == []
