"""Helpers of the end-to-end tests that look at runs: their operations and events, a tenant's
tables, a stack of a test's own, a run parked at an approval gate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg

from fleetctl.testing.e2e import (
    Stack,
    event_of,
    send,
    start_stack,
    stop_stack,
    user_message,
)


@contextlib.contextmanager
def running(path: Path, env: dict[str, str]) -> Iterator[Stack]:
    stack = start_stack(path, env=env)
    try:
        yield stack
    finally:
        stop_stack(stack)


async def operations(stack: Stack, run_id: str, token: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/operations",
            headers={"Authorization": f"Bearer {token}"},
        )
    response.raise_for_status()
    ops: list[dict[str, Any]] = response.json()["operations"]
    return ops


async def count_rows(stack: Stack, table: str, where: str = "true", *params: Any) -> int:
    async with await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn:
        cursor = await conn.execute(f"SELECT count(*) FROM tenant_data.{table} WHERE {where}", params)
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


@contextlib.asynccontextmanager
async def table_locked(stack: Stack, table: str) -> AsyncIterator[None]:
    """Hold a lock that makes every write to ``table`` wait, as a stuck downstream system would."""
    # The lock goes with the transaction; the blocked writes then proceed.
    async with (
        await psycopg.AsyncConnection.connect(stack.pg_dsn("fleet_data")) as conn,
        conn.transaction(),
    ):
        await conn.execute(f"LOCK TABLE tenant_data.{table} IN EXCLUSIVE MODE")
        yield


async def events_so_far(stack: Stack, run_id: str, token: str) -> list[dict[str, Any]]:
    """The run's events up to now (a read with a short deadline, not a follow to the end)."""
    url = f"{stack.endpoints['coordinator']}/v1/runs/{run_id}/events"
    found: list[dict[str, Any]] = []
    with contextlib.suppress(httpx.ReadTimeout):
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=0.5)) as http,
            http.stream("GET", url, headers={"Authorization": f"Bearer {token}"}) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    found.append(event_of(line))
    return found


def victim_pid(tmp_path: Path) -> int:
    return int((tmp_path / "crashed").read_text())


async def run_when(
    stack: Stack, run_id: str, token: str, *states: str, timeout_s: float = 90
) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while True:
            run = await get_run(stack, run_id, token)
            if run["state"] in states:
                return run
            await asyncio.sleep(0.2)


async def paused_at_gate(stack: Stack, tenant: str, token: str, plan: dict[str, Any] | None = None) -> str:
    """Start a refund run and return its id once it waits at the gate (the caller saw input-required)."""
    async with asyncio.timeout(120):
        outcome = await send(stack, user_message(data=plan or refund()), token=token)
    assert outcome.state_name == "TASK_STATE_INPUT_REQUIRED", outcome.final_text
    assert "needs approval" in outcome.final_text
    return outcome.task_id


def refund(subject: str = "Contoso", cents: int = 25_000) -> dict[str, Any]:
    return {
        "steps": [
            {"id": "refund", "skill": "issue-refund", "input": {"subject": subject, "amount_cents": cents}}
        ]
    }


async def get_run(stack: Stack, run_id: str, token: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(
            f"{stack.endpoints['coordinator']}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {token}"}
        )
    response.raise_for_status()
    run: dict[str, Any] = response.json()
    return run
