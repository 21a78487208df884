"""Plans: validation of explicit steps, references between steps, routing by policy."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.engine.graph import ready_steps
from coordinator.planning.plan import (
    TIMER_SKILL,
    UNTRUSTED,
    PlanError,
    dependencies,
    parse_steps,
    plan_request,
    resolve_input,
)
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
        [{"skill": "a", "after": ["b"]}, {"id": "b", "skill": "b"}],
        [{"skill": "a", "after": "step0"}],
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


def test_an_answer_policy_does_not_let_be_acted_on_cannot_feed_a_step() -> None:
    results = {"score": {"query": "DROP TABLE x", UNTRUSTED: "partner-1"}}
    with pytest.raises(FleetError, match="answered by partner-1, outside the fleet") as refused:
        resolve_input({"sql": {"$from": "score.query"}}, results)
    assert refused.value.code == ErrorCode.POLICY_DENIED
    assert resolve_input({"sql": "SELECT 1"}, results) == {"sql": "SELECT 1"}  # only a reference is refused


async def test_explicit_steps_win_over_text() -> None:
    steps = await plan_request(
        [{"steps": [{"skill": "sql-query"}]}], "invoices", RegorusEngine.from_dir(), "t"
    )
    assert [s.skill for s in steps] == ["sql-query"]


async def test_text_is_routed_by_policy() -> None:
    steps = await plan_request([], "any outlier in the invoices?", RegorusEngine.from_dir(), "t")
    assert [s.skill for s in steps] == ["invoice-totals", "outliers"]


async def test_text_no_rule_matches_is_a_clear_error() -> None:
    with pytest.raises(FleetError) as caught:
        await plan_request([], "write a sonnet", RegorusEngine.from_dir(), "t")
    assert caught.value.code == ErrorCode.NO_SPECIALIST


def test_steps_wait_for_the_results_they_take_and_the_steps_they_name() -> None:
    steps = [
        s.to_dict()
        for s in parse_steps(
            [
                {"id": "a", "skill": "x"},
                {"id": "b", "skill": "x"},
                {"id": "c", "skill": "x", "input": {"v": [{"$from": "a.n"}]}},
                {"id": "d", "skill": "x", "after": ["b"], "input": {"w": {"$from": "c"}}},
            ]
        )
    ]
    assert [sorted(dependencies(s)) for s in steps] == [[], [], ["a"], ["b", "c"]]
    # Independent steps are ready together (they fan out); the rest as their inputs arrive.
    state: dict[str, Any] = {"steps": steps, "results": {}}
    assert [s["id"] for s in ready_steps(state)] == ["a", "b"]  # type: ignore[arg-type]
    state["results"] = {"a": {"n": 1}}
    assert [s["id"] for s in ready_steps(state)] == ["b", "c"]  # type: ignore[arg-type]
    state["results"] = {"a": {}, "b": {}, "c": {}}
    assert [s["id"] for s in ready_steps(state)] == ["d"]  # type: ignore[arg-type]


def test_a_wait_step_takes_a_time_with_its_offset_or_a_duration_and_nothing_else() -> None:
    steps = parse_steps(
        [
            {"id": "at", "wait": {"until": "2026-12-01T02:00:00+00:00"}},
            {"id": "later", "wait": {"for_s": 90}, "after": ["at"]},
        ]
    )
    assert [s.skill for s in steps] == [TIMER_SKILL, TIMER_SKILL]
    assert steps[0].to_dict()["wait"] == {"until": "2026-12-01T02:00:00+00:00"}
    assert steps[1].wait == {"for_s": 90.0}
    for bad in (
        {"wait": {"until": "2026-12-01T02:00:00"}},  # no offset
        {"wait": {"until": "tomorrow"}},
        {"wait": {"for_s": 0}},
        {"wait": {"for_s": True}},
        {"wait": {"for_s": 5, "until": "2026-12-01T02:00:00+00:00"}},
        {"wait": {"for_s": 5}, "skill": "sql-query"},
        {"skill": TIMER_SKILL},
    ):
        with pytest.raises(PlanError):
            parse_steps([bad])


def test_an_event_wait_names_one_subject_and_may_name_a_type_and_a_timeout() -> None:
    (step,) = parse_steps([{"id": "gate", "wait": {"event": "fleet.events.po.approved", "timeout_s": 60}}])
    assert step.skill == TIMER_SKILL
    assert step.wait == {"event": "fleet.events.po.approved", "timeout_s": 60.0}
    for bad in (
        {"wait": {"event": "orders.approved"}},  # not an event subject
        {"wait": {"event": "fleet.events.po.*"}},  # one subject, no wildcards
        {"wait": {"event": "fleet.events.po.approved", "timeout_s": -1}},
        {"wait": {"event": "fleet.events.po.approved", "type": 3}},
        {"wait": {"event": "fleet.events.po.approved", "until": "2026-12-01T02:00:00+00:00"}},
    ):
        with pytest.raises(PlanError):
            parse_steps([bad])


def test_a_caller_cannot_set_the_approval_of_a_step() -> None:
    """input.approval is what the fleet passes a step after a person approved it: a plan that sets it
    would approve itself."""
    with pytest.raises(PlanError) as raised:
        parse_steps([{"id": "pay", "skill": "issue-refund", "input": {"approval": {"id": "self"}}}])
    assert "reserved" in raised.value.message
