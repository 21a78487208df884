"""The SQL MCP server process.

Tool connections log in as a dedicated non-superuser role without BYPASSRLS, in a read-only
transaction with a statement timeout, and with the tenant taken from the verified token.
"""

from __future__ import annotations

import datetime as dt
import decimal
import logging
from typing import Any, TypedDict

import psycopg
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from psycopg_pool import AsyncConnectionPool
from pydantic import Field
from starlette.applications import Starlette

from fleet.service import configure_logging, serve_app
from fleet.settings import ServiceSettings
from mcp_servers._base import (
    RegistryTokenVerifier,
    auth_settings,
    authorize_call,
)
from mcp_servers._pg import database_tool_app, pg_message
from mcp_servers.sql._schema import READER_ROLE, TENANT_SETTING, ensure_schema, seed_demo_data
from policy import RegorusEngine
from registry import RegistryClient

log = logging.getLogger(__name__)

TOOLS = {"query": ["sql:query"]}  # each tool, with the scopes a token needs to call it


class SqlServerSettings(ServiceSettings):
    max_rows: int = 500
    statement_timeout_ms: int = 5000
    seed_demo: bool = Field(default=True, description="insert the demo tenants' invoices if missing")


class QueryResult(TypedDict):
    columns: list[str]
    rows: list[list[Any]]
    row_count: int
    truncated: bool


def _jsonable(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return value


class SqlTools:
    """The tools, over a pool whose connections log in as the reader role."""

    def __init__(self, pool: AsyncConnectionPool[Any], settings: SqlServerSettings) -> None:
        self._pool = pool
        self._settings = settings

    async def query(self, tenant: str, statement: str) -> QueryResult:
        """Run one SELECT for ``tenant``.

        The statement runs through a server-side cursor (``DECLARE ... CURSOR FOR``), which accepts
        exactly one SELECT or VALUES: no second statement, no COMMIT, no SET, no write. Only
        ``max_rows + 1`` rows ever leave the server. The transaction is read-only and time-limited,
        and the pool discards any session state a statement managed to set before the connection
        serves anyone else.
        """
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SET TRANSACTION READ ONLY")
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, true), set_config(%s, %s, true)",
                (str(self._settings.statement_timeout_ms), TENANT_SETTING, tenant),
            )
            async with conn.cursor(name="fleet_query") as cursor:
                try:
                    await cursor.execute(statement)
                    rows = await cursor.fetchmany(self._settings.max_rows + 1)
                except psycopg.Error as exc:
                    raise ToolError(
                        f"[invalid_request] the database refused the query: {pg_message(exc)}"
                    ) from exc
                columns = [column.name for column in cursor.description or []]
        truncated = len(rows) > self._settings.max_rows
        rows = rows[: self._settings.max_rows]
        return QueryResult(
            columns=columns,
            rows=[[_jsonable(v) for v in row] for row in rows],
            row_count=len(rows),
            truncated=truncated,
        )


def build_server(
    settings: SqlServerSettings, registry: RegistryClient, engine: RegorusEngine, tools: SqlTools
) -> MCPServer:
    mcp = MCPServer(
        "fleet-sql",
        instructions="Read-only SQL over the caller's tenant data (schema tenant_data).",
        token_verifier=RegistryTokenVerifier(registry, settings.service_id),
        auth=auth_settings(settings),
    )

    @mcp.tool()
    async def query(sql: str) -> QueryResult:
        """Run one read-only SELECT over your tenant's data (table tenant_data.invoices)."""
        claims = authorize_call(engine, settings.service_id, "query", {"sql_length": len(sql)})
        return await tools.query(claims.tenant, sql)

    return mcp


def build_app_for(settings: SqlServerSettings) -> Starlette:
    async def prepare(admin: psycopg.AsyncConnection[Any]) -> None:
        await ensure_schema(admin)
        if settings.seed_demo:
            await seed_demo_data(admin)

    return database_tool_app(
        settings,
        role=READER_ROLE,
        tools=TOOLS,
        prepare=prepare,
        make_server=lambda registry, engine, pool: build_server(
            settings, registry, engine, SqlTools(pool, settings)
        ),
    )


async def main(settings: ServiceSettings) -> None:
    sql_settings = SqlServerSettings.from_env(settings.service_id)
    configure_logging(sql_settings.service_id, sql_settings.log_level)
    await serve_app(build_app_for(sql_settings), sql_settings)
