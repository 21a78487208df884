"""The SQL MCP server process: SQL written by a model, run so that the database itself keeps every
tenant to its own rows whatever statement arrives.

- Each call runs on a connection that logged in as the caller's tenant role (see ``_schema``), taken
  from the verified token only. Row-level security keys on that login, which no statement can change.
- ``query``: one SELECT (or VALUES) through a server-side cursor, in a read-only transaction with a
  statement timeout; at most ``max_rows`` rows leave the server.
- ``execute``: one INSERT, UPDATE, DELETE or MERGE on a table listed in ``writable_tables`` (none by
  default), under an idempotency key recorded in the same transaction (``fleet_sql.writes``): the same
  key runs the statement at most once, and ``write_status`` answers what it did.
- A connection returns to its pool only after ``DISCARD ALL``: nothing one call set reaches the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import decimal
import hashlib
import logging
import re
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, TypedDict

import psycopg
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool
from pydantic import Field
from starlette.applications import Starlette

from fleet.service import configure_logging, serve_app
from fleet.settings import ServiceSettings
from mcp_servers._base import (
    KEYED_WRITE,
    READ_ONLY,
    ToolGate,
    fleet_mcp_server,
    tool_server_app,
)
from mcp_servers._pg import discard_session_state, pg_message
from mcp_servers.sql._schema import (
    ensure_schema,
    ensure_tenant_role,
    expose_table,
    role_password,
    seed_demo_data,
    tenant_role,
)
from registry import RegistryClient

log = logging.getLogger(__name__)

# each tool, with the scopes a token needs to call it
TOOLS = {"query": ["sql:query"], "execute": ["sql:write"], "write_status": ["sql:write"]}
WRITE_TAGS = ("INSERT", "UPDATE", "DELETE", "MERGE")
# Possessive: no item of the prefix starts with a letter, so giving one back never helps; without it
# the nested \s+ backtracks exponentially on a run of spaces.
_FIRST_WORD = re.compile(r"^(?:\s+|--[^\n]*\n?|/\*.*?\*/|\()*+([A-Za-z]+)", re.DOTALL)
_INVALID_PASSWORD = "28P01"


class SqlServerSettings(ServiceSettings):
    max_rows: int = 500
    statement_timeout_ms: int = 5000
    seed_demo: bool = Field(default=True, description="insert the demo tenants' invoices if missing")
    sql_writable_tables: list[str] = Field(
        default_factory=list,
        description="tables of tenant_data the execute tool may change (none: read-only)",
    )
    sql_role_secret: str = Field(
        default="",
        description="derives the tenant roles' passwords; replicas of one server share it (random if empty)",
    )
    sql_connections_per_tenant: int = 4
    sql_max_tenant_pools: int = 64


class QueryResult(TypedDict):
    columns: list[str]
    rows: list[list[Any]]
    row_count: int
    truncated: bool


class WriteResult(TypedDict):
    idempotency_key: str
    row_count: int
    replayed: bool  # true when the key had already run: nothing ran now, this is what it did then


class WriteStatus(TypedDict):
    status: str  # "written" or "unknown"
    row_count: int | None
    written_at: str | None


def _jsonable(value: Any) -> Any:
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dt.date | dt.datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return value


def statement_hash(statement: str) -> str:
    return hashlib.sha256(statement.encode()).hexdigest()


class TenantPools:
    """One small connection pool per tenant, each logged in as that tenant's role; the least recently
    used pool closes when there are more than ``limit``. Roles are created on first use."""

    def __init__(self, settings: SqlServerSettings) -> None:
        self._settings = settings
        self._secret = (settings.sql_role_secret or secrets.token_urlsafe(32)).encode()
        self._pools: OrderedDict[str, AsyncConnectionPool[Any]] = OrderedDict()
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    async def _ensure_role(self, tenant: str) -> str:
        password = role_password(self._secret, tenant_role(tenant))
        async with await psycopg.AsyncConnection.connect(self._settings.pg_dsn, autocommit=True) as admin:
            return await ensure_tenant_role(
                admin,
                tenant,
                password,
                statement_timeout_ms=self._settings.statement_timeout_ms,
                connection_limit=self._settings.sql_connections_per_tenant * 4,
            )

    async def _open(self, tenant: str) -> AsyncConnectionPool[Any]:
        role = await self._ensure_role(tenant)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            make_conninfo(self._settings.pg_dsn, user=role, password=role_password(self._secret, role)),
            min_size=1,
            max_size=self._settings.sql_connections_per_tenant,
            open=False,
            kwargs={"prepare_threshold": None},
            reset=discard_session_state,
            name=f"tenant-{role}",
        )
        await pool.open(wait=True, timeout=10)
        return pool

    async def pool(self, tenant: str) -> AsyncConnectionPool[Any]:
        existing = self._pools.get(tenant)
        if existing is not None:
            self._pools.move_to_end(tenant)
            return existing
        async with self._lock:
            existing = self._pools.get(tenant)
            if existing is not None:
                return existing
            pool = await self._open(tenant)
            self._pools[tenant] = pool
            while len(self._pools) > self._settings.sql_max_tenant_pools:
                _, old = self._pools.popitem(last=False)
                task = asyncio.create_task(old.close(timeout=30))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            return pool

    async def reset(self, tenant: str) -> None:
        """Drop ``tenant``'s pool (its password changed under it: another replica with another secret)."""
        async with self._lock:
            pool = self._pools.pop(tenant, None)
        if pool is not None:
            await pool.close()

    @contextlib.asynccontextmanager
    async def connection(self, tenant: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        for attempt in (1, 2):
            pool = await self.pool(tenant)
            try:
                async with pool.connection(timeout=10) as conn:
                    yield conn
                    return
            except psycopg.OperationalError as exc:
                if attempt == 2 or getattr(exc, "sqlstate", None) != _INVALID_PASSWORD:
                    raise
                await self.reset(tenant)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), OrderedDict()
        await asyncio.gather(*(p.close() for p in pools), *self._closing, return_exceptions=True)


