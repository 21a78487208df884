"""The tool-server kit: an MCP server of the fleet from one declaration per tool.

::

    from mcp_servers.kit import KEYED_WRITE, READ_ONLY, ToolCall, ToolServer

    server = ToolServer("tickets", instructions="The support desk's tickets.")

    @server.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
    async def open_ticket(call: ToolCall, operation_id: str, title: str) -> dict[str, str]:
        \"\"\"Open a ticket, once per operation id.\"\"\"
        return {"ticket": ..., "tenant": call.tenant}

    async def main(settings):          # the manifest's entry: "tickets:main"
        await server.serve(settings)

``@server.tool`` gives the tool, from that one place, everything the fleet's own servers have: the
scopes a caller's token needs (registered with the registry, and enforced by policy, ``fleet.tools``,
for a server its data does not name), the policy decision and rate limit before the function runs,
an audit event on NATS whatever the outcome, the MCP annotations that tell clients whether a repeat
is harmless, an ``execute_tool`` span and a latency sample. The function gets the verified caller
(:class:`ToolCall`: its claims and tenant come from the token, never from arguments) and the tool's
own arguments, whose types become its input schema. A tool declared without scopes or annotations
is refused when it is declared, so a server cannot start with one.

A :class:`~fleet.errors.FleetError` the function raises reaches the caller as the fleet's error
envelope (code, message, retryable); anything else as ``internal`` (logged here, not shown).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations
from starlette.applications import Starlette

from fleet.mcp_inprocess import claims_for, in_process
from fleet.service import configure_logging
from fleet.settings import ServiceSettings
from fleet.tokens import Claims
from mcp_servers._base import (
    KEYED_WRITE,
    READ_ONLY,
    ToolGate,
    fleet_mcp_server,
    serve_mcp,
    tool_server_app,
)
from policy import Bundle, Decision, RegorusEngine
from registry import RegistryClient

ToolFunction = TypeVar("ToolFunction", bound=Callable[..., Awaitable[Any]])
Facts = Callable[[dict[str, Any]], dict[str, Any]]
MAX_SUMMARY_TEXT = 200  # longer strings reach policy and the audit trail as their length only


@dataclass(frozen=True, slots=True)
class ToolCall:
    """What a tool function gets besides its arguments: the caller, verified, and the decision
    that let the call run."""

    claims: Claims  # the caller's token, verified (tenant, subject, actors, run, scopes)
    decision: Decision  # policy's decision for this call (its id is in the audit trail)
    server_id: str
    context: Context[Any, Any] | None = None  # the MCP request's (progress, logging)

    @property
    def tenant(self) -> str:
        """The tenant the call is for: from the caller's token, never from arguments."""
        return self.claims.tenant

    @property
    def run_id(self) -> str:
        """The coordinator run the call is part of ("" for a call outside any run)."""
        return self.claims.run_id


@dataclass(frozen=True, slots=True)
class ToolDeclaration:
    """One tool as its server declares it."""

    name: str
    scopes: tuple[str, ...]
    annotations: ToolAnnotations
    function: Callable[..., Awaitable[Any]]
    facts: Facts | None = None


