"""The attack of SECURITY-REVIEW H1 on the real stack: one caller opens hundreds of event streams on a
run that waits. Each stream used to hold a Postgres connection of its own, and about 180 of them took
every connection of the server from every tenant and service. Now the coordinator refuses streams
over the policy's caps (``stream_limit``, 429 with ``Retry-After``; a JSON-RPC error over A2A), the
ones it serves share its one LISTEN connection, the fleet's Postgres roles carry connection limits,
and another tenant's run goes on being served."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import psycopg
import pytest
from a2a.types import SubscribeToTaskRequest
from a2a.utils.errors import A2AError

from fleet.a2a_support import error_of_a2a
from fleetctl.testing.e2e import Stack, user_message
from tests.e2e.a2a_helpers import a2a_client, as_tenant, fresh_tenant, start

pytestmark = pytest.mark.e2e

WAITS: dict[str, Any] = {"steps": [{"id": "hold", "wait": {"for_s": 3600}}]}  # parks for an hour
PER_PRINCIPAL = 16  # config.limits.streams.per_principal in the shipped policy
ATTACK_STREAMS = 200  # the server's max_connections


def person(stack: Stack, sub: str, tenant: str) -> str:
    return stack.forge(sub=sub, tenant=tenant, scope="agent:invoke")


async def waiting_run(stack: Stack, token: str, http: httpx.AsyncClient) -> str:
    task = await start(stack, token, user_message(data=WAITS))
    async with asyncio.timeout(60):
        while True:
            run = (await http.get(f"{runs_url(stack)}/{task.id}", headers=bearer(token))).json()
            if run.get("state") == "waiting":
                return str(task.id)
            await asyncio.sleep(0.2)


def runs_url(stack: Stack) -> str:
    return f"{stack.endpoints['coordinator']}/v1/runs"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def fleet_backends(stack: Stack) -> int:
    """Connections of the coordinator's and the workers' role (``fleet``) to Postgres now."""
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("postgres")) as conn:
        cursor = await conn.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = 'fleet'")
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_hundreds_of_streams_on_a_waiting_run_are_capped_and_postgres_connections_stay_flat(
    stack: Stack,
) -> None:
    tenant, other_tenant = fresh_tenant(), fresh_tenant()
    mallory, victim = person(stack, "mallory", tenant), person(stack, "victim", other_tenant)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), limits=limits) as http,
        contextlib.AsyncExitStack() as held,
    ):
        run_id = await waiting_run(stack, mallory, http)
        victims_run = await waiting_run(stack, victim, http)
        # The same burst of plain requests first, so that the coordinator's pool has grown to what
        # such a burst takes (at most its size) before the count is taken.
        await asyncio.gather(
            *(http.get(f"{runs_url(stack)}/{run_id}", headers=bearer(mallory)) for _ in range(ATTACK_STREAMS))
        )
        before = await fleet_backends(stack)

        async def open_stream() -> httpx.Response:
            request = http.build_request("GET", f"{runs_url(stack)}/{run_id}/events", headers=bearer(mallory))
            response = await http.send(request, stream=True)
            held.push_async_callback(response.aclose)
            return response

        answers = await asyncio.gather(*(open_stream() for _ in range(ATTACK_STREAMS)))
        statuses = [a.status_code for a in answers]
        # The run's own SendMessage relay may still hold one of the principal's slots while it waits.
        served = statuses.count(200)
        assert PER_PRINCIPAL - 1 <= served <= PER_PRINCIPAL
        assert statuses.count(429) == ATTACK_STREAMS - served
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.headers["retry-after"].isdigit()
        await refused.aread()
        assert refused.json()["error"]["code"] == "stream_limit"

        # Over A2A too: the same principal's subscription is a JSON-RPC error with the code.
        async with a2a_client(stack) as client:
            with pytest.raises(A2AError, match="streams may be open at once") as refused_a2a:
                async for _ in client.subscribe(
                    SubscribeToTaskRequest(id=run_id), context=as_tenant(mallory)
                ):
                    pass
        envelope = error_of_a2a(refused_a2a.value)  # the code and when to try again, as data
        assert (envelope.code, envelope.retryable) == ("stream_limit", True) and envelope.retry_after_s

        # The streams it holds cost the coordinator no connection of their own.
        assert await fleet_backends(stack) <= before + 2  # a worker's pool may open one meanwhile

        # Another tenant's run is still served, and Postgres still takes connections.
        response = await held.enter_async_context(
            http.stream("GET", f"{runs_url(stack)}/{victims_run}/events", headers=bearer(victim))
        )
        assert response.status_code == 200
        lines = aiter(response.aiter_lines())
        assert (await anext(lines)) == "id: 1"
        async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet")) as conn:
            assert await (await conn.execute("SELECT 1")).fetchone() == (1,)


async def test_the_fleets_postgres_roles_and_databases_have_connection_limits(stack: Stack) -> None:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("postgres")) as conn:
        roles = await (
            await conn.execute(
                "SELECT rolname, rolconnlimit FROM pg_roles WHERE rolcanlogin AND NOT rolsuper"
            )
        ).fetchall()
        databases: dict[str, int] = dict(
            await (
                await conn.execute(
                    "SELECT datname, datconnlimit FROM pg_database WHERE datname LIKE 'fleet%'"
                )
            ).fetchall()
        )
    assert roles and all(limit > 0 for _, limit in roles), roles  # -1 is "no limit"
    assert {"fleet", "fleet_data"} <= {name for name, _ in roles}
    assert databases == {"fleet": 80, "fleet_data": 100}
