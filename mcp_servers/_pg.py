"""Postgres helpers shared by the MCP servers that keep tenant data."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import psycopg
from mcp.server.mcpserver import MCPServer
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette

from fleet import pgpool
from fleet.settings import ServiceSettings
from mcp_servers._base import ToolGate, tool_server_app
from registry import RegistryClient


async def discard_session_state(conn: psycopg.AsyncConnection[Any]) -> None:
    """Runs whenever a connection returns to the pool: nothing one call set survives it."""
    await conn.set_autocommit(True)  # DISCARD ALL cannot run inside a transaction
    await conn.execute("DISCARD ALL")
    await conn.set_autocommit(False)


WRITER_POOL_SIZE = 10
# The tool role's CONNECTION LIMIT: two pools, so that a restarting replica's new process can
# connect while the old one drains.
WRITER_CONNECTION_LIMIT = 2 * WRITER_POOL_SIZE


async def enable_login(admin: psycopg.AsyncConnection[Any], role: str, password: str) -> None:
    """Let ``role`` log in with ``password``, with at most :data:`WRITER_CONNECTION_LIMIT` sessions."""
    await admin.execute(
        sql.SQL("ALTER ROLE {} LOGIN CONNECTION LIMIT {} PASSWORD {}").format(
            sql.Identifier(role), sql.Literal(WRITER_CONNECTION_LIMIT), sql.Literal(password)
        )
    )


def pg_message(exc: psycopg.Error) -> str:
    """The server's own one-line reason (never the statement or its parameters)."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    return str(primary or type(exc).__name__)


def database_tool_app(
    settings: ServiceSettings,
    *,
    role: str,
    tools: Mapping[str, Sequence[str]],
    prepare: Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]],
    make_server: Callable[[RegistryClient, ToolGate, AsyncConnectionPool[Any]], MCPServer],
    more: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
) -> Starlette:
    """The app of an MCP server whose tools run fixed statements on its database through ``role``: a
    login role without superuser or BYPASSRLS and with a CONNECTION LIMIT, whose password only this
    process knows (set anew at every start, after ``prepare`` has made the schema with the service's
    own login). ``more``: other resources the tools need, entered after the pool."""
    password = secrets.token_urlsafe(24)
    pool = pgpool.pool(
        make_conninfo(settings.pg_dsn, user=role, password=password),
        min_size=1,
        max_size=WRITER_POOL_SIZE,
        kwargs={"prepare_threshold": None},
        reset=discard_session_state,
    )

    @contextlib.asynccontextmanager
    async def resources() -> AsyncIterator[None]:
        async with await psycopg.AsyncConnection.connect(settings.pg_dsn, autocommit=True) as admin:
            await prepare(admin)
            await enable_login(admin, role, password)
        async with pool, more() if more is not None else contextlib.nullcontext():
            yield

    return tool_server_app(
        settings,
        tools=tools,
        make_server=lambda registry, gate: make_server(registry, gate, pool),
        resources=resources,
    )