def summary(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """What policy and the audit trail see of a call's arguments when the tool names no facts of
    its own: numbers, booleans and short strings as they are; longer strings, lists and objects by
    their size (an argument may hold a customer's text; the audit trail keeps it for 90 days)."""
    out: dict[str, Any] = {}
    for key, value in arguments.items():
        if value is None or isinstance(value, bool | int | float):
            out[key] = value
        elif isinstance(value, str):
            out[key] = value if len(value) <= MAX_SUMMARY_TEXT else {"chars": len(value)}
        elif isinstance(value, list | tuple):
            out[key] = {"items": len(value)}
        elif isinstance(value, dict):
            out[key] = {"keys": len(value)}
        else:
            out[key] = {"type": type(value).__name__}
    return out


class ToolServer:
    """An MCP server of the fleet, declared tool by tool (see the module's docstring)."""

    def __init__(self, name: str, *, instructions: str = "") -> None:
        """``name``: the MCP server's name (its service id comes from the settings it is served with)."""
        self.name = name
        self.instructions = instructions
        self._tools: dict[str, ToolDeclaration] = {}
        self._resources: list[Callable[[ServiceSettings], contextlib.AbstractAsyncContextManager[Any]]] = []

    @property
    def tools(self) -> Mapping[str, ToolDeclaration]:
        """The declared tools, by name."""
        return dict(self._tools)

    def tool(
        self,
        *,
        scopes: Sequence[str],
        annotations: ToolAnnotations,
        name: str | None = None,
        facts: Facts | None = None,
    ) -> Callable[[ToolFunction], ToolFunction]:
        """Declare the decorated ``async def f(call: ToolCall, ...)`` a tool that needs ``scopes``
        and behaves as ``annotations`` say (:data:`READ_ONLY`, :data:`KEYED_WRITE`, or your own).
        ``facts``: what policy and the audit trail see of its arguments (default :func:`summary`)."""
        if isinstance(scopes, str) or not scopes or not all(isinstance(s, str) and ":" in s for s in scopes):
            raise ValueError(f"a tool needs scopes like ['tickets:write'], not {scopes!r}")
        if not isinstance(annotations, ToolAnnotations):
            raise ValueError("a tool needs annotations (READ_ONLY, KEYED_WRITE or a ToolAnnotations)")

        def declare(function: ToolFunction) -> ToolFunction:
            if not inspect.iscoroutinefunction(_as_any(function)):  # (no narrowing of the type)
                raise ValueError(f"tool {function.__name__} must be an async function")
            tool_name = name or function.__name__
            if tool_name in self._tools:
                raise ValueError(f"tool {tool_name} is declared twice")
            self._tools[tool_name] = ToolDeclaration(tool_name, tuple(scopes), annotations, function, facts)
            return function

        return declare

    def resource(
        self, factory: Callable[[ServiceSettings], contextlib.AbstractAsyncContextManager[Any]]
    ) -> Callable[[ServiceSettings], contextlib.AbstractAsyncContextManager[Any]]:
        """Declare something the server opens before it serves and closes after (a connection
        pool, a client): ``factory(settings)`` is entered once per process."""
        self._resources.append(factory)
        return factory

    def mcp_server(self, settings: ServiceSettings, registry: RegistryClient, gate: ToolGate) -> MCPServer:
        """The MCP server of the declared tools, each behind ``gate`` (what :meth:`app` serves;
        tests call it in process, see ``fleetctl.testing.mcp.in_process``)."""
        if not self._tools:
            raise ValueError(f"tool server {self.name} declares no tool")
        mcp = fleet_mcp_server(self.name, settings, registry, self.instructions or None)
        for declared in self._tools.values():
            mcp.add_tool(
                _gated(declared, gate, settings.service_id),
                name=declared.name,
                description=inspect.getdoc(declared.function) or declared.name,
                annotations=declared.annotations,
            )
        return mcp

    def app(self, settings: ServiceSettings) -> Starlette:
        """The server's whole app: the fleet's token check, gate, audit and registration, and the
        declared resources opened before it serves."""

        @contextlib.asynccontextmanager
        async def resources() -> AsyncIterator[None]:
            async with contextlib.AsyncExitStack() as stack:
                for factory in self._resources:
                    await stack.enter_async_context(factory(settings))
                yield

        return tool_server_app(
            settings,
            tools={name: declared.scopes for name, declared in self._tools.items()},
            make_server=lambda registry, gate: self.mcp_server(settings, registry, gate),
            resources=resources,
        )

    @contextlib.asynccontextmanager
    async def test_client(
        self,
        scopes: Sequence[str],
        *,
        tenant: str = "acme",
        subject: str = "tester",
        run_id: str = "run-1",
        server_id: str = "mcp-test",
        policy_dir: Path | None = None,
    ) -> AsyncIterator[Client]:
        """An MCP client of this server in this process, every call made as a caller of ``tenant``
        whose token carries ``scopes``: the tools run behind their gate and the fleet's policy (the
        platform's bundle, or ``policy_dir``), as behind HTTP; only the token check is left out.
        For a tool server's own tests (no stack, no network)::

            async with server.test_client(["tickets:write"]) as client:
                result = await client.call_tool("open_ticket", {...})
        """
        settings = ServiceSettings(
            service_id=server_id,
            key_file=Path("unused.pem"),
            public_url="http://127.0.0.1:1",
            registry_url="http://127.0.0.1:1",  # never asked: the caller's claims are given
        )
        gate = ToolGate(RegorusEngine(Bundle.load(policy_dir) if policy_dir else Bundle.load()), server_id)
        claims = claims_for(subject, tenant, scopes, audience=server_id, run_id=run_id)
        async with httpx.AsyncClient() as http, contextlib.AsyncExitStack() as stack:
            for factory in self._resources:
                await stack.enter_async_context(factory(settings))
            server = self.mcp_server(settings, RegistryClient(settings, http), gate)
            async with in_process(server, claims) as client:
                yield client

    async def serve(self, settings: ServiceSettings) -> None:
        """Serve until the process is stopped (a manifest entry's ``main``)."""
        configure_logging(settings.service_id, settings.log_level)
        await serve_mcp(self.app(settings), settings)


def _as_any(value: object) -> Any:
    return value


def _gated(declared: ToolDeclaration, gate: ToolGate, server_id: str) -> Callable[..., Awaitable[Any]]:
    """The function the MCP SDK registers: the declared one's arguments (its first, the
    :class:`ToolCall`, replaced by the SDK's context), the gate passed before it runs."""
    function = declared.function
    signature = inspect.signature(function, eval_str=True)
    parameters = list(signature.parameters.values())
    if not parameters:
        raise ValueError(f"tool {declared.name} must take the ToolCall first")
    arguments = parameters[1:]
    context = inspect.Parameter("mcp_context", inspect.Parameter.KEYWORD_ONLY, annotation=Context)

    @functools.wraps(function)
    async def gated(mcp_context: Context[Any, Any], **given: Any) -> Any:
        facts = declared.facts(given) if declared.facts is not None else summary(given)
        claims, decision = await gate.authorize(declared.name, facts, declared.scopes)
        return await function(ToolCall(claims, decision, server_id, mcp_context), **given)

    del gated.__wrapped__  # the SDK reads the signature below, not the declared function's
    gated.__signature__ = signature.replace(parameters=[*arguments, context])  # type: ignore[attr-defined]
    gated.__annotations__ = {
        **{p.name: p.annotation for p in arguments if p.annotation is not inspect.Parameter.empty},
        "mcp_context": Context,
        **(
            {"return": signature.return_annotation}
            if signature.return_annotation is not signature.empty
            else {}
        ),
    }
    return gated


__all__ = ["KEYED_WRITE", "READ_ONLY", "ToolCall", "ToolDeclaration", "ToolServer", "summary"]
