"""Runs a bundle's Rego unit tests (every ``test_*`` rule), like ``opa test``."""

from __future__ import annotations

import json
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
    engine = RegorusEngine(Bundle.load(root) if root else Bundle.load(), with_tests=True)
    results: list[RegoTestResult] = []
    for package, name, file in discover(engine):
        try:
            value = engine.evaluate(f"{package}.{name}", {})
        except Exception as exc:  # a PolicyError: reported as the test's error, run continues
            results.append(RegoTestResult(package, name, file, "error", str(exc)))
            continue
        outcome = "pass" if value is True else "fail"
        results.append(RegoTestResult(package, name, file, outcome))
    return results
