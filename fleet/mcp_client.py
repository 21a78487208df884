"""The fleet's MCP client: every caller of an MCP server (a specialist's tools, a run's memory
consolidation, the CLI's memory commands, the tests) opens its sessions here, over Streamable HTTP
with the fleet's transport hooks (the caller's trace context on every request), a bearer token per
call or per client, and reads an error answer as the fleet's envelope."""

from __future__ import annotations

import contextlib
import functools
import os
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult

from fleet import transport
from fleet.mcp_errors import error_of

DEFAULT_TIMEOUT = httpx2.Timeout(30.0, read=120.0)


@functools.lru_cache(maxsize=4)
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    """The TLS context of the process's clients for what ``SSL_CERT_FILE``/``SSL_CERT_DIR`` name
    (httpx2 reads them): made once, not per client. Making one reads and parses the trusted
    certificates, some 10-25 ms of CPU, which a client per call paid each time."""
    return httpx2.create_ssl_context()


def tls_context() -> ssl.SSLContext:
    """The process's TLS context for HTTP clients, as the environment names the trusted CAs now."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


def http_client(
    *,
    token: str | None = None,
    auth: httpx2.Auth | None = None,
    timeout: float | httpx2.Timeout = DEFAULT_TIMEOUT,
) -> httpx2.AsyncClient:
    """The HTTP client MCP sessions run on: a bearer ``token`` for every request, or an ``auth``
    flow that picks each request's (a specialist's calls carry their caller's)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else None
    return httpx2.AsyncClient(
        headers=headers, auth=auth, timeout=timeout, verify=tls_context(), event_hooks=transport.hooks2()
    )


@contextlib.asynccontextmanager
async def session(url: str, http: httpx2.AsyncClient) -> AsyncIterator[Client]:
    """An MCP session with the server at ``url`` (its ``/mcp`` endpoint) on ``http``."""
    async with Client(streamable_http_client(url, http_client=http)) as client:
        yield client


async def call_tool(
    url: str,
    tool: str,
    arguments: dict[str, Any],
    *,
    token: str,
    http_timeout: float | httpx2.Timeout = DEFAULT_TIMEOUT,
) -> CallToolResult:
    """One call of ``tool`` at the server at ``url`` with ``token``, in a session of its own
    (``http_timeout``: of each HTTP request of the session)."""
    async with http_client(token=token, timeout=http_timeout) as http, session(url, http) as client:
        return await client.call_tool(tool, arguments)


def structured(result: CallToolResult) -> Any:
    """A successful result's structured content (a ``{"result": ...}`` wrapper unwrapped), or the
    :class:`~fleet.errors.FleetError` the server answered with, raised."""
    error = error_of(result)
    if error is not None:
        raise error
    content: Any = result.structured_content or {}
    return (
        content.get("result", content)
        if isinstance(content, dict) and set(content) == {"result"}
        else content
    )


__all__ = ["DEFAULT_TIMEOUT", "call_tool", "http_client", "session", "structured", "tls_context"]
