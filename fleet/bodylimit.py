"""The request body cap every service applies (``serve_app`` installs it in front of the app).

A body declared larger than the cap (``Content-Length``) is refused before the app runs. A body
without a declared length (chunked) is counted as the app reads it; at the first byte over the cap
the app's read fails with :class:`BodyTooLarge`, whatever the app answers is dropped, and the caller
gets the 413 instead. No more than the cap is ever handed to the app. Refusals carry the code
``body_too_large``: a fleet error body on HTTP APIs, a JSON-RPC error on the paths that speak JSON-RPC
(A2A, MCP).

After the refusal the rest of the body is read and discarded, so that a client that sends its whole
body before it reads gets the 413 rather than a broken pipe; but only :data:`DRAIN_BYTES` of it, for
at most :data:`DRAIN_S`, and then the connection is closed (the refusal says ``Connection: close``).
Left to itself the HTTP server would go on reading a body whose length is declared in petabytes, or
a chunked one that never ends, for as long as the caller sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.errors import PROBLEM_MEDIA_TYPE, ErrorCode, FleetError

log = logging.getLogger(__name__)

JSONRPC_INVALID_REQUEST = -32600
DRAIN_BYTES = 16 * 1024 * 1024  # of a refused body, read and discarded before the connection closes
DRAIN_S = 10.0  # and for at most this long


@dataclass(frozen=True, slots=True)
class BodyLimit:
    """At most ``max_bytes`` of request body on paths under ``prefix``; ``jsonrpc``: the path speaks
    JSON-RPC, so a refusal is a JSON-RPC error."""

    prefix: str
    max_bytes: int
    jsonrpc: bool = False


class BodyTooLarge(HTTPException):
    """Raised by the capped ``receive`` at the first byte over the cap. An ``HTTPException`` 413, so
    that apps that handle those (Starlette, the a2a-sdk's dispatcher) answer without a traceback."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body exceeds {max_bytes} bytes")


class BodySizeLimit:
    """ASGI middleware: caps request bodies at ``default_bytes``, or at the first of ``routes``
    whose prefix the path starts with."""

    def __init__(self, app: ASGIApp, default_bytes: int, routes: Sequence[BodyLimit] = ()) -> None:
        self._app = app
        self._default = BodyLimit("/", default_bytes)
        self._routes = tuple(routes)

    def limit_for(self, path: str) -> BodyLimit:
        return next((r for r in self._routes if path.startswith(r.prefix)), self._default)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit.max_bytes:
            await _refuse(scope, receive, send, limit, declared)
            return
        await _Capped(self._app, limit).run(scope, receive, send)


class _Capped:
    """One request whose body is counted while the app reads it."""

    def __init__(self, app: ASGIApp, limit: BodyLimit) -> None:
        self._app = app
        self._limit = limit
        self._received = 0
        self._over = False
        self._started = False

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def capped_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                self._received += len(message.get("body", b""))
                if self._received > self._limit.max_bytes:
                    self._over = True
                    raise BodyTooLarge(self._limit.max_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            if self._over:
                return  # the app's answer to the failed read; the refusal below replaces it
            self._started = True
            await send(message)

        with contextlib.suppress(BodyTooLarge):  # raised by our receive, not handled by the app
            await self._app(scope, capped_receive, guarded_send)
        if self._over and not self._started:
            await _refuse(scope, receive, send, self._limit, self._received)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length before the app sees it
    return None


async def _refuse(scope: Scope, receive: Receive, send: Send, limit: BodyLimit, seen: int) -> None:
    """Answer 413, then read and drop what comes of the body, within the drain's bounds, before the
    answer ends and the server closes the connection. The answer's bytes are all sent first: a
    caller that reads while it sends has it at once."""
    error = FleetError(
        ErrorCode.BODY_TOO_LARGE,
        f"the request body exceeds {limit.max_bytes} bytes",
        details={"max_bytes": limit.max_bytes},
    )
    log.warning(
        "%s %s refused (%s): %d bytes or more, the cap is %d; client=%s principal=%s",
        scope.get("method", "-"),
        scope["path"],
        error.code,
        seen,
        limit.max_bytes,
        _client(scope),
        _principal(scope),
    )
    if limit.jsonrpc:
        body: dict[str, object] = {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": JSONRPC_INVALID_REQUEST, "message": error.message, "data": error.to_dict()},
        }
    else:
        body = error.problem()
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json" if limit.jsonrpc else PROBLEM_MEDIA_TYPE.encode()),
        (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    await _drain(receive)
    await send({"type": "http.response.body", "body": b""})


async def _drain(receive: Receive) -> None:
    """Read and drop the body until it ends, DRAIN_BYTES have come, or DRAIN_S have passed."""
    drained = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            while drained < DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                drained += len(message.get("body", b""))


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _principal(scope: Scope) -> str:
    """``tenant/subject`` when an auth middleware already verified the caller, else ``-``."""
    claims = scope.get("state", {}).get("claims")
    tenant, sub = getattr(claims, "tenant", None), getattr(claims, "sub", None)
    return f"{tenant}/{sub}" if tenant and sub else "-"


__all__ = ["BodyLimit", "BodySizeLimit", "BodyTooLarge"]
