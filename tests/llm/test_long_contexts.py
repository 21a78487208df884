"""Long contexts: an agent loop whose context nears the model's window is compacted (the model writes
its progress notes; the context starts again from them and the latest exchanges) and finishes; a cut
answer or a refusal for length is compacted too, never silent; and a task that comes back with its
notes after a crash goes on from them: no call it made is made again, a keyed call carries the same
key, and a call cut by the crash that is not safe to repeat ends the task ``outcome_unknown``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fleet.errors import ErrorCode
from specialists.kit import InputRequired, LoopPolicy, OutcomeUnknown, SkillError, TaskBudget
from specialists.llm import COMPACT, function_name
from specialists.progress import MAX_NOTES_BYTES, Notes, call_key
from tests.llm.loop_run import Run, lookup_of
from tests.llm.tool_plane import ToolPlane, tool_plane
from tests.llm_script import Reply, call, say, scripted_model

SUMMARY = "Task: check INV-7. Looked up INV-7 (Initech, 1250) and INV-8. Remaining: answer."


@pytest.fixture
async def plane(registry_nats: str, tmp_path: Path) -> AsyncIterator[ToolPlane]:
    async with tool_plane(registry_nats, tmp_path) as running:
        yield running


def _big(reply: Reply, prompt_tokens: int) -> Reply:
    """``reply``, reporting a prompt of ``prompt_tokens`` (the context's size as the model counts it)."""
    return Reply(content=reply.content, tool_calls=reply.tool_calls, usage=prompt_tokens * 2)


async def test_a_context_past_three_quarters_of_the_window_is_compacted_and_the_task_finishes(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    pay = function_name(plane.server_id, "pay_invoice")
    replies = [
        _big(lookup_of(plane, "INV-7"), 200),
        _big(call(pay, {"number": "INV-8", "idempotency_key": "a"}), 800),  # 800 of 1,000: compact next
        say(SUMMARY),  # the model's notes
        call(pay, {"number": "INV-8", "idempotency_key": "b"}),  # an effect made before: from the notes
        lookup_of(plane, "INV-7"),  # a read made before: made again (what it reads may have changed)
        say('{"over_limit": true}'),
    ]
    async with scripted_model(*replies) as model:
        run = Run(plane, model, http, context_tokens=1_000)
        assert await run({"number": "INV-7"}) == {"over_limit": True}
    compacting, after = model.requests[2], model.requests[3]
    assert "tools" not in compacting and compacting["messages"][-1]["content"] == COMPACT
    system, user, notes, *recent = after["messages"]
    assert (system["role"], user["content"]) == ("system", '{"number": "INV-7"}')
    assert notes["role"] == "user" and SUMMARY in notes["content"]
    assert "INV-8" in notes["content"] and "Initech" in notes["content"]
    # A fresh context: the notes and the latest exchanges (the calls whole, with their answers),
    # within a quarter of the window (1,000 characters).
    assert sum(len(m.get("content") or "") for m in [notes, *recent]) <= 1_000
    assert recent == compacting["messages"][len(compacting["messages"]) - 1 - len(recent) : -1]
    assert [m["role"] for m in recent][::2] == ["assistant"] * (len(recent) // 2)
    # The repeated payment was answered from the notes; the repeated lookup was made again.
    assert [name for name, _ in plane.served] == ["lookup_invoice", "pay_invoice", "lookup_invoice"]
    assert run.meter is not None
    spent = run.meter.to_dict()
    assert (spent["compactions"], spent["from_notes"]) == (1, 1)
    saved = Notes.of(run.saved[-1])
    assert saved is not None and saved.summary == SUMMARY and saved.compactions == 1
    assert [(c.function.rsplit("__", 1)[1], c.arguments["number"]) for c in saved.calls] == [
        ("lookup_invoice", "INV-7"),
        ("pay_invoice", "INV-8"),
        ("lookup_invoice", "INV-7"),
    ]


async def test_an_answer_cut_at_the_limit_is_compacted_and_asked_again_not_taken_as_bad(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    cut = Reply(
        body={
            "choices": [{"message": {"role": "assistant", "content": '{"over'}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
        }
    )
    async with scripted_model(lookup_of(plane), cut, say(SUMMARY), say('{"over_limit": false}')) as model:
        run = Run(plane, model, http)
        assert await run({}) == {"over_limit": False}
    assert model.requests[2]["messages"][-1]["content"] == COMPACT
    assert SUMMARY in model.requests[3]["messages"][2]["content"]
    assert run.meter is not None and run.meter.compactions == 1


async def test_a_refusal_for_length_is_compacted_and_asked_again(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    refused = Reply(
        status=400, body={"error": {"message": "This model's maximum context length is 8192 tokens"}}
    )
    async with scripted_model(lookup_of(plane), refused, say(SUMMARY), say('{"over_limit": false}')) as model:
        run = Run(plane, model, http)
        assert await run({}) == {"over_limit": False}
    assert model.requests[2]["messages"][-1]["content"] == COMPACT
    assert run.meter is not None and run.meter.compactions == 1


async def test_a_refusal_for_length_with_nothing_to_compact_is_a_stop_at_the_context_limit(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    refused = Reply(status=400, body={"error": {"code": "context_length_exceeded", "message": "too long"}})
    async with scripted_model(refused) as model:
        with pytest.raises(Exception) as caught:
            await Run(plane, model, http)({"text": "x" * 100})
    assert getattr(caught.value, "details", {}).get("reason") == "context_limit"


async def test_a_task_back_after_a_crash_goes_on_from_its_notes_and_makes_no_call_twice(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    pay = call(function_name(plane.server_id, "pay_invoice"), {"number": "INV-7", "idempotency_key": "mine"})
    # The first process: looks up, pays, and dies before it answers (here: its turns run out).
    async with scripted_model(lookup_of(plane), pay) as model:
        first = Run(plane, model, http, TaskBudget(max_turns=2))
        with pytest.raises(Exception):  # noqa: B017  (the stop stands in for the crash)
            await first({"number": "INV-7"})
    notes = first.saved[-1]
    (key,) = plane.paid
    assert key.startswith("loop-") and key != "mine"  # the loop's key, not the model's
    # The next process gets the notes back: its model sees them, pays again (answered from the
    # notes, the tool not called) and answers.
    again = call(
        function_name(plane.server_id, "pay_invoice"), {"number": "INV-7", "idempotency_key": "other"}
    )
    async with scripted_model(again, say('{"paid": true}')) as model:
        second = Run(plane, model, http, resume=notes)
        assert await second({"number": "INV-7"}) == {"paid": True}
    shown = model.requests[0]["messages"][2]["content"]
    assert "progress notes" in shown and "pay_invoice" in shown and "replayed" in shown
    assert [name for name, _ in plane.served] == ["lookup_invoice", "pay_invoice"]
    assert second.meter is not None and second.meter.to_dict()["resumed"] is True


async def test_a_keyed_call_cut_by_the_crash_is_made_again_with_the_same_key(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    function = function_name(plane.server_id, "pay_invoice")
    arguments = {"number": "INV-9", "idempotency_key": "x"}
    cut = Notes()
    cut.pending(call_key(function, arguments), function, arguments)
    again = call(function, {"number": "INV-9", "idempotency_key": "y"})
    for _ in range(2):  # twice: as if the first of these had crashed after the tool took effect
        async with scripted_model(again, say('{"paid": true}')) as model:
            assert await Run(plane, model, http, resume=cut.to_json())({}) == {"paid": True}
    keys = [args["idempotency_key"] for name, args in plane.served if name == "pay_invoice"]
    assert len(keys) == 2 and len(set(keys)) == 1 and len(plane.paid) == 1  # one payment


async def test_a_cut_call_that_is_not_safe_to_repeat_ends_the_task_outcome_unknown(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    function = function_name(plane.server_id, "void_invoice")
    cut = Notes()
    cut.pending(call_key(function, {"number": "INV-7"}), function, {"number": "INV-7"})
    async with scripted_model(say("{}")) as model:
        with pytest.raises(OutcomeUnknown) as caught:
            await Run(plane, model, http, resume=cut.to_json())({})
    assert caught.value.code == ErrorCode.OUTCOME_UNKNOWN and "void_invoice" in caught.value.message
    assert model.requests == [] and plane.served == []
    # A read-only call cut by the crash is simply made again.
    lookup = function_name(plane.server_id, "lookup_invoice")
    cut = Notes()
    cut.pending(call_key(lookup, {"number": "INV-7"}), lookup, {"number": "INV-7"})
    async with scripted_model(lookup_of(plane), say("{}")) as model:
        assert await Run(plane, model, http, resume=cut.to_json())({}) == {}
    assert plane.served == [("lookup_invoice", {"number": "INV-7"})]


def test_notes_stay_within_their_bound_dropping_answers_before_calls() -> None:
    notes = Notes(summary="s")
    for n in range(200):
        key = call_key("f", {"n": n})
        notes.pending(key, "f", {"n": n})
        notes.done(key, "a" * 1_500)
    body = notes.to_json()
    assert len(json.dumps(body)) <= MAX_NOTES_BYTES
    assert len(body["calls"]) == 200  # every call is still known to have been made
    assert "answer" not in body["calls"][0] and "answer" in body["calls"][-1]
    assert Notes.of(body) is not None and Notes.of({"v": 99}) is None and Notes.of("junk") is None


ASKING = LoopPolicy(on_stuck="ask", on_spent="ask")


async def _asked(plane: ToolPlane, http: httpx.AsyncClient) -> Run:
    """A loop stuck on the same lookup, whose policy asks a person: it asks, its notes saved."""
    async with scripted_model(lookup_of(plane), lookup_of(plane), lookup_of(plane)) as model:
        run = Run(plane, model, http, loop=ASKING)
        with pytest.raises(InputRequired) as asked:
            await run({"number": "INV-7"})
    assert asked.value.fields == {"decision": "continue | summarize | stop"}
    assert "the same arguments 3 times" in asked.value.question
    assert len(plane.served) == 2
    return run


async def test_a_stuck_loop_whose_policy_asks_stops_and_asks_a_person_with_its_notes_saved(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    run = await _asked(plane, http)
    notes = Notes.of(run.saved[-1])
    assert notes is not None and notes.asked is not None and notes.asked["reason"] == "repeated_call"
    assert len(notes.calls) == 2


@pytest.mark.parametrize("said", [{"decision": "continue"}, {"text": " Continue "}])
async def test_a_person_lets_the_loop_continue_from_its_notes_with_a_new_allowance(
    plane: ToolPlane, http: httpx.AsyncClient, said: dict[str, str]
) -> None:
    notes = (await _asked(plane, http)).saved[-1]
    # Back with the answer: the same lookup again is allowed (a new allowance), then an answer.
    async with scripted_model(lookup_of(plane), say('{"over_limit": true}')) as model:
        run = Run(plane, model, http, loop=ASKING, resume=notes, answer=said)
        assert await run({"number": "INV-7"}) == {"over_limit": True}
    assert "progress notes" in model.requests[0]["messages"][-1]["content"]
    assert len(plane.served) == 3
    assert run.meter is not None and "stopped" not in run.meter.to_dict()


async def test_a_person_has_the_stopped_loop_summarize_or_stop(
    plane: ToolPlane, http: httpx.AsyncClient
) -> None:
    notes = (await _asked(plane, http)).saved[-1]
    async with scripted_model(say('{"over_limit": "unknown"}')) as model:
        run = Run(plane, model, http, loop=ASKING, resume=notes, answer={"decision": "summarize"})
        assert await run({"number": "INV-7"}) == {"over_limit": "unknown"}
    assert "tools" not in model.requests[0] and model.requests[0]["messages"][-1]["content"].startswith(
        "Stop here"
    )
    for said in (
        {"decision": "stop"},
        {"text": "approve everything"},
    ):  # stop, or an answer that says neither
        async with scripted_model(say("{}")) as model:
            with pytest.raises(SkillError) as caught:
                await Run(plane, model, http, loop=ASKING, resume=notes, answer=said)({"number": "INV-7"})
        assert caught.value.code == ErrorCode.NON_CONVERGING and "a person decided" in caught.value.message
        assert model.requests == []
