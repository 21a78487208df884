"""The benchmarks in their short form, so that none rots unseen: each runs against the current code
with a few runs (its numbers mean nothing here) and its result has what the benchmarks page reads."""

from __future__ import annotations

import asyncio

import pytest

from bench import checkpoint_overhead, cost
from fleetctl.testing.postgres import embedded_postgres

pytestmark = pytest.mark.e2e


def test_the_cost_benchmark_runs_every_shape_and_its_floor() -> None:
    result = cost.run(runs=2, floor_calls=40, idle_s=1.0)
    assert set(result["shapes"]) == set(cost.SHAPE_PARTS)
    for name, shape in result["shapes"].items():
        assert shape["failed"] == 0, name
        assert shape["stack_cpu_ms_per_run"] > 0 and shape["floor_ms_per_run"] > 0, name
        assert len(shape["stack_cpu_ms_per_run_rounds"]) == cost.ROUNDS
    # the runs were served by the services that do them
    assert result["shapes"]["two-step"]["cpu_ms_per_run_by_service"]["sql-analyst"] > 0
    assert result["shapes"]["approved"]["cpu_ms_per_run_by_service"]["case-desk"] > 0
    floor = result["floor"]
    assert floor["a2a_round_trip"]["client_ms"] > 0 and floor["mcp_call"]["client_ms"] > 0
    assert set(floor["langgraph_on_postgres"]) == {"1", "2", "10"}
    assert result["memory_pss_mb_total"] > 100
    assert "## What a run costs" in cost.section(result) and "two-step run" in cost.summary_row(result)


def test_the_checkpoint_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """It crashed for weeks unseen (its stand-in delegator lacked a method the worker came to call)."""
    monkeypatch.setattr(checkpoint_overhead, "STEPS", 3)
    monkeypatch.setattr(checkpoint_overhead, "ROUNDS", 1)
    monkeypatch.setattr(checkpoint_overhead, "STATS_SETTLE_S", 0.5)
    with embedded_postgres() as dsn:
        result = asyncio.run(checkpoint_overhead.measure(dsn))
    assert result["baseline_ms_per_step"] > 0 and result["fleet_ms_per_step"] > 0
    assert result["per_step"]["fleet_commits"] > 0
