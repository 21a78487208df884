"""Plans: validation of explicit steps, references between steps, routing by policy."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.plan import PlanError, parse_steps, plan_request, resolve_input
from fleet.errors import ErrorCode, FleetError
from policy import RegorusEngine


def test_steps_get_default_ids_and_empty_inputs() -> None:
    steps = parse_steps([{"skill": "a"}, {"skill": "b", "input": {"x": 1}}])
    assert [(s.id, s.skill, s.input) for s in steps] == [("step1", "a", {}), ("step2", "b", {"x": 1})]


@pytest.mark.parametrize(
    "raw",
    [
        [],
        "steps",
        [{"input": {}}],
        [{"skill": "a", "id": "x"}, {"skill": "b", "id": "x"}],
        [{"skill": "a", "input": [1]}],
        [{"skill": "a", "input": {"v": {"$from": "later.field"}}}, {"id": "later", "skill": "b"}],
        [{"skill": "a"}] * 21,
    ],
)
def test_invalid_plans_are_refused(raw: Any) -> None:
    with pytest.raises(PlanError):
        parse_steps(raw)


def test_references_take_fields_of_earlier_results() -> None:
    results = {"totals": {"records": [{"a": 1}], "n": 1}}
    value = {"rows": {"$from": "totals.records"}, "keep": [{"$from": "totals.n"}, 3]}
    assert resolve_input(value, results) == {"rows": [{"a": 1}], "keep": [1, 3]}


def test_reference_to_a_missing_field_is_an_error() -> None:
    with pytest.raises(PlanError, match="not in the result"):
        resolve_input({"$from": "totals.nope"}, {"totals": {}})


def test_explicit_steps_win_over_text() -> None:
    steps = plan_request([{"steps": [{"skill": "sql-query"}]}], "invoices", RegorusEngine.from_dir(), "t")
    assert [s.skill for s in steps] == ["sql-query"]


def test_text_is_routed_by_policy() -> None:
    steps = plan_request([], "any outlier in the invoices?", RegorusEngine.from_dir(), "t")
    assert [s.skill for s in steps] == ["invoice-totals", "outliers"]


def test_text_no_rule_matches_is_a_clear_error() -> None:
    with pytest.raises(FleetError) as caught:
        plan_request([], "write a sonnet", RegorusEngine.from_dir(), "t")
    assert caught.value.code == ErrorCode.NO_SPECIALIST
