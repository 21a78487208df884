"""LangGraph's checkpointer conformance suite (``langgraph-checkpoint-conformance``) against the
fleet's own checkpointer, :class:`coordinator.record.checkpoints.CompactCheckpointer`, on a real Postgres.

The suite detects which capabilities a saver implements (put, writes, get, list and delete are
required; pruning, copying a thread and deleting by run are optional) and runs its own tests of each;
every capability the saver has must pass all of them. Each capability gets a fresh saver on a fresh
schema, so one suite's leftovers cannot pass or fail another's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from langgraph.checkpoint.conformance import checkpointer_test, validate
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from coordinator.record.checkpoints import CompactCheckpointer

REQUIRED = {"put", "put_writes", "get_tuple", "list", "delete_thread"}


async def test_the_fleet_checkpointer_passes_langgraph_s_conformance_suite(pg_dsn: str) -> None:
    @checkpointer_test(name="CompactCheckpointer")
    async def compact() -> AsyncIterator[CompactCheckpointer]:
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            pg_dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
        )
        async with pool:
            async with pool.connection() as conn:  # a clean table for each capability's suite
                await conn.execute(sql.SQL("DROP TABLE IF EXISTS fleet_runs.checkpoints"))
            saver = CompactCheckpointer(pool)
            await saver.setup()
            yield saver

    report = await validate(compact)
    outcome = report.to_dict()
    failures = {
        name: result["failures"] for name, result in outcome["results"].items() if result["passed"] is False
    }
    assert failures == {}, failures
    detected = {name for name, result in outcome["results"].items() if result["detected"]}
    assert detected >= REQUIRED, outcome
    assert report.passed_all(), outcome
    ran = sum(result["tests_passed"] for result in outcome["results"].values())
    assert ran > 20, outcome  # the suite did run its tests, not skip them
