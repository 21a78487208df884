"""Pools that survive their server dropping every session (a restart, a failover): the connections at
rest are dead, and the fleet's pools never hand one out; and an error of a lost connection is told
apart from a statement's own, as retryable ``dependency_unavailable``."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from fleet import pgpool
from fleet.errors import ErrorCode

SESSIONS = 3
DROP_OTHERS = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


async def warmed(pool: AsyncConnectionPool[Any]) -> AsyncConnectionPool[Any]:
    """``pool`` open with ``SESSIONS`` connections at rest."""
    await pool.open(wait=True, timeout=10)
    held = [await pool.getconn(timeout=10) for _ in range(SESSIONS)]
    for conn in held:
        await conn.execute("SELECT 1")
        await pool.putconn(conn)
    return pool


async def drop_every_session(dsn: str) -> None:
    """What a restart does to the sessions at rest: the server ends them (FATAL 57P01) and closes."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
        await admin.execute(DROP_OTHERS)
    await asyncio.sleep(0.2)


async def test_the_fleet_s_pool_hands_out_no_connection_its_server_dropped(pg_dsn: str) -> None:
    options: dict[str, Any] = {"min_size": SESSIONS, "max_size": SESSIONS, "kwargs": {"autocommit": True}}
    async with await warmed(pgpool.pool(pg_dsn, **options)) as fleet:
        await drop_every_session(pg_dsn)
        for _ in range(2 * SESSIONS):
            async with fleet.connection(timeout=10) as conn:
                assert await (await conn.execute("SELECT 1")).fetchone() == (1,)
        assert fleet.get_stats()["connections_lost"] >= SESSIONS

    # The pool as psycopg makes it, for comparison: each dead session fails the request that gets it.
    async with await warmed(AsyncConnectionPool(pg_dsn, open=False, **options)) as plain:
        await drop_every_session(pg_dsn)
        with pytest.raises(psycopg.OperationalError):
            async with plain.connection(timeout=10) as conn:
                await conn.execute("SELECT 1")


async def test_a_lost_connection_is_a_retryable_unavailability_and_a_bad_statement_is_not(
    pg_dsn: str,
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as lost:
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    assert pgpool.connection_lost(lost.value)
    failure = pgpool.db_failure(lost.value, "could not refund")
    assert failure.code == ErrorCode.DEPENDENCY_UNAVAILABLE and failure.retryable
    assert failure.message.startswith("could not refund: the database is unavailable")

    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as wrong:
            await conn.execute("SELECT * FROM no_such_table")
    assert not pgpool.connection_lost(wrong.value)
    refused = pgpool.db_failure(wrong.value, "could not refund")
    assert refused.code == ErrorCode.TOOL_FAILED and not refused.retryable
    assert "no_such_table" in refused.message and "SELECT" not in refused.message
