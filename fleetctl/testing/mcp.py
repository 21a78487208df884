"""Helpers for tests of MCP tools: a tool called over MCP on a running stack with a given token, a
line a service wrote to its log, and the in-process tier: a real MCP server, built with its real
dependencies (a Postgres, the Rego engine), called through the SDK's in-memory client as a caller
whose token would have verified as given claims, with no stack, no HTTP and no registry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fleet import mcp_client
from fleet.errors import FleetError
from fleet.mcp_errors import error_of
from fleet.mcp_inprocess import calling_as, claims_for, in_process
from fleetctl.testing.e2e import Stack


async def call(
    stack: Stack, server: str, token: str, tool: str, arguments: dict[str, Any], *, timeout_s: float = 60
) -> Any:
    """One MCP tool call to ``server`` of ``stack`` over Streamable HTTP, with ``token``."""
    return await mcp_client.call_tool(
        stack.endpoints["mcp_servers"][server], tool, arguments, token=token, http_timeout=timeout_s
    )


def ok(result: Any) -> dict[str, Any]:
    """A successful tool result's structured content (unwrapped from ``result`` if it is only that)."""
    assert not result.is_error, result.content
    structured: dict[str, Any] = result.structured_content
    return structured.get("result", structured) if set(structured) == {"result"} else structured


async def logged_in(paths: Iterable[Path] | None, what: str, *needles: str, timeout_s: float = 15.0) -> str:
    """The first line of the log files ``paths`` that has every one of ``needles``, waiting up to
    ``timeout_s`` for it to be written (``what`` names the logs in the failure)."""
    files = list(paths or ())
    deadline = time.monotonic() + timeout_s
    while True:
        for path in files:
            for line in path.read_text(errors="replace").splitlines():
                if all(needle in line for needle in needles):
                    return line
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} logged no line with {needles}")
        await asyncio.sleep(0.1)  # a log file another process appends to: nothing to wait on


async def logged(stack: Stack, service: str, *needles: str, timeout_s: float = 15.0) -> str:
    """The line of ``service``'s log that has every one of ``needles`` (waiting for it)."""
    return await logged_in([stack.layout.log_file(service)], service, *needles, timeout_s=timeout_s)


def error_in(result: Any) -> FleetError:
    """The error a tool call was answered with, read from the answer's envelope (the test fails if
    the call succeeded)."""
    error = error_of(result)
    assert error is not None, result.structured_content
    return error


__all__ = ["call", "calling_as", "claims_for", "error_in", "in_process", "logged", "logged_in", "ok"]
