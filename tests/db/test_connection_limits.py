"""Every login role the fleet creates in Postgres has a CONNECTION LIMIT, and so has each database,
and the limits add up to less than the server's max_connections: one service (or one caller's load on
it) cannot take the connections that the others, and the superuser, need."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from deploy.local_stack import (
    DATABASE_CONNECTION_LIMITS,
    DATABASES,
    OWNER_CONNECTION_LIMITS,
    PG_MAX_CONNECTIONS,
)
from fleetctl.supervisor import ensure_database, ensure_owner_role
from mcp_servers._pg import WRITER_CONNECTION_LIMIT, enable_login

INIT_SH = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "postgres" / "init.sh"
SUPERUSER_RESERVED = 3  # Postgres's superuser_reserved_connections default


async def test_an_owner_role_and_its_database_get_their_limits_and_postgres_enforces_them(
    pg_server: str,
) -> None:
    name = f"owner_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await ensure_owner_role(admin, name, "pw", False, 5)
        await ensure_database(admin, name, 9)
        await ensure_owner_role(admin, name, "pw", False, 3)  # again: updated, not duplicated
        await ensure_database(admin, name, 8)
        role = await (
            await admin.execute("SELECT rolconnlimit FROM pg_roles WHERE rolname = %s", (name,))
        ).fetchone()
        database = await (
            await admin.execute("SELECT datconnlimit FROM pg_database WHERE datname = %s", (name,))
        ).fetchone()
        assert (role, database) == ((3,), (8,))
        dsn = make_conninfo(pg_server, user=name, password="pw", dbname=name)
        held = [await psycopg.AsyncConnection.connect(dsn) for _ in range(3)]
        try:
            with pytest.raises(psycopg.OperationalError, match="too many connections for role"):
                await psycopg.AsyncConnection.connect(dsn)
            # The superuser still gets in: the limit is the role's, not the server's.
            async with await psycopg.AsyncConnection.connect(pg_server) as other:
                assert await (await other.execute("SELECT 1")).fetchone() == (1,)
        finally:
            for conn in held:
                await conn.close()
            await admin.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(name)))
            await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


async def test_a_tool_servers_writer_role_gets_a_connection_limit(pg_server: str) -> None:
    name = f"writer_{uuid.uuid4().hex[:8]}"
    async with await psycopg.AsyncConnection.connect(pg_server, autocommit=True) as admin:
        await admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(name)))
        try:
            await enable_login(admin, name, "pw")
            row = await (
                await admin.execute(
                    "SELECT rolcanlogin, rolconnlimit FROM pg_roles WHERE rolname = %s", (name,)
                )
            ).fetchone()
            assert row == (True, WRITER_CONNECTION_LIMIT)
        finally:
            await admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_the_limits_add_up_to_less_than_max_connections_with_room_for_the_superuser() -> None:
    assert set(DATABASE_CONNECTION_LIMITS) == set(OWNER_CONNECTION_LIMITS) == set(DATABASES)
    assert all(OWNER_CONNECTION_LIMITS[db] <= DATABASE_CONNECTION_LIMITS[db] for db in DATABASES)
    assert sum(DATABASE_CONNECTION_LIMITS.values()) + SUPERUSER_RESERVED + 10 <= PG_MAX_CONNECTIONS


def test_the_deployment_init_script_sets_the_same_limits() -> None:
    script = INIT_SH.read_text()
    roles = dict(re.findall(r"CREATE ROLE (\w+) LOGIN [^;]*CONNECTION LIMIT (\d+)", script))
    databases = dict(re.findall(r"CREATE DATABASE (\w+) OWNER \w+ CONNECTION LIMIT (\d+)", script))
    assert {k: int(v) for k, v in roles.items()} == OWNER_CONNECTION_LIMITS
    assert {k: int(v) for k, v in databases.items()} == DATABASE_CONNECTION_LIMITS
    assert len(re.findall(r"CREATE ROLE \w+ LOGIN", script)) == len(roles)  # no login role without one
