"""A run's spending on models: tasks priced by the policy's table, a fan-out admitted only as far as
the tranche's budget covers what each task reserves, and the limits each task is sent with."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from coordinator.engine import spending
from coordinator.engine.graph import check_budget

MODELS = {
    "prices": {
        "big": {"input_per_mtok": 10, "output_per_mtok": 30},
        "small": {"input_per_mtok": 1, "output_per_mtok": 2},
    }
}
LOOP = {
    "default": {
        "max_turns": 40,
        "max_llm_tokens": 100,
        "max_cost_usd": 0.5,
        "on_stuck": "summarize",
        "on_spent": "stop",
    },
    "agents": {
        "researcher": {"max_turns": 10, "max_llm_tokens": 300, "max_cost_usd": 0.5, "on_stuck": "stop"}
    },
}
LIMITS: dict[str, Any] = {"loop": LOOP, "models": MODELS}


def test_a_task_is_priced_by_the_policys_table_not_by_what_the_agent_says_it_cost() -> None:
    said = {
        "tokens_in": 100_000,
        "tokens_out": 10_000,
        "llm_tokens": 110_000,
        "models": ["big"],
        "cost_usd": 0.0,
    }
    spent = spending.priced({**said, "llm_calls": 3, "rate_limited": 2, "stopped": "repeated_call"}, MODELS)
    assert spent["cost_usd"] == pytest.approx(1.3) and spent["llm_tokens"] == 110_000
    assert (spent["llm_calls"], spent["rate_limited"], spent["stopped"]) == (3, 2, "repeated_call")
    # Two models: the dearer one prices the lot; a model nobody priced costs nothing known.
    assert spending.priced({**said, "models": ["small", "big"]}, MODELS)["cost_usd"] == pytest.approx(1.3)
    assert spending.priced({**said, "models": ["unknown"]}, MODELS)["cost_usd"] == 0
    # The reviewer's verdicts are kept as counts of the known verdicts only.
    reviewed = spending.priced({**said, "reviews": {"continue": 2, "stop": -1, "approve": 9}}, MODELS)
    assert reviewed["reviews"] == {"continue": 2}
    # Nonsense reads as nothing spent, never as a negative.
    assert (
        spending.priced({"tokens_in": -5, "llm_tokens": "lots", "models": "big"}, MODELS)["llm_tokens"] == 0
    )


def test_a_step_over_several_calls_spends_their_sum() -> None:
    one = {"tokens_in": 10, "tokens_out": 5, "llm_tokens": 15, "models": ["small"], "llm_calls": 1}
    assert spending.of_calls([None, None], MODELS) is None
    both = spending.of_calls([one, None, {**one, "models": ["big"], "stopped": "tokens"}], MODELS)
    assert both is not None
    assert (both["llm_tokens"], both["llm_calls"], both["models"], both["stopped"]) == (
        30,
        2,
        ["big", "small"],
        "tokens",
    )


def _steps(*ids: str, agent: str | None = None) -> list[dict[str, Any]]:
    return [{"id": i, "skill": "recall", "input": {}, **({"agent": agent} if agent else {})} for i in ids]


def test_a_fan_out_is_admitted_while_the_budget_covers_what_each_task_reserves() -> None:
    left = {"operations": 10.0, "llm_tokens": 250.0, "cost_usd": None}
    # Unnamed steps reserve the most any agent's loop may spend: 300 tokens.
    assert list(spending.admit(_steps("a", "b", "c"), LIMITS, left)) == ["a"]
    assert spending.admit(_steps("a"), LIMITS, left)["a"]["max_llm_tokens"] == 250  # alone: what is left
    named = spending.admit(_steps("a", "b", "c", agent="other"), LIMITS, left)
    assert named == {
        "a": {"max_llm_tokens": 100, "max_cost_usd": 0.5, "calls": 1},
        "b": {"max_llm_tokens": 100, "max_cost_usd": 0.5, "calls": 1},
    }
    # The operations budget holds the fan-out too (it could pass it by the fan-out's width).
    assert list(
        spending.admit(_steps("a", "b", "c", agent="other"), LIMITS, {**left, "operations": 1.0})
    ) == ["a"]
    # Money: 0.5 each against 0.75 left.
    money = {"operations": 10.0, "llm_tokens": None, "cost_usd": 0.75}
    assert list(spending.admit(_steps("a", "b", agent="other"), LIMITS, money)) == ["a"]


def test_a_task_whose_loop_has_no_cap_of_its_own_reserves_all_that_is_left() -> None:
    uncapped: dict[str, Any] = {"loop": {"default": {"max_turns": 5}, "agents": {}}, "models": {}}
    admitted = spending.admit(
        _steps("a", "b"), uncapped, {"operations": 5.0, "llm_tokens": 1000.0, "cost_usd": None}
    )
    assert admitted == {"a": {"max_llm_tokens": 1000.0, "max_cost_usd": 0.0, "calls": 1}}
    free = spending.admit(
        _steps("a", "b"), uncapped, {"operations": 5.0, "llm_tokens": None, "cost_usd": None}
    )
    assert list(free) == ["a", "b"]


def test_a_batch_round_reserves_for_each_of_its_calls_and_is_cut_to_the_calls_that_fit() -> None:
    batch = {**_steps("b", agent="other")[0], "_calls": 5}  # 100 tokens and $0.5 each
    left = {"operations": 10.0, "llm_tokens": 250.0, "cost_usd": None}
    assert spending.admit([batch], LIMITS, left) == {
        "b": {"max_llm_tokens": 100, "max_cost_usd": 0.5, "calls": 2}
    }
    # The operations budget cuts it too; a plain step after it waits for what the round left.
    cut = spending.admit([batch, *_steps("c", agent="other")], LIMITS, {**left, "operations": 3.0})
    assert cut == {"b": {"max_llm_tokens": 100, "max_cost_usd": 0.5, "calls": 2}}
    # After a plain step took its share, a round that fits no call waits for the next turn.
    assert list(
        spending.admit([*_steps("a", agent="other"), batch], LIMITS, {**left, "llm_tokens": 150.0})
    ) == ["a"]
    # Without caps of its own, a round shares what is left evenly among its calls.
    uncapped: dict[str, Any] = {"loop": {"default": {"max_turns": 5}, "agents": {}}, "models": {}}
    shared = spending.admit([batch], uncapped, {"operations": 10.0, "llm_tokens": 1000.0, "cost_usd": None})
    assert shared == {"b": {"max_llm_tokens": 200.0, "max_cost_usd": 0.0, "calls": 5}}


def test_a_task_is_sent_its_agents_loop_lowered_to_what_it_reserved_and_the_prices() -> None:
    limits = spending.task_limits(LIMITS, "researcher", {"max_llm_tokens": 120.0, "max_cost_usd": 0.0})
    assert limits.budget == {"max_turns": 10, "max_llm_tokens": 120, "max_cost_usd": 0.5}
    assert limits.loop == {"on_stuck": "stop", "prices": MODELS["prices"]}
    other = spending.task_limits(LIMITS, "someone-else", None)
    assert other.budget["max_llm_tokens"] == 100 and other.loop["on_spent"] == "stop"


def _state(steps: list[dict[str, Any]], outcomes: list[dict[str, Any]], **budget: Any) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat()
    return {
        "run_id": "r",
        "tenant": "acme",
        "steps": steps,
        "results": {},
        "outcomes": outcomes,
        "limits": {
            "limits": {
                "max_steps": 50,
                "max_operations": 100,
                "max_seconds": 3600,
                "on_exhausted": "summarize",
                **budget,
            },
            "convergence": {"repeat_limit": 3, "max_calls_per_turn": 25},
            **LIMITS,
        },
        "tranche": {"number": 0, "steps": 0, "operations": 0, "started_at": now},
    }


def test_the_turn_sends_only_what_the_tranche_covers_and_stops_when_the_tokens_are_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[dict[str, Any]] = []
    monkeypatch.setattr("coordinator.engine.graph.get_stream_writer", lambda: events.append)
    steps = _steps("a", "b", "c", "d", agent="other")
    update = check_budget(_state(steps, [], max_llm_tokens=250), dt.datetime.now(dt.UTC))  # type: ignore[arg-type]
    assert list(update["admitted"]) == ["a", "b"] and len(update["calls"]) == 2
    spent = [{"step": "x", "status": "completed", "usage": {"llm_tokens": 260, "cost_usd": 0.1}}]
    stopped = check_budget(_state(steps, spent, max_llm_tokens=250), dt.datetime.now(dt.UTC))  # type: ignore[arg-type]
    assert stopped["stop"]["reason"] == "budget_exhausted"
    assert [e["payload"]["spent"] for e in events] == [["max_llm_tokens 250 reached"]]
    money = check_budget(_state(steps, spent, max_cost_usd=0.05), dt.datetime.now(dt.UTC))  # type: ignore[arg-type]
    assert money["stop"]["why"] == "max_cost_usd 0.05 reached"
