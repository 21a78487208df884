"""The fleet's MCP client: every caller of an MCP server (a specialist's tools, a run's memory
consolidation, the CLI's memory commands, the tests) opens its sessions here, over Streamable HTTP
with the fleet's transport hooks (the caller's trace context on every request), a bearer token per
call or per client, and reads an error answer as the fleet's envelope."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
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


@dataclass
class Transit:
    """What went wrong in transit for the requests sent in a :func:`transit` block: the last
    transport error (a connection refused or cut, a timeout), which the request's caller otherwise
    sees only as the SDK's stand-in error."""

    error: httpx2.TransportError | None = None


_transit: contextvars.ContextVar[Transit | None] = contextvars.ContextVar("mcp_transit", default=None)


@contextlib.contextmanager
def transit() -> Any:
    """A :class:`Transit` record of the requests sent in this block (on an :func:`http_client`)."""
    record = Transit()
    reset = _transit.set(record)
    try:
        yield record
    finally:
        _transit.reset(reset)


class _Reporting(httpx2.AsyncBaseTransport):
    """The HTTP transport of MCP clients: a request that fails in transit is answered with a local
    502 (the SDK then fails that request alone; a transport error would end the whole session
    with every request in flight on it, which kept sessions share) and its error is kept in the
    sender's :class:`Transit`, so that the caller can tell a request that never left (a connection
    refused) from one that may have reached the server."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        record = _transit.get()
        try:
            response = await self._inner.handle_async_request(request)
        except httpx2.TransportError as exc:
            if record is not None:
                record.error = exc
            return httpx2.Response(
                502, headers={"content-type": "text/plain"}, text=str(exc), request=request
            )
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_ReportingStream(response.stream, record),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _CutInTransit(httpx2.StreamError):
    """An answer cut off while it was read (the SDK fails the request alone on a stream error)."""


class _ReportingStream(httpx2.AsyncByteStream):
    """An answer's body whose transport error is kept in the sender's :class:`Transit` and raised
    as a :class:`_CutInTransit`."""

    def __init__(self, inner: httpx2.AsyncByteStream, record: Transit | None) -> None:
        self._inner = inner
        self._record = record

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except httpx2.TransportError as exc:
            if self._record is not None:
                self._record.error = exc
            raise _CutInTransit(f"the answer was cut off: {exc}") from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


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
        headers=headers,
        auth=auth,
        timeout=timeout,
        transport=_Reporting(httpx2.AsyncHTTPTransport(verify=tls_context())),
        event_hooks=transport.hooks2(),
    )


@contextlib.asynccontextmanager
async def session(url: str, http: httpx2.AsyncClient) -> AsyncIterator[Client]:
    """An MCP session with the server at ``url`` (its ``/mcp`` endpoint) on ``http``."""
    async with Client(streamable_http_client(url, http_client=http)) as client:
        yield client


SESSION_MAX_AGE_S = 60.0  # how long a kept session (and the tool listing it validates with) is used
SESSIONS_KEPT = 64  # sessions one pool keeps open at most (one per server; the oldest idle one goes)
# A session left (dropped, aged out, or all closed) ends its SDK session; one whose close still waits
# on a request that never answers (its caller long gone) is cut after this long.
CLOSE_GRACE_S = 2.0


@dataclass(eq=False)
class _Kept:
    """One kept session: its client, the task that entered it (and must leave it), who uses it now."""

    key: tuple[str, str]
    opened_at: float
    ready: asyncio.Future[Client]
    done: asyncio.Event = field(default_factory=asyncio.Event)
    users: int = 0
    retired: bool = False
    task: asyncio.Task[None] | None = None


class Sessions:
    """MCP sessions kept open, one per server, on one HTTP client, so that a tool call is one request.

    A session of its own per call costs the server's handshake (``server/discover``, or
    ``initialize`` and its notification for an older server) and a ``tools/list`` that the SDK sends
    to validate the result against the tool's output schema, each a request the server
    authenticates and serves: three or four requests for one call. A kept session pays them once. The
    servers are stateless (no session id, nothing held for a caller), and each request's bearer is
    read when it is sent, from the caller's context (the HTTP client's ``auth``): a session
    serves every caller of the process with each one's own token.

    A session is used for at most ``SESSION_MAX_AGE_S`` (its tool listing, which output is
    validated against, is as old as that at most), is keyed by the server's registration too (a
    server registered again gets a new one), and is dropped after any failure of a call on it (the
    next call opens a new one); one in use when it is dropped is closed when its last call ends."""

    def __init__(self, http: httpx2.AsyncClient, *, kept: int = SESSIONS_KEPT) -> None:
        self._http = http
        self._kept_max = kept
        self._kept: dict[tuple[str, str], _Kept] = {}
        self._holding: set[asyncio.Task[None]] = set()  # every session's task, dropped ones' too
        self._closed = False

    @contextlib.asynccontextmanager
    async def session(self, url: str, *, revision: str = "") -> AsyncGenerator[Client, None]:
        """A session with the server at ``url`` (registered as ``revision``); opening one may raise
        before any tool request is sent. A failure in the block drops the session."""
        kept = await self._acquire(url, revision)
        try:
            yield kept.ready.result()
        except BaseException:
            self._retire(kept)
            raise
        finally:
            kept.users -= 1
            if kept.retired and kept.users == 0:
                self._release(kept)

    async def _acquire(self, url: str, revision: str) -> _Kept:
        if self._closed:
            raise RuntimeError("these MCP sessions are closed")
        key = (url, revision)
        kept = self._kept.get(key)
        if kept is not None and time.monotonic() - kept.opened_at > SESSION_MAX_AGE_S:
            self._retire(kept)
            kept = None
        if kept is None:
            kept = self._open(key)
        kept.users += 1
        try:
            await asyncio.shield(kept.ready)
        except BaseException:
            kept.users -= 1
            self._retire(kept)
            raise
        return kept

    def _open(self, key: tuple[str, str]) -> _Kept:
        while len(self._kept) >= self._kept_max:
            idle = [k for k in self._kept.values() if k.users == 0]
            self._retire(min(idle or self._kept.values(), key=lambda k: k.opened_at))
        kept = _Kept(key, time.monotonic(), asyncio.get_running_loop().create_future())
        # the session is entered and left in a task of its own: other callers' tasks use it between
        kept.task = asyncio.create_task(self._hold(kept), name=f"mcp-session {key[0]}")
        self._holding.add(kept.task)
        kept.task.add_done_callback(self._holding.discard)
        self._kept[key] = kept
        return kept

    async def _hold(self, kept: _Kept) -> None:
        try:
            async with session(kept.key[0], self._http) as client:
                kept.ready.set_result(client)
                await kept.done.wait()
        except BaseException as exc:
            if not kept.ready.done():
                kept.ready.set_exception(exc)
                kept.ready.exception()  # read here: a caller may have gone before it
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _retire(self, kept: _Kept) -> None:
        if self._kept.get(kept.key) is kept:
            del self._kept[kept.key]
        kept.retired = True
        if kept.users == 0:
            self._release(kept)

    @staticmethod
    def _release(kept: _Kept) -> None:
        """End the session: its task leaves the SDK session, or is cancelled after
        ``CLOSE_GRACE_S`` if that waits on a request in flight (a hung server's)."""
        if kept.done.is_set():
            return
        kept.done.set()
        if kept.task is not None:
            task = kept.task
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, lambda: task.done() or task.cancel())

    async def aclose(self) -> None:
        """Close every session, the dropped ones still in use too (after the calls in flight on
        them end; one whose close waits on a request that never answers is cut after
        ``CLOSE_GRACE_S``)."""
        self._closed = True
        for kept in list(self._kept.values()):
            self._retire(kept)
        if self._holding:
            await asyncio.gather(*self._holding, return_exceptions=True)


