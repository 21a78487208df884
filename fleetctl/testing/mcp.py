"""Helpers for tests of MCP tools: a tool called over MCP on a running stack with a given token, a
line a service wrote to its log, and the in-process tier: a real MCP server, built with its real
dependencies (a Postgres, the Rego engine), called through the SDK's in-memory client as a caller
whose token would have verified as given claims, with no stack, no HTTP and no registry."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.auth.middleware.auth_context import auth_context_var
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import MCPServer

from fleet.errors import FleetError
from fleet.mcp_errors import error_of
from fleet.tokens import Claims
from fleetctl.testing.e2e import Stack


async def call(
    stack: Stack, server: str, token: str, tool: str, arguments: dict[str, Any], *, timeout_s: float = 60
) -> Any:
    """One MCP tool call to ``server`` of ``stack`` over Streamable HTTP, with ``token``."""
    url = stack.endpoints["mcp_servers"][server]
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        return await client.call_tool(tool, arguments)


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


def claims_for(
    sub: str,
    tenant: str,
    scopes: Iterable[str],
    *,
    audience: str = "mcp-test",
    run_id: str | None = "run-7",
    act: str | None = None,
) -> Claims:
    """The claims a verified token of ``sub`` in ``tenant`` would carry (``act``: the agent that
    passed the caller's token on, RFC 8693; ``run_id``: the run it was issued for)."""
    raw = {"sub": sub, "tenant": tenant, "run_id": run_id, **({"act": {"sub": act}} if act else {})}
    return Claims(
        sub=sub,
        tenant=tenant,
        audience=audience,
        scopes=frozenset(scopes),
        jti=uuid.uuid4().hex,
        expires_at=int(time.time()) + 300,
        raw=raw,
    )


@contextlib.contextmanager
def calling_as(claims: Claims) -> Iterator[None]:
    """What the MCP SDK's bearer-auth middleware sets for a request whose token verified as
    ``claims``: the tools' :func:`mcp_servers._base.current_claims` reads them from here."""
    token = AccessToken(
        token="t", client_id=claims.sub, scopes=sorted(claims.scopes), claims={"fleet_claims": claims}
    )
    reset = auth_context_var.set(AuthenticatedUser(token))
    try:
        yield
    finally:
        auth_context_var.reset(reset)


@contextlib.asynccontextmanager
async def in_process(server: MCPServer, claims: Claims) -> AsyncIterator[Client]:
    """An MCP client of ``server`` in this process (the SDK's in-memory transport) whose every call
    is made as ``claims``. The server runs as it would behind HTTP, its gate and its policy
    included; only the token check is left out (the claims are given as verified)."""
    with calling_as(claims):  # the server's tasks start inside: they carry the caller
        async with Client(server) as client:
            yield client