class SqlTools:
    """The tools, each on a connection of the caller's tenant role."""

    def __init__(self, pools: TenantPools, settings: SqlServerSettings) -> None:
        self._pools = pools
        self._settings = settings

    async def query(self, tenant: str, statement: str) -> QueryResult:
        """Run one SELECT for ``tenant``.

        The statement runs through a server-side cursor (``DECLARE ... CURSOR FOR``), which accepts
        exactly one SELECT or VALUES: no second statement, no COMMIT, no SET, no write. Only
        ``max_rows + 1`` rows ever leave the server.
        """
        async with self._pools.connection(tenant) as conn, conn.transaction():
            await conn.execute("SET TRANSACTION READ ONLY")
            # A cursor is planned for its first 10% of rows by default (cursor_tuple_fraction): a
            # fast-start plan that may walk a large table in the order asked for, filtering every
            # row by tenant. The tool reads the whole answer (to max_rows), so plan for all of it.
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, true), set_config('cursor_tuple_fraction', '1.0', true)",
                (str(self._settings.statement_timeout_ms),),
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

    async def execute(self, tenant: str, statement: str, key: str, caller: str) -> WriteResult:
        """Run one INSERT/UPDATE/DELETE/MERGE at most once per ``key``.

        The key is claimed in the transaction of the write (``fleet_sql.claim_write``): a repeat after
        the write committed runs nothing and answers what the first did; a concurrent repeat waits for
        the first. The statement goes over the extended protocol, which refuses a second statement.
        """
        match = _FIRST_WORD.match(statement)
        first = match.group(1).upper() if match else ""
        if first not in (*WRITE_TAGS, "WITH"):
            raise ToolError("[invalid_request] execute runs one INSERT, UPDATE, DELETE or MERGE")
        digest = statement_hash(statement)
        try:
            async with self._pools.connection(tenant) as conn, conn.transaction():
                await conn.execute("SET TRANSACTION READ WRITE")
                await conn.execute(
                    "SELECT set_config('statement_timeout', %s, true)",
                    (str(self._settings.statement_timeout_ms),),
                )
                claim = await (
                    await conn.execute(
                        "SELECT status, statement_hash, row_count FROM fleet_sql.claim_write(%s, %s, %s)",
                        (key, digest, caller),
                    )
                ).fetchone()
                assert claim is not None
                status, recorded_hash, recorded_rows = claim
                if status != "new":
                    if recorded_hash != digest:
                        raise ToolError(
                            "[conflict] this idempotency key was used for another statement; use a new key"
                        )
                    return WriteResult(idempotency_key=key, row_count=int(recorded_rows or 0), replayed=True)
                cursor = conn.cursor()
                try:
                    await cursor.execute(statement, binary=True)
                except psycopg.Error as exc:
                    raise ToolError(
                        f"[invalid_request] the database refused the statement: {pg_message(exc)}"
                    ) from exc
                tag = (cursor.statusmessage or "").split(" ", 1)[0]
                if tag not in WRITE_TAGS:
                    raise ToolError("[invalid_request] execute runs one INSERT, UPDATE, DELETE or MERGE")
                rows = max(cursor.rowcount, 0)
                await conn.execute("SELECT fleet_sql.finish_write(%s, %s)", (key, rows))
        except psycopg.Error as exc:
            raise ToolError(f"[tool_failed] the write did not happen: {pg_message(exc)}") from exc
        return WriteResult(idempotency_key=key, row_count=rows, replayed=False)

    async def write_status(self, tenant: str, key: str) -> WriteStatus:
        async with self._pools.connection(tenant) as conn, conn.transaction():
            row = await (
                await conn.execute(
                    "SELECT row_count, written_at FROM fleet_sql.write_status(%s) WHERE statement_hash IS NOT NULL",
                    (key,),
                )
            ).fetchone()
        if row is None:
            return WriteStatus(status="unknown", row_count=None, written_at=None)
        return WriteStatus(status="written", row_count=row[0], written_at=row[1].isoformat())


