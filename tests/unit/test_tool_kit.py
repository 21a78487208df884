"""The tool-server kit: one declaration gives a tool its scopes (registered and enforced by the
fleet's own Rego bundle), its gate, its annotations and its input schema. Called in process through
the MCP SDK's client, as a caller with given claims."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp.server.mcpserver import MCPServer

from fleet.errors import ErrorCode, FleetError
from fleet.settings import ServiceSettings
from fleetctl.testing.mcp import claims_for, error_in, in_process, ok
from mcp_servers._base import ToolGate, declared_tools
from mcp_servers.kit import KEYED_WRITE, READ_ONLY, ToolCall, ToolServer, summary
from policy import Bundle, RegorusEngine
from registry import RegistryClient

tickets = ToolServer("tickets", instructions="A support desk's tickets.")
opened: list[dict[str, Any]] = []


@tickets.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
async def open_ticket(call: ToolCall, operation_id: str, title: str, tenant: str = "") -> dict[str, Any]:
    """Open a ticket, once per operation id."""
    opened.append({"tenant": call.tenant, "title": title, "run": call.run_id, "decision": call.decision})
    return {"ticket": f"T-{len(opened)}", "tenant": call.tenant}


@tickets.tool(scopes=["tickets:read"], annotations=READ_ONLY, name="ticket_count")
async def count(call: ToolCall) -> dict[str, int]:
    """How many tickets this process opened."""
    if not opened:
        raise FleetError(ErrorCode.NOT_FOUND, "no ticket yet")
    return {"count": len(opened)}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[MCPServer]:
    opened.clear()
    settings = ServiceSettings(
        service_id="mcp-tickets",
        key_file=tmp_path / "key.pem",
        public_url="http://127.0.0.1:1",
        registry_url="http://127.0.0.1:1",  # never asked: the claims are given as verified
    )
    gate = ToolGate(RegorusEngine(Bundle.load()), "mcp-tickets")  # the fleet's own bundle
    async with httpx.AsyncClient() as http:
        yield tickets.mcp_server(settings, RegistryClient(settings, http), gate)


async def test_a_declared_tool_runs_for_its_caller_s_tenant_with_its_schema_and_hints(
    server: MCPServer,
) -> None:
    caller = claims_for("triage", "acme", ["tickets:write"], audience="mcp-tickets")
    async with in_process(server, caller) as client:
        listed = {tool.name: tool for tool in (await client.list_tools()).tools}
        # a tenant named in the arguments is just an argument: the call is for the token's tenant
        answer = ok(
            await client.call_tool("open_ticket", {"operation_id": "op-1", "title": "x", "tenant": "globex"})
        )
    assert answer == {"ticket": "T-1", "tenant": "acme"}
    assert opened[0]["run"] == "run-7" and opened[0]["decision"].allow
    schema = listed["open_ticket"].input_schema
    assert set(schema["properties"]) == {"operation_id", "title", "tenant"}  # no ToolCall, no context
    assert schema["required"] == ["operation_id", "title"]
    hints = listed["open_ticket"].annotations
    assert hints is not None and hints.idempotent_hint and not hints.read_only_hint
    assert listed["open_ticket"].description == "Open a ticket, once per operation id."


async def test_the_declared_scope_is_what_policy_enforces(server: MCPServer) -> None:
    reader = claims_for("triage", "acme", ["tickets:read"], audience="mcp-tickets")
    async with in_process(server, reader) as client:
        denied = error_in(await client.call_tool("open_ticket", {"operation_id": "op-1", "title": "x"}))
        empty = error_in(await client.call_tool("ticket_count", {}))
    assert denied.code == ErrorCode.POLICY_DENIED and "lacks scope tickets:write" in denied.message
    assert not opened  # the function never ran
    assert empty.code == ErrorCode.NOT_FOUND  # the tool's own FleetError, as data


async def test_the_registration_carries_each_tool_s_scopes(server: MCPServer) -> None:
    declared = {
        t["name"]: t for t in await declared_tools(server, {n: d.scopes for n, d in tickets.tools.items()})
    }
    assert declared["open_ticket"]["scopes"] == ["tickets:write"] and declared["open_ticket"]["idempotent"]
    assert declared["ticket_count"]["scopes"] == ["tickets:read"] and declared["ticket_count"]["read_only"]


def test_a_tool_without_scopes_or_hints_is_refused_where_it_is_declared() -> None:
    kit = ToolServer("x")

    async def tool(call: ToolCall) -> dict[str, Any]:
        return {}

    for bad in ([], "tickets:write", ["no-colon"]):
        with pytest.raises(ValueError, match="scopes"):
            kit.tool(scopes=bad, annotations=READ_ONLY)
    with pytest.raises(ValueError, match="annotations"):
        kit.tool(scopes=["a:b"], annotations=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="async"):
        kit.tool(scopes=["a:b"], annotations=READ_ONLY)(lambda call: {})  # type: ignore[type-var]
    kit.tool(scopes=["a:b"], annotations=READ_ONLY)(tool)
    with pytest.raises(ValueError, match="twice"):
        kit.tool(scopes=["a:b"], annotations=READ_ONLY)(tool)


def test_policy_and_the_audit_trail_see_sizes_of_long_or_nested_arguments() -> None:
    seen = summary({"n": 3, "ok": True, "short": "hi", "long": "x" * 500, "rows": [1, 2], "doc": {"a": 1}})
    assert seen == {
        "n": 3,
        "ok": True,
        "short": "hi",
        "long": {"chars": 500},
        "rows": {"items": 2},
        "doc": {"keys": 1},
    }
