"""The SQL MCP server process: SQL written by a model, run so that the database itself keeps every
tenant to its own rows whatever statement arrives.

- Each call runs on a connection that logged in as the caller's tenant role (see ``_schema``), taken
  from the verified token only. Row-level security keys on that login, which no statement can change.
- Every statement first passes the guard (``_guard``): functions and relations outside an allow-list
  are refused (``sql_refused``) before anything runs.
- ``query``: one SELECT (or VALUES), in a read-only transaction with a statement timeout, run by
  ``fleet_sql.query_rows``: at most ``max_rows`` rows and ``sql_max_result_bytes`` bytes leave the
  server (``result_too_large`` past that), and no error quotes more than 500 characters.
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
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool
from pydantic import Field
from starlette.applications import Starlette

from fleet import pgpool
from fleet.errors import ErrorCode, FleetError
from fleet.pgpool import connection_lost, db_failure
from fleet.service import configure_logging
from fleet.settings import ServiceSettings
from mcp_servers._base import (
    KEYED_WRITE,
    READ_ONLY,
    ToolGate,
    fleet_mcp_server,
    serve_mcp,
    tool_server_app,
)
from mcp_servers._pg import discard_session_state, pg_message
from mcp_servers.sql._guard import StatementRefused, check_statement, trimmed
from mcp_servers.sql._schema import (
    RESULT_TOO_LARGE_SQLSTATE,
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
MAX_REASON_CHARS = 500


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
    # 16 pools x 4 connections: what the fleet_data database's CONNECTION LIMIT (100) leaves it
    # beside mcp-cases and mcp-outbox (docs/limits.md); the least recently used tenant's pool closes.
    sql_max_tenant_pools: int = 16
    sql_max_result_bytes: int = Field(
        default=1_048_576,
        ge=1,
        description="bytes of a query's rows (their text form) that the query tool returns at most",
    )


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


async def _describe(conn: psycopg.AsyncConnection[Any], statement: str) -> tuple[list[str], list[str]]:
    """The names and types (as Postgres writes them) of ``statement``'s columns, planned but not run."""
    await conn.execute("SELECT fleet_sql.describe_query(%s)", (statement,))
    cursor = await conn.execute('FETCH ALL FROM "fleet_describe"')
    result = cursor.pgresult
    assert result is not None
    names = [column.name for column in cursor.description or []]
    oids = [result.ftype(i) for i in range(result.nfields)]
    modifiers = [result.fmod(i) for i in range(result.nfields)]
    await conn.execute('CLOSE "fleet_describe"')
    # A pseudo-type other than record (void, from a function that returns nothing) cannot be a column
    # of the result: its text form (what the cursor sent before) stands in.
    types = await conn.execute(
        "SELECT CASE WHEN y.typtype = 'p' AND y.oid <> 'pg_catalog.record'::pg_catalog.regtype"
        " THEN 'text' ELSE pg_catalog.format_type(c.t, c.m) END"
        " FROM unnest(%s::oid[], %s::int[]) WITH ORDINALITY AS c(t, m, i)"
        " JOIN pg_catalog.pg_type y ON y.oid = c.t ORDER BY c.i",
        (oids, modifiers),
    )
    return names, [str(row[0]) for row in await types.fetchall()]


def _reason(exc: psycopg.Error) -> str:
    """Postgres's reason, cut to ``MAX_REASON_CHARS``: some quote a whole value (an invalid cast)."""
    reason = pg_message(exc)
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "..."


def _refused(exc: psycopg.Error, doing: str) -> FleetError:
    """``invalid_request`` with Postgres's reason, or ``dependency_unavailable`` (retryable) when
    the database went away rather than refused the statement."""
    if connection_lost(exc):
        return db_failure(exc, doing)
    return FleetError(ErrorCode.INVALID_REQUEST, f"{doing}: {_reason(exc)}")


