"""The benchmarks that measure a running stack, in their short form on one stack they share (started
once for this module: three workers, the refund trigger rule, short leases so that a killed worker's
run moves on in seconds), so that none can rot unseen without a stack start each. Each runs its own
code against the current code with a few runs; its numbers mean nothing here, but a benchmark that
crashes, or whose result lacks what the benchmarks page reads, fails. The two that SIGKILL a worker
(throughput's resume, batch's crash) come last, in that order, each leaving a worker to the next.
The memory and telemetry benchmarks, which start no stack, are here too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench import batch, delegation, memory, pauses, scaling, telemetry, throughput, tokens
from bench.throughput import Fleet
from fleetctl.layout import StackLayout
from fleetctl.testing.nats import embedded_nats
from fleetctl.testing.pauses import dsn, refund_policy, submitted_paused_disk
from fleetctl.testing.stack import running_stack

pytestmark = pytest.mark.e2e

Running = tuple[StackLayout, dict[str, Any]]


@pytest.fixture(scope="module")
def bench_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("bench-stack")
    bundle = refund_policy(tmp / "policy")
    settings = {
        "FLEET_POLICY_DIR": str(bundle),
        "FLEET_WORKERS": "3",
        "FLEET_LEASE_TTL_S": str(throughput.LEASE_TTL_S),
        "FLEET_ACK_WAIT_S": str(throughput.ACK_WAIT_S),
    }
    with running_stack(tmp / "fleet", **settings) as running:
        yield running


def test_the_tokens_benchmark_runs(bench_stack: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "VERIFY_ROUNDS", 1)
    monkeypatch.setattr(tokens, "VERIFY_PER_ROUND", 50)
    monkeypatch.setattr(tokens, "ISSUE_N", 40)
    monkeypatch.setattr(tokens, "REVOKED", 5)
    monkeypatch.setattr(tokens, "REACH_TRIES", 1)
    with embedded_nats() as nats_url:
        verified = asyncio.run(tokens.verification(nats_url))
        issued = asyncio.run(tokens.issuance(nats_url))
    reach = asyncio.run(tokens.revocation_reach(*bench_stack))
    assert verified["verify_p50_us"] > 0 and verified["verify_bare_pyjwt_p50_us"] > 0
    assert issued["grant_per_s_sequential"] > 0 and issued["grant_per_s_concurrent"] > 0
    assert len(reach["reach_slowest_s"]) == 1 and set(reach["reach_median_s_by_service"]) >= {"coordinator"}


def test_the_delegation_benchmark_runs(bench_stack: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delegation, "CALLS", 4)
    monkeypatch.setattr(delegation, "ROUNDS", 1)
    layout, endpoints = bench_stack
    result = asyncio.run(delegation.measure(layout, endpoints, dsn(layout, endpoints, "fleet")))
    assert result["baseline_ms_per_step"] > 0 and result["fleet_ms_per_step"] > 0
    assert result["bare_round_trip_ms"] > 0 and result["target_ratio"] == 1.3
    assert set(result["breakdown_ms"]) >= {"delegator_call_with_operation_id", "ledger_intent_and_result"}


def test_the_pauses_benchmark_s_approval_latency_runs(
    bench_stack: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(Its scale part, thousands of paused runs, is tests/e2e/test_pause_at_scale.py at 200.)"""
    monkeypatch.setattr(pauses, "LATENCY_RUNS", 3)
    layout, endpoints = bench_stack
    latencies = asyncio.run(pauses._approval_latency(layout, endpoints))
    floor = asyncio.run(pauses._delivery_floor(endpoints))
    assert len(latencies) == 3 and all(s > 0 for s in latencies)
    assert len(floor) == 3


def test_the_pauses_benchmark_counts_the_disk_of_runs_a_caller_submits(bench_stack: Running) -> None:
    disk = asyncio.run(submitted_paused_disk(*bench_stack, 5))
    # every table such a run writes to, found in the schema: a caller's run keeps its context, its
    # grant and its task record besides what a triggered run keeps
    assert {"runs", "events", "operations", "checkpoints", "run_grants", "a2a_tasks", "a2a_contexts"} <= set(
        disk["by_table"]
    ), disk
    assert disk["live"] == pytest.approx(
        sum(t["live"] for t in disk["by_table"].values()), abs=len(disk["by_table"])
    )
    assert 0 < disk["live"] <= disk["grown"]


def test_the_scaling_benchmark_measures_a_point(
    bench_stack: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One point of its curve, on this stack's three workers (the curve starts a stack per point)."""
    monkeypatch.setattr(scaling, "REPEATS", 1)
    monkeypatch.setattr(scaling, "ALONE", 1)
    layout, endpoints = bench_stack

    async def measure() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
            return await scaling._measure(Fleet(layout, endpoints, http), 3, 6, scaling._roots(endpoints, {}))

    point = asyncio.run(measure())
    assert point["runs_per_s"] > 0 and point["stack_cpu_ms_per_run"] > 0
    assert sum(ms for name, ms in point["cpu_ms_per_run_by_process"].items() if name.startswith("worker")) > 0
    assert "specialists and MCP servers" in point["cpu_ms_per_run_by_role"]


def test_the_throughput_benchmark_runs_and_a_killed_worker_s_run_resumes(
    bench_stack: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(throughput, "RUNS", 4)
    result = asyncio.run(throughput.measure(*bench_stack))
    assert result["runs_per_s_2_workers"] > 0 and result["runs_per_s_1_worker"] > 0
    latency = result["resume_latency"]
    assert 0 < latency["to_resumed_s"] <= latency["to_completed_s"]


def test_the_batch_benchmark_runs_and_its_crash_duplicates_nothing(
    bench_stack: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch, "ITEMS", 200)
    monkeypatch.setattr(batch, "CALL_SIZE", 10)
    monkeypatch.setattr(batch, "EVERY", 20)
    monkeypatch.setattr(batch, "ROUNDS", 1)
    result = asyncio.run(batch.measure(*bench_stack))
    assert result["baseline_s"] > 0 and result["fleet_s"] > 0
    crash = result["crash"]
    assert crash["cases"] == 200 and crash["duplicated_effects"] == 0, crash
    assert crash["killed_at_item"] >= 100


def test_the_memory_benchmark_runs() -> None:
    result = memory.run(rounds=1, per_round=128, vectors_in_all=5_000)
    for variant in (result, result["exact_model"]):
        assert variant["writes"]["governed_per_s"] > 0 and variant["recall"]["recall_p50_ms"] > 0
        assert variant["retrieval"]["queries"] > 0
    assert set(result["scanner"]) == {"pii_corpus", "pii_holdout", "pii_independent"}


def test_the_telemetry_benchmark_runs() -> None:
    result = telemetry.run(rounds=1, calls=5)
    assert result["calls"] == 5 and result["on_p50_ms"] > 0 and result["off_p50_ms"] > 0
    assert result["export_requests"] > 0  # the spans reached the collector
