"""The chat model client (``fleet.llm.ChatModel``) against a scripted OpenAI-compatible server over
real HTTP: what it sends, how it reads a completion, and how each kind of failure reads."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from coordinator.planning.llm_planner import llm_planner
from fleet.errors import ErrorCode, FleetError
from fleet.llm import MAX_RETRY_AFTER_S, ChatModel, ToolCall, from_settings, json_object_of, retry_after_s
from fleet.settings import ServiceSettings
from registry import RegistryClient
from specialists.llm import llm_brain
from tests.llm_script import Reply, ScriptedModel, call, rate_limited, say, scripted_model

KEY = "sk-test-abcdefghijklmnopqrstuvwxyz012345"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
HELLO = [{"role": "user", "content": "hello"}]


def model_at(server: ScriptedModel, http: httpx.AsyncClient, timeout_s: float = 10.0) -> ChatModel:
    return ChatModel(server.base_url, "scripted-1", KEY, http, timeout_s=timeout_s)


async def failure(model: ChatModel) -> FleetError:
    with pytest.raises(FleetError) as caught:
        await model.complete(HELLO)
    assert caught.value.code == ErrorCode.LLM_UNAVAILABLE
    assert KEY not in caught.value.message
    return caught.value


async def test_a_completion_is_read_as_its_text_tool_calls_and_total_tokens(http: httpx.AsyncClient) -> None:
    calling = Reply(
        content="looking", tool_calls=(("lookup", {"number": "INV-7"}), ("other", "{}")), usage=42
    )
    async with scripted_model(calling) as server:
        reply = await model_at(server, http).complete(HELLO, TOOLS)
    assert reply.content == "looking"
    assert reply.tool_calls == (
        ToolCall("call-1-0", "lookup", {"number": "INV-7"}),
        ToolCall("call-1-1", "other", {}),
    )
    assert reply.usage == 42
    assert (reply.prompt_tokens, reply.completion_tokens, reply.model, reply.cut) == (
        21,
        21,
        "scripted-1",
        False,
    )


async def test_the_request_names_the_model_offers_the_tools_and_sends_the_key_as_a_bearer(
    http: httpx.AsyncClient,
) -> None:
    async with scripted_model(say("hi"), say("again")) as server:
        model = model_at(server, http)
        assert (await model.complete(HELLO, TOOLS)).content == "hi"
        await model.complete(HELLO)
    first, second = server.requests
    assert first == {"model": "scripted-1", "messages": HELLO, "tools": TOOLS}
    assert "tools" not in second  # no tools: none offered (some servers refuse an empty list)
    assert server.headers[0]["authorization"] == f"Bearer {KEY}"


async def test_an_assistant_reply_goes_back_into_the_conversation_as_openai_shapes_it(
    http: httpx.AsyncClient,
) -> None:
    async with scripted_model(call("lookup", {"number": "INV-7"})) as server:
        reply = await model_at(server, http).complete(HELLO, TOOLS)
    assert reply.as_message() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call-1-0",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"number": "INV-7"}'},
            }
        ],
    }


async def test_a_model_past_its_script_answers_500_which_is_llm_unavailable_and_retryable(
    http: httpx.AsyncClient,
) -> None:
    async with scripted_model() as server:
        error = await failure(model_at(server, http))
    assert error.retryable
    assert "answered HTTP 500" in error.message and "the script ran out" in error.message


async def test_a_5xx_body_that_echoes_the_key_is_quoted_without_it(http: httpx.AsyncClient) -> None:
    echo = Reply(status=503, body={"error": "upstream down", "request": {"authorization": f"Bearer {KEY}"}})
    async with scripted_model(echo) as server:
        error = await failure(model_at(server, http))
    assert error.retryable
    assert "HTTP 503" in error.message and "upstream down" in error.message


async def test_a_4xx_refusal_is_llm_unavailable_and_not_retryable(http: httpx.AsyncClient) -> None:
    async with scripted_model(Reply(status=401, body={"error": "bad key"})) as server:
        error = await failure(model_at(server, http))
    assert not error.retryable
    assert "refused the request (HTTP 401)" in error.message


async def test_tool_call_arguments_that_are_not_a_json_object_are_a_clear_error(
    http: httpx.AsyncClient,
) -> None:
    broken = Reply(tool_calls=(("lookup", '{"number": "INV-7"'),))
    async with scripted_model(broken, Reply(tool_calls=(("lookup", "[1, 2]"),))) as server:
        model = model_at(server, http)
        unparsed = await failure(model)
        not_object = await failure(model)
    assert "the arguments of its call to 'lookup' are not a JSON object" in unparsed.message
    assert '{"number": "INV-7"' in unparsed.message
    assert "not a JSON object: [1, 2]" in not_object.message


@pytest.mark.parametrize(
    ("body", "what"),
    [
        ({"id": "x", "object": "chat.completion"}, "it has no choices"),
        ({"choices": []}, "it has no choices"),
        ({"choices": [{"index": 0}]}, "its first choice has no message"),
        ({"choices": [{"message": {"tool_calls": [{"id": "c"}]}}]}, "a tool call has no function name"),
    ],
)
async def test_a_reply_that_is_not_a_chat_completion_names_what_is_missing(
    http: httpx.AsyncClient, body: object, what: str
) -> None:
    async with scripted_model(Reply(body=body)) as server:
        error = await failure(model_at(server, http))
    assert f"answered something that is not a chat completion: {what}" in error.message
    assert not error.retryable


async def test_an_endpoint_nobody_listens_on_is_llm_unavailable_and_retryable(
    http: httpx.AsyncClient,
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        model = ChatModel(f"http://127.0.0.1:{port}/v1", "m", KEY, http)
        error = await failure(model)
    assert error.retryable
    assert "could not be reached (ConnectError)" in error.message


async def test_a_model_slower_than_the_timeout_is_llm_unavailable_and_retryable(
    http: httpx.AsyncClient,
) -> None:
    hold = asyncio.Event()
    async with scripted_model(Reply(content="late", hold=hold)) as server:
        error = await failure(model_at(server, http, timeout_s=0.2))
        hold.set()
    assert error.retryable
    assert "did not answer within 0.2 s" in error.message


async def test_a_password_in_the_endpoints_url_is_not_in_a_message(http: httpx.AsyncClient) -> None:
    async with scripted_model() as server:
        url = server.base_url.replace("127.0.0.1", "user:s3cret-pass@127.0.0.1")
        error = await failure(ChatModel(url, "m", "", http))
    assert "s3cret-pass" not in error.message
    assert (
        server.headers[0].get("authorization", "").startswith("Basic ")
    )  # httpx sent it, to the server only


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ('{"a": 1}', {"a": 1}),
        ('```json\n{"a": 1}\n```', {"a": 1}),
        ('  ```\n{"a": [1, 2]}\n```  ', {"a": [1, 2]}),
        ("[1, 2]", None),
        ("The answer is 42.", None),
        ('Here it is: {"a": 1}', None),
    ],
)
def test_a_json_object_is_read_bare_or_fenced_and_nothing_else_is_one(text: str, found: object) -> None:
    assert json_object_of(text) == found


async def test_without_a_base_url_there_is_no_model_brain_or_planner(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    settings = ServiceSettings(service_id="s", key_file=tmp_path / "s.key", public_url="http://127.0.0.1:1")
    assert from_settings(settings, http) is None
    assert llm_brain(settings, http) is None
    assert llm_planner(settings, http, RegistryClient(settings, http)) is None
    configured = settings.model_copy(update={"llm_base_url": "http://127.0.0.1:1/v1", "llm_max_turns": 3})
    assert isinstance(from_settings(configured, http), ChatModel)
    assert llm_brain(configured, http) is not None
    assert llm_planner(configured, http, RegistryClient(configured, http)) is not None


async def test_a_429_is_llm_rate_limited_retryable_with_the_wait_it_asks_for(http: httpx.AsyncClient) -> None:
    async with scripted_model(rate_limited("7"), rate_limited(None)) as server:
        model = model_at(server, http)
        for expected in (7, None):
            with pytest.raises(FleetError) as caught:
                await model.complete(HELLO)
            error = caught.value
            assert (error.code, error.retryable, error.retry_after_s) == (
                ErrorCode.LLM_RATE_LIMITED,
                True,
                expected,
            )
            assert "slow down" in error.message and KEY not in error.message


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("12", 12),
        ("999999", MAX_RETRY_AFTER_S),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0),  # a date gone by: no wait
        ("soon", None),
        ("", None),
        (None, None),
    ],
)
def test_retry_after_is_read_as_seconds_or_a_date_and_bounded(
    header: str | None, seconds: int | None
) -> None:
    assert retry_after_s(header) == seconds


async def test_a_bound_on_the_answer_is_sent_as_max_tokens(http: httpx.AsyncClient) -> None:
    async with scripted_model(say("{}"), say("{}")) as server:
        model = model_at(server, http)
        await model.complete(HELLO, max_tokens=300)
        await model.complete(HELLO)
    assert server.requests[0]["max_tokens"] == 300 and "max_tokens" not in server.requests[1]
