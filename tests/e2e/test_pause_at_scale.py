"""Runs paused at a gate hold no process: a few hundred of them wait while no worker process is
alive, their approvals arrive with no worker either, and when workers start again every run resumes
and refunds exactly once (counted at the tool). The same scenario at 10,000 runs is a benchmark
(``bench/pauses.py``), which also reports the disk a paused run takes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetctl.testing.e2e import Stack, clean_env, start_stack, stop_stack
from fleetctl.testing.pauses import pause_and_resume, refund_policy

pytestmark = pytest.mark.e2e

RUNS = 200


@pytest.fixture
def refund_stack(tmp_path: Path) -> Iterator[Stack]:
    bundle = refund_policy(tmp_path / "policy")
    stack = start_stack(tmp_path / "fleet", env=clean_env(FLEET_POLICY_DIR=str(bundle)))
    yield stack
    stop_stack(stack)


async def test_paused_runs_wait_with_no_worker_alive_and_each_resumes_once(refund_stack: Stack) -> None:
    stack = refund_stack
    report: dict[str, Any] = await asyncio.wait_for(
        pause_and_resume(stack.layout, stack.endpoints, RUNS, timeout_s=300), 900
    )
    assert report["effects_while_paused"] == 0  # the gate held every refund back
    assert report["workers_alive_while_paused"] == []
    assert report["leases_held_while_paused"] == 0
    assert report["queued_without_workers"] == RUNS  # approved, waiting for any worker
    # Every run refunded once, with its approval, and each logged one approval, one end and two
    # operations (the gated call and the approved one).
    assert report["refunds"] == report["distinct_subjects"] == report["refunds_with_approval"] == RUNS
    assert report["max_attempts_at_tool"] == 1
    assert report["failed_after_approval"] == {}
    assert report["per_run_events"] == [(1, 1, 2)]
    assert report["disk_bytes_per_paused_run"] > 0
    # every table the paused runs wrote to is counted (found in the schema, not listed by hand)
    counted = report["disk_bytes_per_paused_run_by_table"]
    assert {"runs", "events", "operations", "checkpoints"} <= set(counted), counted
    assert all(sizes["live"] > 0 for sizes in counted.values()), counted
    assert (
        report["disk_growth_bytes_per_paused_run_before_vacuum"]
        >= report["disk_compacted_bytes_per_paused_run"]
    )
