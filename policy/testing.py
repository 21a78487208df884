"""Runs a bundle's Rego unit tests (every ``test_*`` rule), like ``opa test``."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy._bundle import Bundle
from policy.regorus_engine import RegorusEngine


@dataclass(frozen=True, slots=True)
class RegoTestResult:
    package: str
    name: str
    file: str
    outcome: str  # "pass" | "fail" | "error"
    detail: str = ""
    duration_s: float = 0.0


def _ref_path(ref: dict[str, Any]) -> list[str]:
    if "Var" in ref:
        return [ref["Var"]["value"]]
    if "RefDot" in ref:
        return [*_ref_path(ref["RefDot"]["refr"]), ref["RefDot"]["field"][1]]
    raise ValueError(f"unsupported reference {ref}")


def discover(engine: RegorusEngine) -> list[tuple[str, str, str]]:
    """(package, rule, file) of every non-function rule named ``test_*``."""
    found: list[tuple[str, str, str]] = []
    for module in json.loads(engine.ast_json()):
        package = ".".join(_ref_path(module["ast"]["package"]["refr"]))
        for rule in module["ast"]["rules"]:
            spec = rule.get("Spec")
            if not spec:
                continue
            ((kind, head),) = spec["head"].items()
            if kind == "Func":
                continue
            name = _ref_path(head["refr"])[-1]
            if name.startswith("test_") and (package, name, module["source"]["file"]) not in found:
                found.append((package, name, module["source"]["file"]))
    return found


def run_tests(root: Path | None = None) -> list[RegoTestResult]:
    """Evaluate every test rule of the bundle at ``root``; a rule passes only if it is true."""
    return run_bundle_tests(Bundle.load(root) if root else Bundle.load())[0]


def run_bundle_tests(
    bundle: Bundle, *, coverage: bool = False
) -> tuple[list[RegoTestResult], dict[str, Any]]:
    """:func:`run_tests` on a loaded bundle, with the coverage of its policies (not of its tests) in
    OPA's shape when asked: per file the covered and not covered lines, and the percentage."""
    engine = RegorusEngine(bundle, with_tests=True)
    raw = engine.raw_engine()
    if coverage:
        raw.set_enable_coverage(True)
    results: list[RegoTestResult] = []
    for package, name, file in discover(engine):
        started = time.perf_counter()
        try:
            value = engine.evaluate(f"{package}.{name}", {})
        except Exception as exc:  # a PolicyError: reported as the test's error, run continues
            results.append(RegoTestResult(package, name, file, "error", str(exc)))
            continue
        outcome = "pass" if value is True else "fail"
        results.append(RegoTestResult(package, name, file, outcome, duration_s=time.perf_counter() - started))
    return results, (_coverage(raw) if coverage else {})


async def run_tests_with(
    bundle: Bundle, evaluate: Callable[[str, dict[str, Any]], Awaitable[Any]]
) -> list[RegoTestResult]:
    """:func:`run_tests`, each test rule evaluated by ``evaluate`` (another engine's, e.g. OPA's
    over REST, loaded with the bundle's tests): the same tests, found the same way."""
    results: list[RegoTestResult] = []
    for package, name, file in discover(RegorusEngine(bundle, with_tests=True)):
        started = time.perf_counter()
        try:
            value = await evaluate(f"{package}.{name}", {})
        except Exception as exc:  # a PolicyError: reported as the test's error, run continues
            results.append(RegoTestResult(package, name, file, "error", str(exc)))
            continue
        outcome = "pass" if value is True else "fail"
        results.append(RegoTestResult(package, name, file, outcome, duration_s=time.perf_counter() - started))
    return results


def _coverage(raw: Any) -> dict[str, Any]:
    files: dict[str, Any] = {}
    covered_total = not_covered_total = 0
    for entry in json.loads(raw.get_coverage_report_as_json())["files"]:
        if entry["path"].endswith("_test.rego"):
            continue
        covered, missed = sorted(set(entry["covered"])), sorted(set(entry["not_covered"]))
        covered_total, not_covered_total = covered_total + len(covered), not_covered_total + len(missed)
        files[entry["path"]] = {
            "covered_lines": len(covered),
            "not_covered_lines": len(missed),
            "not_covered": missed,
            "coverage": round(100 * len(covered) / max(1, len(covered) + len(missed)), 2),
        }
    total = covered_total + not_covered_total
    return {
        "files": files,
        "covered_lines": covered_total,
        "not_covered_lines": not_covered_total,
        "coverage": round(100 * covered_total / max(1, total), 2),
    }
