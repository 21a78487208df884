"""MCP sessions kept per server (``fleet.mcp_client.Sessions``) against a real MCP server of the SDK:
a call on a kept session is one request carrying its own caller's bearer; a failure drops the
session (the next call opens another, and the calls in flight on the old one finish); a session
is not used past its age; a server registered again gets a session of its own; closing waits for
the calls in flight."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet import mcp_client
from fleetctl.testing.serving import serving


@dataclass
class Seen:
    methods: Counter[str] = field(default_factory=Counter)
    bearers: list[str] = field(default_factory=list)  # of each tools/call, in order
    started: asyncio.Event = field(default_factory=asyncio.Event)  # the slow tool is running
    release: asyncio.Event = field(default_factory=asyncio.Event)


def _recording(app: ASGIApp, seen: Seen) -> ASGIApp:
    """The app behind a recorder of each request's JSON-RPC method and (for calls) bearer."""

    async def record(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        method = json.loads(body).get("method", "?") if body else scope["method"]
        seen.methods[method] += 1
        if method == "tools/call":
            headers = dict(scope["headers"])
            seen.bearers.append(headers.get(b"authorization", b"").decode())

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        await app(scope, replay, send)

    return record


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()
    mcp = MCPServer("kept")

    @mcp.tool()
    async def echo(value: str) -> dict[str, Any]:
        """Answers its argument."""
        return {"value": value}

    @mcp.tool()
    async def slow(value: str) -> dict[str, Any]:
        """Answers once the test lets it."""
        seen.started.set()
        await seen.release.wait()
        return {"value": value}

    app = mcp.streamable_http_app(stateless_http=True, json_response=True)
    async with serving(_recording(app, seen)) as url:
        yield url + "/mcp", seen


@pytest.fixture
async def sessions() -> AsyncIterator[mcp_client.Sessions]:
    async with httpx2.AsyncClient(auth=mcp_client.ContextBearer()) as http:
        kept = mcp_client.Sessions(http)
        yield kept
        await kept.aclose()


async def _call(sessions: mcp_client.Sessions, url: str, token: str, value: str, tool: str = "echo") -> Any:
    with mcp_client.bearer(token):
        async with sessions.session(url) as client:
            return mcp_client.structured(await client.call_tool(tool, {"value": value}))


async def test_calls_on_a_kept_session_are_one_request_each_with_their_own_bearer(
    server: tuple[str, Seen], sessions: mcp_client.Sessions
) -> None:
    url, seen = server
    assert await _call(sessions, url, "t0", "first") == {"value": "first"}
    seen.methods.clear()
    seen.bearers.clear()
    answers = await asyncio.gather(*(_call(sessions, url, f"t{i}", str(i)) for i in range(1, 9)))
    assert answers == [{"value": str(i)} for i in range(1, 9)]
    assert seen.methods == Counter({"tools/call": 8})
    assert sorted(seen.bearers) == sorted(f"Bearer t{i}" for i in range(1, 9))


async def test_a_call_with_no_bearer_in_its_context_sends_nothing(
    server: tuple[str, Seen], sessions: mcp_client.Sessions
) -> None:
    url, seen = server
    await _call(sessions, url, "t0", "first")
    seen.methods.clear()
    with pytest.raises(MCPError):  # the transport's error for a request it could not send
        async with sessions.session(url) as client:
            await client.call_tool("echo", {"value": "x"})
    assert seen.methods == Counter()
    assert await _call(sessions, url, "t1", "again") == {"value": "again"}  # on a new session


async def test_a_failure_drops_the_session_and_calls_in_flight_on_it_still_finish(
    server: tuple[str, Seen], sessions: mcp_client.Sessions
) -> None:
    url, seen = server
    in_flight = asyncio.create_task(_call(sessions, url, "t1", "slow", tool="slow"))
    await seen.started.wait()
    with pytest.raises(RuntimeError, match="cut"):  # a failure in a call's block (e.g. a cut connection)
        async with sessions.session(url):
            raise RuntimeError("cut")
    handshakes = seen.methods["server/discover"]
    assert await _call(sessions, url, "t2", "after") == {"value": "after"}
    assert seen.methods["server/discover"] == handshakes + 1  # a new session for the next call
    seen.release.set()
    assert await in_flight == {"value": "slow"}  # the dropped session served its call to the end


async def test_a_session_is_not_used_past_its_age_and_a_server_registered_again_gets_its_own(
    server: tuple[str, Seen], sessions: mcp_client.Sessions, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = server
    await _call(sessions, url, "t", "a")
    await _call(sessions, url, "t", "b")
    assert seen.methods["server/discover"] == 1
    with mcp_client.bearer("t"):
        async with sessions.session(url, revision="registered-again") as client:
            await client.call_tool("echo", {"value": "c"})
    assert seen.methods["server/discover"] == 2
    monkeypatch.setattr(mcp_client, "SESSION_MAX_AGE_S", 0.0)
    await _call(sessions, url, "t", "d")
    assert seen.methods["server/discover"] == 3


async def test_closing_waits_for_the_calls_in_flight_and_then_refuses_new_ones(
    server: tuple[str, Seen],
) -> None:
    url, seen = server
    async with httpx2.AsyncClient(auth=mcp_client.ContextBearer()) as http:
        sessions = mcp_client.Sessions(http)
        in_flight = asyncio.create_task(_call(sessions, url, "t", "slow", tool="slow"))
        await seen.started.wait()
        closing = asyncio.create_task(sessions.aclose())
        await asyncio.sleep(0.05)
        assert not closing.done()
        seen.release.set()
        assert await in_flight == {"value": "slow"}
        await closing
        with pytest.raises(RuntimeError, match="closed"):
            await _call(sessions, url, "t", "late")


async def test_a_server_that_cannot_be_reached_fails_the_call_and_is_tried_afresh_next_time(
    sessions: mcp_client.Sessions,
) -> None:
    with pytest.raises(Exception):  # noqa: B017 - the transport's own error type
        await _call(sessions, "http://127.0.0.1:1/mcp", "t", "x")
    with pytest.raises(Exception):  # noqa: B017
        await _call(sessions, "http://127.0.0.1:1/mcp", "t", "x")
    assert sessions._kept == {}  # nothing kept for a server that never answered


async def test_closing_waits_for_a_dropped_session_still_in_use(server: tuple[str, Seen]) -> None:
    url, seen = server
    async with httpx2.AsyncClient(auth=mcp_client.ContextBearer()) as http:
        sessions = mcp_client.Sessions(http)
        in_flight = asyncio.create_task(_call(sessions, url, "t", "slow", tool="slow"))
        await seen.started.wait()
        with pytest.raises(RuntimeError, match="cut"):  # drops the session the slow call is on
            async with sessions.session(url):
                raise RuntimeError("cut")
        closing = asyncio.create_task(sessions.aclose())
        await asyncio.sleep(0.05)
        assert not closing.done()  # the dropped session is still serving a call
        seen.release.set()
        assert await in_flight == {"value": "slow"}
        await asyncio.wait_for(closing, 10)


async def test_a_session_its_caller_gave_up_on_does_not_hold_the_close() -> None:
    """A server that takes the connection and never answers (hung): the caller's timeout ends its
    call while the session is still opening, and the session's task, still waiting on the
    handshake, is cut after CLOSE_GRACE_S, not left to the HTTP read timeout (a shutdown of a
    toolbox waited 130 s on one)."""
    held: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    hung = await asyncio.start_server(hang, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}/mcp"
    try:
        async with httpx2.AsyncClient(auth=mcp_client.ContextBearer(), timeout=600) as http:
            sessions = mcp_client.Sessions(http)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await _call(sessions, url, "t", "hung")
            started = asyncio.get_running_loop().time()
            await asyncio.wait_for(sessions.aclose(), 60)
            assert asyncio.get_running_loop().time() - started <= mcp_client.CLOSE_GRACE_S + 1.0
    finally:
        for writer in held:
            writer.close()
        hung.close()
        await hung.wait_closed()