_bearer: contextvars.ContextVar[str | None] = contextvars.ContextVar("mcp_bearer", default=None)


class ContextBearer(httpx2.Auth):
    """Each request's bearer from the context it is sent in (:func:`bearer`), so that one client
    and its kept sessions serve callers with tokens of their own."""

    async def async_auth_flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        token = _bearer.get()
        if token is None:
            raise httpx2.HTTPError("no bearer token for this MCP request")
        request.headers["Authorization"] = f"Bearer {token}"
        yield request


@contextlib.contextmanager
def bearer(token: str) -> Any:
    """Requests sent in this block (on a :class:`ContextBearer` client) carry ``token``."""
    reset = _bearer.set(token)
    try:
        yield
    finally:
        _bearer.reset(reset)


async def call_tool(
    url: str,
    tool: str,
    arguments: dict[str, Any],
    *,
    token: str,
    http_timeout: float | httpx2.Timeout = DEFAULT_TIMEOUT,
) -> CallToolResult:
    """One call of ``tool`` at the server at ``url`` with ``token``, in a session of its own
    (``http_timeout``: of each HTTP request of the session). A request that failed in transit
    raises its transport error (e.g. :class:`httpx2.ConnectError`)."""
    with transit() as record:
        try:
            async with http_client(token=token, timeout=http_timeout) as http, session(url, http) as client:
                return await client.call_tool(tool, arguments)
        except Exception as exc:
            if record.error is not None:
                raise record.error from exc
            raise


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


__all__ = [
    "DEFAULT_TIMEOUT",
    "ContextBearer",
    "Sessions",
    "Transit",
    "bearer",
    "call_tool",
    "http_client",
    "session",
    "structured",
    "tls_context",
    "transit",
]