def _key(value: str) -> str:
    if not value.strip() or len(value) > 300:
        raise ToolError("[invalid_request] idempotency_key must be 1 to 300 characters")
    return value


def build_server(
    settings: SqlServerSettings, registry: RegistryClient, gate: ToolGate, tools: SqlTools
) -> MCPServer:
    mcp = fleet_mcp_server(
        "fleet-sql",
        settings,
        registry,
        "SQL over the caller's tenant data (schema tenant_data): read-only queries, and writes"
        " under an idempotency key where the operator allows them.",
    )

    @mcp.tool(annotations=READ_ONLY)
    async def query(sql: str) -> QueryResult:
        """Run one read-only SELECT over your tenant's data (tables tenant_data.invoices, tenant_data.payments)."""
        claims = await gate.allow("query", {"sql_length": len(sql)})
        return await tools.query(claims.tenant, sql)

    @mcp.tool(annotations=KEYED_WRITE)
    async def execute(sql: str, idempotency_key: str) -> WriteResult:
        """Run one INSERT, UPDATE, DELETE or MERGE on a writable table of your tenant, at most once per
        idempotency key: a repeat with the same key and statement returns the first result."""
        claims = await gate.allow("execute", {"sql_length": len(sql)})
        return await tools.execute(claims.tenant, sql, _key(idempotency_key), claims.sub)

    @mcp.tool(annotations=READ_ONLY)
    async def write_status(idempotency_key: str) -> WriteStatus:
        """Whether a write ran under this idempotency key, and how many rows it changed."""
        claims = await gate.allow("write_status", {})
        return await tools.write_status(claims.tenant, _key(idempotency_key))

    return mcp


def build_app_for(settings: SqlServerSettings) -> Starlette:
    pools = TenantPools(settings)

    @contextlib.asynccontextmanager
    async def resources() -> AsyncIterator[None]:
        async with await psycopg.AsyncConnection.connect(settings.pg_dsn, autocommit=True) as admin:
            await ensure_schema(admin, writable=tuple(settings.sql_writable_tables))
            for table in settings.sql_writable_tables:
                if table != "invoices":
                    async with admin.transaction():
                        await expose_table(admin, table, writable=True)
            if settings.seed_demo:
                await seed_demo_data(admin)
        try:
            yield
        finally:
            await pools.aclose()

    return tool_server_app(
        settings,
        tools=TOOLS,
        make_server=lambda registry, gate: build_server(settings, registry, gate, SqlTools(pools, settings)),
        resources=resources,
    )


async def main(settings: ServiceSettings) -> None:
    sql_settings = SqlServerSettings.from_env(settings.service_id)
    configure_logging(sql_settings.service_id, sql_settings.log_level)
    await serve_app(build_app_for(sql_settings), sql_settings)
