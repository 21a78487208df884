"""Postgres helpers shared by the MCP servers that keep tenant data."""

from __future__ import annotations

from typing import Any

import psycopg


async def discard_session_state(conn: psycopg.AsyncConnection[Any]) -> None:
    """Runs whenever a connection returns to the pool: nothing one call set survives it."""
    await conn.set_autocommit(True)  # DISCARD ALL cannot run inside a transaction
    await conn.execute("DISCARD ALL")
    await conn.set_autocommit(False)


def pg_message(exc: psycopg.Error) -> str:
    """The server's own one-line reason (never the statement or its parameters)."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    return str(primary or type(exc).__name__)
