"""The agent loop under its limits: scripted models over real HTTP that repeat a call, repeat
themselves, ask for too much at once, never stop, flood tokens or answer 429, against the kit's
real Toolbox and a real MCP server. Each is stopped (or summarizes, or is throttled) as the
caller's loop policy says, with the reason, and nothing a tool did before is lost or done twice."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleet.errors import ErrorCode, FleetError
from specialists.kit import LoopPolicy, Price, SkillError, TaskBudget
from specialists.llm import COMPLETION_BOUND, SUMMARIZE, function_name
from tests.llm.loop_run import Run, lookup_of
from tests.llm.tool_plane import ToolPlane, tool_plane
from tests.llm_script import Reply, call, rate_limited, say, scripted_model

SUMMARIZING = LoopPolicy(on_stuck="summarize", on_spent="summarize")


@pytest.fixture
async def plane(registry_nats: str, tmp_path: Path) -> AsyncIterator[ToolPlane]:
    async with tool_plane(registry_nats, tmp_path) as running:
        yield running


def _summary_request(run: Run) -> dict[str, object]:
    return run.model.requests[-1]


async def test_the_same_call_a_third_time_is_not_made_and_the_loop_stops_non_converging(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    async with scripted_model(lookup_of(plane), lookup_of(plane), lookup_of(plane), say("{}")) as model:
        run = Run(plane, model, http)
        with pytest.raises(SkillError) as caught:
            await run({"number": "INV-7"})
    assert caught.value.code == ErrorCode.NON_CONVERGING
    assert caught.value.details["reason"] == "repeated_call"
    assert "the same arguments 3 times" in caught.value.message
    assert caught.value.details["spent"]["tool_calls"] == 2
    # Two calls were made (their answers are kept by the tool), the third never was.
    assert plane.served == [("lookup_invoice", {"number": "INV-7"})] * 2
    assert len(model.requests) == 3


async def test_a_stuck_loop_summarizes_when_policy_says_so_and_the_summary_is_the_result(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    replies = (
        lookup_of(plane),
        lookup_of(plane),
        lookup_of(plane),
        say('{"over_limit": true, "unfinished": ""}'),
    )
    async with scripted_model(*replies) as model:
        run = Run(plane, model, http, loop=SUMMARIZING)
        assert await run({}) == {"over_limit": True, "unfinished": ""}
    summary = model.requests[-1]
    assert "tools" not in summary  # no tool is offered to the last turn
    closing = summary["messages"][-1]
    assert closing["role"] == "user"
    assert closing["content"] == SUMMARIZE.format(
        why=f"the model called {run.lookup} with the same arguments 3 times"
    )
    # The conversation it answers from holds both answers the tool gave.
    assert sum(m["role"] == "tool" for m in summary["messages"]) == 2
    assert run.meter is not None
    assert run.meter.to_dict()["stopped"] == "repeated_call" and run.meter.summarized
    # Two turns (10 tokens each) asked only for a call already made: what EXPLAIN.md attributes.
    assert run.meter.to_dict()["repeats"] == {"tokens": 20, "calls": {run.lookup: 2}}
    assert len(plane.served) == 2


async def test_a_model_that_says_the_same_thing_again_and_again_is_not_converging(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    same = "Let me look at the invoice once more."
    replies = [
        call(function_name(plane.server_id, "lookup_invoice"), {"number": f"INV-{n}"}, content=same)
        for n in range(4)
    ]
    async with scripted_model(*replies) as model:
        with pytest.raises(SkillError) as caught:
            await Run(plane, model, http, TaskBudget(output_repeat_limit=3))({})
    assert (caught.value.code, caught.value.details["reason"]) == (
        ErrorCode.NON_CONVERGING,
        "repeated_output",
    )
    assert [number for _, arguments in plane.served for number in arguments.values()] == ["INV-0", "INV-1"]


async def test_more_calls_in_one_turn_than_policy_allows_are_none_of_them_made(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    lookup = function_name(plane.server_id, "lookup_invoice")
    wide = Reply(tool_calls=tuple((lookup, {"number": f"INV-{n}"}) for n in range(5)))
    async with scripted_model(wide) as model:
        with pytest.raises(SkillError) as caught:
            await Run(plane, model, http, TaskBudget(max_tool_calls_per_turn=4))({})
    assert (caught.value.code, caught.value.details["reason"]) == (ErrorCode.NON_CONVERGING, "calls_per_turn")
    assert "5 tool calls in one turn (at most 4)" in caught.value.message
    assert plane.served == []


async def test_a_model_that_never_stops_is_stopped_at_its_turns_and_summarizes_what_it_did(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    endless = [lookup_of(plane, f"INV-{n}") for n in range(10)]
    async with scripted_model(*endless[:4], say('{"checked": 4}')) as model:
        run = Run(plane, model, http, TaskBudget(max_turns=4), loop=SUMMARIZING)
        assert await run({}) == {"checked": 4}
    assert len(plane.served) == 4 and len(model.requests) == 5
    assert run.meter is not None and run.meter.stopped == "max_turns"
    async with scripted_model(*endless) as model:
        with pytest.raises(SkillError) as caught:
            await Run(plane, model, http, TaskBudget(max_tool_calls=3))({})
    assert (caught.value.code, caught.value.details["reason"]) == (ErrorCode.BUDGET_EXHAUSTED, "tool_calls")


async def test_a_model_that_floods_tokens_is_stopped_by_the_money_its_tokens_cost(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    # 3 + 15 dollars per million tokens in and out: each 200,000-token turn (half each way) is $1.80.
    priced = LoopPolicy(prices={"scripted-1": Price(3.0, 15.0)})
    flood = [
        call(function_name(plane.server_id, "lookup_invoice"), {"number": f"INV-{n}"}, usage=200_000)
        for n in range(5)
    ]
    async with scripted_model(*flood) as model:
        budget = TaskBudget(max_llm_tokens=None, max_cost_usd=5.0)
        run = Run(plane, model, http, budget, loop=priced, context_tokens=10_000_000)
        with pytest.raises(SkillError) as caught:
            await run({})
    assert (caught.value.code, caught.value.details["reason"]) == (ErrorCode.BUDGET_EXHAUSTED, "cost")
    spent = caught.value.details["spent"]
    assert spent["cost_usd"] == pytest.approx(5.4) and spent["llm_calls"] == 3
    assert (spent["tokens_in"], spent["tokens_out"]) == (300_000, 300_000)
    assert spent["models"] == ["scripted-1"]
    assert len(plane.served) == 2  # the third turn's call, past the budget, was not made


async def test_near_its_token_budget_a_completion_is_asked_to_stay_within_what_is_left(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    async with scripted_model(call("nothing", {}, usage=9_000), say("{}")) as model:
        await Run(plane, model, http, TaskBudget(max_llm_tokens=10_000))({})
    first, second = model.requests
    assert "max_tokens" not in first  # 10,000 left: more than the bound, the server's own limit holds
    assert second["max_tokens"] == 1_000 < COMPLETION_BOUND


async def test_429s_are_waited_out_and_counted_as_the_retry_after_asks(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    async with scripted_model(rate_limited("0"), rate_limited(None), say('{"ok": true}')) as model:
        run = Run(plane, model, http, loop=LoopPolicy(rate_limit_retries=3))
        assert await run({}) == {"ok": True}
    assert run.meter is not None
    spent = run.meter.to_dict()
    assert (spent["rate_limited"], spent["llm_retries"], spent["llm_calls"]) == (2, 2, 1)
    assert len(model.requests) == 3


async def test_a_model_that_keeps_rate_limiting_throttles_the_task_with_the_wait_it_asks_for(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    async with scripted_model(
        lookup_of(plane), rate_limited("0"), rate_limited("0"), rate_limited("0")
    ) as model:
        run = Run(plane, model, http, loop=LoopPolicy(rate_limit_retries=2))
        with pytest.raises(FleetError) as caught:
            await run({})
    assert caught.value.code == ErrorCode.LLM_RATE_LIMITED and caught.value.retryable
    assert caught.value.details["reason"] == "rate_limited"
    assert len(model.requests) == 4 and len(plane.served) == 1
    # A wait longer than policy allows is not waited at all: the caller may retry when it is over.
    async with scripted_model(rate_limited("120")) as model:
        run = Run(plane, model, http, loop=LoopPolicy(rate_limit_max_wait_s=30))
        with pytest.raises(FleetError) as caught:
            await run({})
    assert caught.value.code == ErrorCode.LLM_RATE_LIMITED and caught.value.retry_after_s == 120
    assert len(model.requests) == 1


async def test_a_cut_final_answer_is_a_stop_at_the_context_limit_not_a_bad_answer(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    cut = Reply(
        body={
            "choices": [
                {"message": {"role": "assistant", "content": '{"checked": '}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }
    )
    async with scripted_model(cut) as model:
        with pytest.raises(SkillError) as caught:
            await Run(plane, model, http)({})
    assert (caught.value.code, caught.value.details["reason"]) == (
        ErrorCode.BUDGET_EXHAUSTED,
        "context_limit",
    )
    assert json.loads(json.dumps(caught.value.to_dict()))["details"]["reason"] == "context_limit"