def _result_detail(exc: psycopg.Error) -> tuple[str, str, str]:
    """Rows and bytes within the cap, and the bytes of the row past it (``fleet_sql.query_rows``)."""
    rows, kept, row_bytes, *_ = [*(exc.diag.message_detail or "").split(), "?", "?", "?"]
    return rows, kept, row_bytes


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
        pool = pgpool.pool(
            make_conninfo(self._settings.pg_dsn, user=role, password=role_password(self._secret, role)),
            min_size=1,
            max_size=self._settings.sql_connections_per_tenant,
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

    async def query(self, tenant: str, statement: str, caller: str = "") -> QueryResult:
        """Run one SELECT (or VALUES) for ``tenant``.

        The statement passes the guard (``_guard``: only allowed functions and relations), then runs in
        a read-only transaction through ``fleet_sql.describe_query`` (its columns: it must fit in
        ``SELECT * FROM (...)``, so one SELECT or VALUES) and ``fleet_sql.query_rows`` (its rows: at
        most ``max_rows + 1``, and no row that takes the result past ``sql_max_result_bytes``, counted
        by Postgres before the row is sent). Both run the statement inside a handler that cuts an
        error's reason, so no error quotes a long value back either.
        """
        statement = trimmed(statement)
        async with self._pools.connection(tenant) as conn, conn.transaction():
            # Read-write only while the guard creates (and rolls back) its temporary function.
            await conn.execute("SET TRANSACTION READ WRITE")
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, true)",
                (str(self._settings.statement_timeout_ms),),
            )
            await self._guard(conn, tenant, caller, statement)
            await conn.execute("SET TRANSACTION READ ONLY")
            try:
                columns, types = await _describe(conn, statement)
                if not columns:
                    raise FleetError(ErrorCode.INVALID_REQUEST, "a query must return at least one column")
                # Each column as the type the description names (a domain's base type, as the protocol
                # describes it), under a name of ours (the statement's may repeat).
                names = [sql.Identifier(f"c{i}") for i in range(len(columns))]
                typed = [
                    sql.SQL("{} {}").format(name, sql.SQL(kind))
                    for name, kind in zip(names, types, strict=True)
                ]
                rows_of = sql.SQL("SELECT {} FROM ({}\n) AS fleet_r ({})").format(
                    sql.SQL(", ").join(
                        sql.SQL("{}::{}").format(name, sql.SQL(kind))
                        for name, kind in zip(names, types, strict=True)
                    ),
                    sql.SQL(statement),
                    sql.SQL(", ").join(names),
                )
                cursor = await conn.execute(
                    sql.SQL("SELECT * FROM fleet_sql.query_rows(%s, %s, %s) AS fleet_q ({})").format(
                        sql.SQL(", ").join(typed)
                    ),
                    (
                        rows_of.as_string(conn),
                        self._settings.max_rows + 1,
                        self._settings.sql_max_result_bytes,
                    ),
                )
                rows = await cursor.fetchall()
            except psycopg.Error as exc:
                raise self._refusal(exc, tenant, caller) from exc
        truncated = len(rows) > self._settings.max_rows
        rows = rows[: self._settings.max_rows]
        return QueryResult(
            columns=columns,
            rows=[[_jsonable(v) for v in row] for row in rows],
            row_count=len(rows),
            truncated=truncated,
        )

    async def _guard(
        self, conn: psycopg.AsyncConnection[Any], tenant: str, caller: str, statement: str
    ) -> None:
        """Refuse ``statement`` (``sql_refused``) if it calls a function or reads a relation that a
        tenant's statement may not (see ``_guard``)."""
        try:
            await check_statement(conn, statement)
        except StatementRefused as exc:
            log.warning("sql_refused tenant=%s caller=%s uses=%s", tenant, caller or "-", exc)
            raise FleetError(
                ErrorCode.SQL_REFUSED,
                f"the statement uses {exc}, which the SQL tool does not allow;"
                " it may call the built-in functions that compute on values, and read tenant_data"
                " and information_schema",
            ) from exc
        except psycopg.Error as exc:
            raise _refused(exc, "the database refused the statement") from exc

    def _refusal(self, exc: psycopg.Error, tenant: str, caller: str) -> FleetError:
        """The tool's answer to a query the database stopped."""
        if exc.sqlstate != RESULT_TOO_LARGE_SQLSTATE:
            return _refused(exc, "the database refused the query")
        cap = self._settings.sql_max_result_bytes
        rows, kept, row_bytes = _result_detail(exc)
        log.warning(
            "result_too_large tenant=%s caller=%s cap=%d rows_within_cap=%s bytes_within_cap=%s next_row=%s",
            tenant,
            caller or "-",
            cap,
            rows,
            kept,
            row_bytes,
        )
        return FleetError(
            ErrorCode.RESULT_TOO_LARGE,
            f"the result is larger than the {cap} bytes the SQL tool returns:"
            f" {rows} rows ({kept} bytes) fit, the next row has {row_bytes} bytes; select fewer rows or"
            " columns, shorten long values, or aggregate",
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
            raise FleetError(ErrorCode.INVALID_REQUEST, "execute runs one INSERT, UPDATE, DELETE or MERGE")
        digest = statement_hash(statement)
        try:
            async with self._pools.connection(tenant) as conn, conn.transaction():
                await conn.execute("SET TRANSACTION READ WRITE")
                await conn.execute(
                    "SELECT set_config('statement_timeout', %s, true)",
                    (str(self._settings.statement_timeout_ms),),
                )
                await self._guard(conn, tenant, caller, statement)
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
                        raise FleetError(
                            ErrorCode.CONFLICT,
                            "this idempotency key was used for another statement; use a new key",
                        )
                    return WriteResult(idempotency_key=key, row_count=int(recorded_rows or 0), replayed=True)
                cursor = conn.cursor()
                try:
                    await cursor.execute(statement, binary=True)
                except psycopg.Error as exc:
                    raise _refused(exc, "the database refused the statement") from exc
                tag = (cursor.statusmessage or "").split(" ", 1)[0]
                if tag not in WRITE_TAGS:
                    raise FleetError(
                        ErrorCode.INVALID_REQUEST, "execute runs one INSERT, UPDATE, DELETE or MERGE"
                    )
                rows = max(cursor.rowcount, 0)
                await conn.execute("SELECT fleet_sql.finish_write(%s, %s)", (key, rows))
        except psycopg.Error as exc:
            raise db_failure(exc, "the write did not happen") from exc
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
        raise FleetError(ErrorCode.INVALID_REQUEST, "idempotency_key must be 1 to 300 characters")
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
        return await tools.query(claims.tenant, sql, claims.sub)

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
    await serve_mcp(build_app_for(sql_settings), sql_settings)
