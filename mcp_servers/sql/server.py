"""The SQL MCP server process.

Tool connections log in as a dedicated non-superuser role without BYPASSRLS, in a read-only
transaction with a statement timeout, and with the tenant taken from the verified token.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import decimal
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import psycopg
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool
from pydantic import Field
from starlette.applications import Starlette

from fleet.service import Readiness, configure_logging, serve_app, start_in_background
from fleet.settings import ServiceSettings
from mcp_servers._base import (
    MCP_PATH,
    RegistryTokenVerifier,
    auth_settings,
    authorize_call,
    build_app,
    new_http,
)
from mcp_servers._pg import discard_session_state, pg_message
from mcp_servers.sql._schema import READER_ROLE, TENANT_SETTING, ensure_schema, seed_demo_data
from policy import RegorusEngine
from registry import RegistryClient

log = logging.getLogger(__name__)

TOOLS = ["query"]


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


async def _prepare_database(settings: SqlServerSettings, password: str) -> None:
    """Create the schema and (re)set the reader login's password to one only this process knows."""
    async with await psycopg.AsyncConnection.connect(settings.pg_dsn, autocommit=True) as admin:
        await ensure_schema(admin)
        await admin.execute(
            sql.SQL("ALTER ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(READER_ROLE), sql.Literal(password)
            )
        )
        if settings.seed_demo:
            await seed_demo_data(admin)


def build_app_for(settings: SqlServerSettings) -> Starlette:
    http = new_http()
    registry = RegistryClient(settings, http)
    engine = RegorusEngine.from_dir(settings.policy_dir)
    password = secrets.token_urlsafe(24)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        make_conninfo(settings.pg_dsn, user=READER_ROLE, password=password),
        min_size=1,
        max_size=10,
        open=False,
        kwargs={"prepare_threshold": None},
        reset=discard_session_state,
    )
    mcp = build_server(settings, registry, engine, SqlTools(pool, settings))
    readiness = Readiness(settings.service_id, "mcp_server")

    async def start() -> None:
        await registry.join_as_mcp_server(settings.public_url + MCP_PATH, TOOLS)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await _prepare_database(settings, password)
        async with http, pool, mcp.session_manager.run(), start_in_background(readiness, start):
            yield

    return build_app(mcp, readiness, lifespan)


async def main(settings: ServiceSettings) -> None:
    sql_settings = SqlServerSettings.from_env(settings.service_id)
    configure_logging(sql_settings.service_id, sql_settings.log_level)
    await serve_app(build_app_for(sql_settings), sql_settings)
