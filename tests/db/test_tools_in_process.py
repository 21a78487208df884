"""The in-process tier for tool tests: the SQL MCP server as it is built for production (its tools,
its gate, the fleet's Rego bundle, a real Postgres), called through the MCP SDK's in-memory client
as a caller with given claims. No stack, no HTTP, no registry: a tool test in milliseconds that still
goes through everything a call goes through behind the token check."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psycopg
import pytest
from mcp.server.mcpserver import MCPServer

from fleet.errors import ErrorCode
from fleetctl.testing.mcp import claims_for, error_in, in_process, ok
from mcp_servers._base import ToolGate
from mcp_servers.sql._schema import DEMO_INVOICES, ensure_schema, seed_demo_data
from mcp_servers.sql.server import SqlServerSettings, SqlTools, TenantPools, build_server
from policy import Bundle, RegorusEngine
from registry import RegistryClient


@pytest.fixture
async def sql_server(pg_dsn: str, tmp_path: Path) -> AsyncIterator[MCPServer]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        await ensure_schema(admin, writable=("invoices",))
        await seed_demo_data(admin)
    settings = SqlServerSettings(
        service_id="mcp-sql",
        key_file=tmp_path / "mcp-sql.key",
        public_url="http://127.0.0.1:1",
        registry_url="http://127.0.0.1:1",  # never asked: the in-process tier takes the claims as verified
        pg_dsn=pg_dsn,
        sql_writable_tables=["invoices"],
    )
    pools = TenantPools(settings)
    gate = ToolGate(RegorusEngine(Bundle.load()), "mcp-sql")  # the fleet's own bundle
    async with httpx.AsyncClient() as http:
        try:
            yield build_server(settings, RegistryClient(settings, http), gate, SqlTools(pools, settings))
        finally:
            await pools.aclose()


async def test_a_tool_answers_its_caller_s_tenant_only(sql_server: MCPServer) -> None:
    claims = claims_for("sql-analyst", "acme", ["sql:query"], audience="mcp-sql")
    async with in_process(sql_server, claims) as client:
        answer = ok(
            await client.call_tool("query", {"sql": "SELECT DISTINCT tenant_id FROM tenant_data.invoices"})
        )
        tools = {tool.name for tool in (await client.list_tools()).tools}
    assert answer["rows"] == [["acme"]]
    assert tools == {"query", "execute", "write_status"}


async def test_the_gate_and_the_tool_refuse_with_their_codes(sql_server: MCPServer) -> None:
    no_scope = claims_for("sql-analyst", "acme", [], audience="mcp-sql")
    async with in_process(sql_server, no_scope) as client:
        denied = error_in(await client.call_tool("query", {"sql": "SELECT 1"}))
    assert denied.code == ErrorCode.POLICY_DENIED and "lacks scope sql:query" in denied.message
    assert denied.details["decision_id"]  # the decision a person can look up in the decision log

    reader = claims_for("sql-analyst", "acme", ["sql:query"], audience="mcp-sql")
    async with in_process(sql_server, reader) as client:
        refused = error_in(
            await client.call_tool("query", {"sql": "SELECT set_config('role', 'postgres', true)"})
        )
        written = error_in(await client.call_tool("query", {"sql": "DELETE FROM tenant_data.invoices"}))
        unknown = error_in(await client.call_tool("drop_everything", {}))
    assert refused.code == ErrorCode.SQL_REFUSED
    assert written.code == ErrorCode.INVALID_REQUEST
    assert unknown.code == ErrorCode.INVALID_REQUEST


async def test_a_keyed_write_happens_once_and_a_replay_answers_the_first_result(
    sql_server: MCPServer,
) -> None:
    writer = claims_for("sql-analyst", "acme", ["sql:query", "sql:write"], audience="mcp-sql")
    statement = "UPDATE tenant_data.invoices SET status = 'paid' WHERE status <> 'paid'"
    async with in_process(sql_server, writer) as client:
        first = ok(await client.call_tool("execute", {"sql": statement, "idempotency_key": "k-1"}))
        again = ok(await client.call_tool("execute", {"sql": statement, "idempotency_key": "k-1"}))
        other = error_in(
            await client.call_tool(
                "execute", {"sql": "DELETE FROM tenant_data.payments", "idempotency_key": "k-1"}
            )
        )
        status = ok(await client.call_tool("write_status", {"idempotency_key": "k-1"}))
    unpaid = sum(1 for *_, paid in DEMO_INVOICES["acme"] if paid != "paid")
    assert (first["row_count"], first["replayed"]) == (unpaid, False)
    assert (again["row_count"], again["replayed"]) == (unpaid, True)
    assert other.code == ErrorCode.CONFLICT
    assert status["row_count"] == unpaid
