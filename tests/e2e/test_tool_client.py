"""The tool plane's client (``specialists.kit.Toolbox.call``) against a real MCP server, registered with
the running stack's registry and reached through a real TCP proxy that breaks calls on purpose: a
token the server refuses is renewed once; a call cut in transit is made again only when that is
safe (the tool is idempotent or read-only, or the call cannot have reached it); a tool's error
answer is never repeated."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from mcp.server.auth.provider import AccessToken
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from starlette.applications import Starlette

from deploy.enrollment import enrollment_token
from deploy.local_stack import ServiceKind, ServiceSpec
from fleet.errors import ErrorCode
from fleet.keys import SigningKey
from fleet.service import Readiness
from fleet.settings import ServiceSettings
from fleetctl.testing.e2e import Stack
from mcp_servers._base import MCP_PATH, RegistryTokenVerifier, auth_settings, build_app, declared_tools
from registry import RegistryClient
from specialists.kit import OutcomeUnknown, SkillError, Toolbox, mcp_http_client

pytestmark = pytest.mark.e2e

SCOPE = "flaky:call"
OTHER_SCOPE = "flaky:other"  # declared by a tool the client is not enrolled for: not in its catalog
TENANT = "acme"


class Proxy:
    """A TCP proxy in front of the MCP server that breaks the next ``tools/call`` requests as
    ``faults`` says: ``"drop"`` forwards the request, lets the server answer, and cuts the
    connection before the answer reaches the client (the tool ran; its outcome is lost); ``"503"``
    answers as a gateway whose upstream is away, without forwarding (the tool did not run).
    :meth:`pause` stops it listening (connections are refused) until :meth:`resume`; :meth:`hang`
    keeps the port but never answers (connections are made and then wait)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.faults: list[str] = []
        self.methods: Counter[str] = Counter()  # the JSON-RPC methods of the requests it forwarded
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._silent: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def resume(self) -> None:
        if self._silent is not None:
            self._silent.close()
            self._silent = None
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def hang(self) -> None:
        await self.pause()
        self._silent = socket.socket()
        self._silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._silent.bind(("127.0.0.1", self.port))
        self._silent.listen(64)  # the kernel completes connections; nobody ever reads them

    async def pause(self) -> None:
        if self._silent is not None:
            self._silent.close()
            self._silent = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    async def _serve(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        upstream_in, upstream_out = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._open.update((client_out, upstream_out))
        cut = asyncio.Event()  # the next answer from upstream is not to reach the client

        async def requests() -> None:
            while True:
                head = await client_in.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = await client_in.readexactly(length)
                with contextlib.suppress(ValueError, AttributeError):
                    self.methods[json.loads(body).get("method", "?")] += 1
                fault = self.faults.pop(0) if b'"tools/call"' in body and self.faults else None
                if fault == "503":
                    client_out.write(
                        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
                        b"content-length: 11\r\n\r\nunavailable"
                    )
                    await client_out.drain()
                    continue
                if fault == "drop":
                    cut.set()
                upstream_out.write(head + body)
                await upstream_out.drain()

        async def answers() -> None:
            while data := await upstream_in.read(65536):
                if cut.is_set():
                    client_out.transport.abort()
                    return
                client_out.write(data)
                await client_out.drain()

        try:
            await asyncio.gather(requests(), answers())
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            for writer in (client_out, upstream_out):
                self._open.discard(writer)
                writer.transport.abort()


class Gate(RegistryTokenVerifier):
    """The server's real token verifier, which the test can make refuse tokens (as a server does
    once a token's key is revoked or rotated away): a refused token is a 401."""

    def __init__(self, registry: RegistryClient, audience: str) -> None:
        super().__init__(registry, audience)
        self.refuse: set[str] = set()
        self.refuse_all = False
        self.refused: list[str] = []
        self.accepted: list[str] = []

    async def verify_token(self, token: str) -> AccessToken | None:
        if self.refuse_all or token in self.refuse:
            self.refused.append(token)
            return None
        found = await super().verify_token(token)
        if found is not None:
            self.accepted.append(token)
        return found


@dataclass
class World:
    server_id: str
    toolbox: Toolbox
    client: RegistryClient
    proxy: Proxy
    gate: Gate
    ran: Counter[str] = field(default_factory=Counter)  # tool -> times its effect happened

    async def call(self, tool: str, timeout_s: float | None = 20.0, **arguments: Any) -> dict[str, Any]:
        return await self.toolbox.call(
            self.server_id, tool, arguments, tenant=TENANT, scopes=[SCOPE], timeout_s=timeout_s
        )


def _settings(
    stack: Stack, tmp: Path, identity: str, kind: ServiceKind, scopes: tuple[str, ...], url: str
) -> ServiceSettings:
    """The settings of a new identity, with an enrollment token for ``scopes``."""
    operator = SigningKey.load_or_create(stack.layout.key_file("operator"))
    spec = ServiceSpec(identity, kind, "x:y", scopes=scopes)
    return ServiceSettings(
        service_id=identity,
        key_file=tmp / f"{identity}.key",
        public_url=url,
        registry_url=stack.endpoints["registry"],
        nats_url=stack.endpoints["nats"],
        enrollment_token=enrollment_token(operator, spec),
        operator_jwk_file=stack.layout.operator_jwk_file,  # what the stack's registry keys are certified by
    )


def flaky_server(
    settings: ServiceSettings, registry: RegistryClient, ran: Counter[str]
) -> tuple[MCPServer, Gate]:
    """An MCP server with a tool of each kind, which counts how often each one's effect happened."""
    gate = Gate(registry, settings.service_id)
    mcp = MCPServer("flaky", token_verifier=gate, auth=auth_settings(settings))

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
    async def lookup(fail: bool = False) -> dict[str, Any]:
        """Reads a value (read-only)."""
        ran["lookup"] += 1
        if fail:
            raise ToolError("the lookup failed")  # an MCP server that is not the fleet's: text only
        return {"value": 42}

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    async def put(key: str) -> dict[str, Any]:
        """Writes under an idempotency key (a repeat does nothing more)."""
        ran["put"] += 1
        return {"key": key}

    @mcp.tool()
    async def append(text: str) -> dict[str, Any]:
        """Appends a line (says nothing about repeats: each call appends again)."""
        ran["append"] += 1
        return {"appended": text}

    @mcp.tool(annotations=ToolAnnotations(read_only_hint=True, idempotent_hint=True))
    async def unlisted() -> dict[str, Any]:
        """Read-only, but needs a scope the client is not enrolled for: not in its catalog."""
        ran["unlisted"] += 1
        return {"value": 0}

    return mcp, gate


@pytest.fixture
async def world(stack: Stack, tmp_path: Path) -> AsyncIterator[World]:
    """A flaky MCP server (its own identity, registered with the stack's registry at the proxy's
    URL) and a client identity enrolled for its scope, with a :class:`Toolbox`."""
    suffix = uuid.uuid4().hex[:6]
    server_id, client_id = f"mcp-flaky-{suffix}", f"flaky-client-{suffix}"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    proxy = Proxy(sock.getsockname()[1])
    await proxy.resume()
    ran: Counter[str] = Counter()
    server_settings = _settings(
        stack, tmp_path, server_id, "mcp_server", ("registry:read", "registry:write"), proxy.url
    )
    client_settings = _settings(
        # A client calling tools in its own name, for a tenant it names (no caller to act for):
        # what a worker does (a specialist acts only for its callers).
        stack,
        tmp_path,
        client_id,
        "worker",
        ("registry:read", SCOPE),
        "http://127.0.0.1:1",
    )
    async with contextlib.AsyncExitStack() as stack_of:
        http = await stack_of.enter_async_context(httpx.AsyncClient(timeout=10))
        server_registry = RegistryClient(server_settings, http)
        stack_of.push_async_callback(server_registry.aclose)
        mcp, gate = flaky_server(server_settings, server_registry, ran)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with mcp.session_manager.run():
                yield

        app = build_app(mcp, Readiness(server_id, "mcp_server"), lifespan)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        serving = asyncio.create_task(server.serve(sockets=[sock]))

        async def stop() -> None:
            server.should_exit = True
            await serving

        stack_of.push_async_callback(stop)
        stack_of.push_async_callback(proxy.pause)
        tools = {"lookup": [SCOPE], "put": [SCOPE], "append": [SCOPE], "unlisted": [OTHER_SCOPE]}
        await server_registry.join_as_mcp_server(proxy.url + MCP_PATH, await declared_tools(mcp, tools))
        client = RegistryClient(client_settings, http)
        stack_of.push_async_callback(client.aclose)
        await client.enroll()
        mcp_http = await stack_of.enter_async_context(mcp_http_client())
        toolbox = Toolbox(client, mcp_http)
        stack_of.push_async_callback(toolbox.aclose)
        yield World(server_id, toolbox, client, proxy, gate, ran)


async def test_the_catalog_says_which_tools_a_repeat_is_harmless_for(world: World) -> None:
    server = await world.toolbox.catalog.server(world.server_id)
    assert {(t.name, t.read_only, t.idempotent) for t in server.tools} == {
        ("lookup", True, True),
        ("put", False, True),
        ("append", False, False),
    }


async def test_a_refused_token_is_renewed_once_and_the_call_runs_once(world: World) -> None:
    assert await world.call("append", text="first") == {"appended": "first"}
    first = world.gate.accepted[-1]
    world.gate.refuse.add(first)  # e.g. its key was revoked: the cached token is no good any more
    assert await world.call("append", text="second") == {"appended": "second"}
    assert world.ran["append"] == 2  # once per call: the refused request ran nothing
    assert world.gate.refused == [first]  # refused once, then a fresh token
    renewed = world.gate.accepted[-1]
    assert renewed != first
    # The refused token is out of the client's cache: the next call uses the fresh one.
    assert await world.client.tokens.token(world.server_id, TENANT, [SCOPE]) == renewed


async def test_calls_after_the_first_are_one_request_each_on_a_kept_session(world: World) -> None:
    # A session per call sent a handshake and a tools/list (to validate the result) with every
    # call: three or four requests, each authenticated and served. A kept session sends the call.
    assert await world.call("lookup") == {"value": 42}
    world.proxy.methods.clear()
    await asyncio.gather(*(world.call("lookup") for _ in range(8)))
    for i in range(4):
        assert await world.call("put", key=f"k{i}") == {"key": f"k{i}"}
    assert world.proxy.methods == Counter({"tools/call": 12})
    assert world.ran["lookup"] == 9 and world.ran["put"] == 4


async def test_a_call_cut_in_transit_fails_alone_not_the_calls_beside_it_on_the_session(
    world: World,
) -> None:
    assert await world.call("lookup") == {"value": 42}  # the session is open
    world.proxy.faults = ["drop"]  # the first of the calls below to reach the proxy is cut
    outcomes = await asyncio.gather(
        *(world.call("append", text=str(i)) for i in range(6)), return_exceptions=True
    )
    unknown = [o for o in outcomes if isinstance(o, OutcomeUnknown)]
    assert len(unknown) == 1, outcomes  # the cut one; the others' answers all arrived
    assert len([o for o in outcomes if isinstance(o, dict)]) == 5
    assert world.ran["append"] == 6  # each ran once: the cut one too (its answer was lost)


async def test_a_call_on_a_kept_session_carries_its_own_token_not_the_opener_s(world: World) -> None:
    assert await world.call("lookup") == {"value": 42}  # opens the session with this token
    opener = world.gate.accepted[-1]
    world.client.tokens.discard(opener)  # the next call gets a token of its own
    assert await world.call("lookup") == {"value": 42}
    assert world.proxy.methods["tools/call"] == 2
    assert world.gate.accepted[-1] != opener


async def test_a_token_refused_again_after_renewal_fails_with_unauthenticated(world: World) -> None:
    world.gate.refuse_all = True
    with pytest.raises(SkillError) as caught:
        await world.call("append", text="never")
    assert caught.value.code == ErrorCode.UNAUTHENTICATED
    assert "refused this agent's token, and a fresh one too" in caught.value.message
    assert len(world.gate.refused) == 2 and len(set(world.gate.refused)) == 2
    assert world.ran["append"] == 0


@pytest.mark.parametrize(("tool", "arguments"), [("lookup", {}), ("put", {"key": "k1"})])
@pytest.mark.parametrize(("fault", "runs"), [("drop", 2), ("503", 1)])
async def test_a_call_to_a_repeatable_tool_cut_in_transit_is_made_again(
    world: World, tool: str, arguments: dict[str, Any], fault: str, runs: int
) -> None:
    world.proxy.faults = [fault]
    assert await world.call(tool, **arguments)
    assert world.proxy.faults == []
    assert world.ran[tool] == runs  # a dropped answer: the tool ran, and ran again


@pytest.mark.parametrize("tool", ["append", "unlisted"])
@pytest.mark.parametrize(("fault", "runs"), [("drop", 1), ("503", 0)])
async def test_a_call_to_another_tool_cut_in_transit_is_not_repeated_and_its_outcome_is_unknown(
    world: World, tool: str, fault: str, runs: int
) -> None:
    world.proxy.faults = [fault, fault]
    with pytest.raises(OutcomeUnknown) as caught:
        await world.call(tool, **({"text": "once"} if tool == "append" else {}))
    assert caught.value.code == ErrorCode.OUTCOME_UNKNOWN
    assert "may or may not have taken effect" in caught.value.message
    assert "Reconcile" in caught.value.message
    assert world.proxy.faults == [fault]  # one attempt only
    assert world.ran[tool] == runs


async def test_a_server_that_cannot_be_reached_is_tried_three_times_and_the_tool_did_not_run(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    await world.proxy.pause()
    caplog.set_level(logging.WARNING, logger="specialists.kit")
    started = time.monotonic()
    with pytest.raises(SkillError) as caught:
        await world.call("append", text="never")  # safe to try again: no attempt reached the tool
    assert caught.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE
    assert caught.value.retryable
    assert "3 time(s)" in caught.value.message and "the tool did not run" in caught.value.message
    assert [r.message for r in caplog.records if "trying again" in r.message] == [
        f"call to {world.server_id}/append cut in transit (ConnectError: All connection attempts failed),"
        f" attempt {n}: trying again"
        for n in (1, 2)
    ]
    assert time.monotonic() - started < 5
    assert world.ran["append"] == 0


async def test_the_caller_s_timeout_bounds_the_retries(world: World) -> None:
    await world.proxy.hang()  # every attempt waits: only the caller's timeout ends the call
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await world.call("lookup", timeout_s=0.2)
    assert time.monotonic() - started < 1.0


async def test_a_tool_s_error_answer_is_not_repeated_even_for_a_read_only_tool(world: World) -> None:
    with pytest.raises(SkillError) as caught:
        await world.call("lookup", fail=True)
    assert caught.value.code == ErrorCode.TOOL_FAILED
    assert "the lookup failed" in caught.value.message
    assert world.ran["lookup"] == 1
