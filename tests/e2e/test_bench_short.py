"""The benchmarks in their short form, so that none rots unseen: each runs against the current code
with a few runs (its numbers mean nothing here) and its result has what the benchmarks page reads.
(The bus and abuse benchmarks have theirs beside their own tests: tests/broker/test_bench_bus.py,
tests/e2e/test_bench_abuse.py.)"""

from __future__ import annotations

import asyncio

import pytest

from bench import checkpoint_overhead, cost, events, footprint, policy_plane, tool_plane
from fleetctl.testing.e2e import Stack
from fleetctl.testing.nats import embedded_nats
from fleetctl.testing.postgres import embedded_postgres

pytestmark = pytest.mark.e2e


def test_the_cost_benchmark_runs_every_shape_and_its_floor() -> None:
    result = cost.run(runs=2, floor_calls=40, idle_s=1.0, stats_settle_s=0.0)
    assert set(result["shapes"]) == set(cost.SHAPE_PARTS)
    for name, shape in result["shapes"].items():
        assert shape["failed"] == 0, name
        assert shape["stack_cpu_ms_per_run"] > 0 and shape["floor_ms_per_run"] > 0, name
        assert len(shape["stack_cpu_ms_per_run_rounds"]) == cost.ROUNDS
    # the runs database's commits are read (statistics reach it within a second: over every round)
    assert sum(shape["postgres_commits_per_run"] for shape in result["shapes"].values()) > 0
    # the runs were served by the services that do them
    assert result["shapes"]["two-step"]["cpu_ms_per_run_by_service"]["sql-analyst"] > 0
    assert result["shapes"]["approved"]["cpu_ms_per_run_by_service"]["case-desk"] > 0
    floor = result["floor"]
    assert floor["a2a_round_trip"]["client_ms"] > 0 and floor["mcp_call"]["client_ms"] > 0
    assert set(floor["langgraph_on_postgres"]) == {"1", "2", "10"}
    assert result["memory_pss_mb_total"] > 100
    assert "## What a run costs" in cost.section(result) and "two-step run" in cost.summary_row(result)


def test_the_footprint_benchmark_starts_the_stack_both_ways_and_runs_through_each() -> None:
    result = footprint.run(rounds=1, runs=2)
    assert result["failed"] == 0
    for way, measured in result["by_way"].items():
        assert measured["up_s"] > measured["services_s"] > 0, way
        assert measured["pss_loaded_mb"] > 100 and measured["cpu_ms_per_run"] > 0, way
    forked = result["forked_pss_loaded_mb_by_process"]
    assert forked["forkserver"] > 0 and forked["sql-analyst"] > 0
    assert "## The local stack's footprint" in footprint.section(result)
    assert "local stack's memory" in footprint.summary_row(result)


def test_the_checkpoint_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """It crashed for weeks unseen (its stand-in delegator lacked a method the worker came to call)."""
    monkeypatch.setattr(checkpoint_overhead, "STEPS", 3)
    monkeypatch.setattr(checkpoint_overhead, "ROUNDS", 1)
    monkeypatch.setattr(checkpoint_overhead, "STATS_SETTLE_S", 0.5)
    with embedded_postgres() as dsn:
        result = asyncio.run(checkpoint_overhead.measure(dsn))
    assert result["baseline_ms_per_step"] > 0 and result["fleet_ms_per_step"] > 0
    assert result["per_step"]["fleet_commits"] > 0


def test_the_tool_plane_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tool_plane, "ROWS", 2_000)
    with embedded_nats() as nats_url:
        gated = asyncio.run(tool_plane.gate(nats_url, rounds=2, per_round=10))
    started = asyncio.run(tool_plane.sandbox_start(n=3))
    with embedded_postgres() as dsn:
        sql = asyncio.run(tool_plane.sql_million(dsn, n=2))
    for part in (gated, started, sql):
        assert part and all(v is not None for v in part.values())
    assert sql["sql_rows"] == 2_000


def test_the_policy_plane_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_plane, "FOLLOWERS", 2)
    monkeypatch.setattr(policy_plane, "PUSHES", 2)
    decided = asyncio.run(policy_plane.decisions(n=200))
    with embedded_nats() as url:
        pushed = asyncio.run(policy_plane.push_to_enforced(url))
    assert decided and pushed["pushes"] == 2 and pushed["enforced"]["max_ms"] > 0


def test_the_events_benchmark_runs_on_the_shared_stack(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ingest, event-to-run latency and admission with a few events each (its workers keep running:
    the stack is shared; the admission's tenant is under the shipped ingest rate's burst)."""
    monkeypatch.setattr(events, "INGEST_EVENTS", 60)
    monkeypatch.setattr(events, "LATENCY_EVENTS", 3)
    monkeypatch.setattr(events, "ADMIT_EVENTS", 20)
    result = asyncio.run(events.measure(stack.endpoints, stack.pg_dsn("fleet"), stop=False))
    assert result["ingest_per_s_with_dedup"] > 0 and result["event_to_run_p50_ms"] > 0
    assert result["admission"]["events"] == 20 and result["admission"]["runs_admitted_per_s"] > 0
