"""The abuse benchmark counts what an attack got back from the answer itself: status, every error
code the body carries (the fleet's, a JSON-RPC code, both), Retry-After, a tool error's code, and the
first cause of a failure; codes it has never seen are counted like any other."""

from __future__ import annotations

import json

import httpx
from mcp.types import CallToolResult, TextContent

from bench.abuse import failure_outcome, http_outcome, tool_outcome


def answer(status: int, body: str, **headers: str) -> str:
    return http_outcome(httpx.Response(status, text=body, headers=headers), body)


def test_a_refusal_is_counted_by_its_status_its_code_and_retry_after() -> None:
    body = '{"error": {"code": "some_new_limit", "message": "too much"}}'
    assert answer(429, body, **{"Retry-After": "3"}) == "http 429 some_new_limit (Retry-After)"
    assert answer(413, body) == "http 413 some_new_limit"


def test_a_json_rpc_error_is_counted_by_its_code_and_the_fleet_code_in_its_data() -> None:
    body = '{"jsonrpc": "2.0", "id": 1, "error": {"code": -32700, "message": "x", "data": {"code": "parse"}}}'
    assert answer(200, body) == "http 200 -32700 parse"
    assert answer(200, '{"jsonrpc": "2.0", "id": 1, "result": {}}') == "http 200"


def test_the_code_an_a2a_error_carries_as_error_info_metadata_is_counted() -> None:
    info = {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "metadata": {"code": "a_new_limit"}}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "error": {"code": -32603, "message": "x", "data": [info]}})
    assert answer(200, body) == "http 200 -32603 a_new_limit"


def test_an_answer_that_is_not_json_is_counted_by_its_status() -> None:
    assert answer(502, "<html>bad gateway</html>") == "http 502"


def test_a_tool_error_is_counted_by_the_code_the_tool_put_in_its_message() -> None:
    failed = CallToolResult(
        content=[TextContent(type="text", text="Error executing tool query: [brand_new_code] no")],
        is_error=True,
    )
    assert tool_outcome(failed) == "tool error brand_new_code"
    assert tool_outcome(CallToolResult(content=[], is_error=False)) == "ok"


def test_a_failure_is_counted_by_its_first_cause() -> None:
    assert failure_outcome(ExceptionGroup("task group", [TimeoutError()])) == "no answer by its deadline"
    assert failure_outcome(httpx.ReadError("reset")) == "exception ReadError"
