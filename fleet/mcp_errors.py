"""A :class:`~fleet.errors.FleetError` on the MCP wire, both ways.

A fleet MCP server answers a refused or failed tool call with an MCP error result
(``isError: true``) whose structured content is ``{"error": <envelope>}`` and whose one text part is
the message (for a person or a model reading it), never the code. A client reads the error back with
:func:`error_of`; a server that is not the fleet's, answering text only, reads as ``tool_failed``
with its text as the message.
"""

from __future__ import annotations

from mcp.types import CallToolResult, TextContent

from fleet.errors import ErrorCode, FleetError


def error_result(error: FleetError) -> CallToolResult:
    """The MCP answer to a tool call that ``error`` ended."""
    return CallToolResult(
        content=[TextContent(type="text", text=error.message)],
        structured_content={"error": error.to_dict()},
        is_error=True,
    )


def error_of(result: CallToolResult) -> FleetError | None:
    """The error a tool call was answered with, or None for a successful answer."""
    if not result.is_error:
        return None
    envelope = (result.structured_content or {}).get("error")
    if isinstance(envelope, dict) and "code" in envelope:
        return FleetError.from_dict(envelope, fallback=ErrorCode.TOOL_FAILED)
    text = " ".join(getattr(part, "text", "") for part in result.content).strip()
    return FleetError(ErrorCode.TOOL_FAILED, text or "the tool failed and said nothing")


def fleet_error_in(exc: BaseException) -> FleetError | None:
    """The FleetError ``exc`` is or wraps (the MCP SDK wraps what a tool raises), if any."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 8:
        if isinstance(current, FleetError):
            return current
        current, seen = current.__cause__, seen + 1
    return None
