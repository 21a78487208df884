"""The MCP server kit's cap on one tool result: a larger answer is refused with a stable code."""

from __future__ import annotations

from mcp.types import CallToolResult, TextContent

from fleet.errors import ErrorCode
from fleet.mcp_errors import error_of
from mcp_servers._base import READ_ONLY, TracedMCPServer


def _server(cap: int | None) -> TracedMCPServer:
    mcp = TracedMCPServer("capped", "mcp-capped", max_result_bytes=cap)

    @mcp.tool(annotations=READ_ONLY)
    async def echo(n: int) -> dict[str, str]:
        """``n`` characters."""
        return {"text": "x" * n}

    return mcp


async def test_a_tool_result_larger_than_the_cap_is_refused_with_result_too_large() -> None:
    mcp = _server(64 * 1024)
    small = await mcp.call_tool("echo", {"n": 1000})
    assert isinstance(small, CallToolResult) and not small.is_error
    assert small.structured_content == {"text": "x" * 1000}
    refused = await mcp.call_tool("echo", {"n": 1024 * 1024})
    assert isinstance(refused, CallToolResult) and refused.is_error
    [content] = refused.content
    assert isinstance(content, TextContent)
    assert content.text.startswith("the result of echo has ")  # the message, for a person or a model
    error = error_of(refused)  # the code, as data
    assert error is not None and error.code == ErrorCode.RESULT_TOO_LARGE and not error.retryable
    assert error.details == {"bytes": error.details["bytes"], "max_bytes": 65536}
    assert "more than the 65536 this server answers" in error.message
    assert len(refused.model_dump_json()) < 1000


async def test_a_server_without_a_cap_answers_in_full() -> None:
    result = await _server(None).call_tool("echo", {"n": 1024 * 1024})
    assert isinstance(result, CallToolResult) and not result.is_error
