"""Run every benchmark and write ``docs/benchmarks.md``."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from bench import batch, checkpoint_overhead, delegation, throughput

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return (
        f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}; commit {commit or 'unknown'}; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC"
    )


def _row(name: str, result: dict[str, Any]) -> str:
    verdict = "meets" if result["ratio"] <= result["target_ratio"] else "MISSES"
    return (
        f"| {name} | {result['baseline']} | {result['baseline_ms_per_step']} ms "
        f"| {result['fleet_ms_per_step']} ms | **{result['ratio']}x** | <= {result['target_ratio']}x "
        f"({verdict}) |"
    )


def main() -> None:
    checkpoint = checkpoint_overhead.main()
    delegated = delegation.main()
    runs = throughput.main()
    batched = batch.main()
    crash = batched["crash"]
    batch_verdict = "meets" if batched["slowdown"] <= batched["target_slowdown"] else "MISSES"
    crash_verdict = (
        "meets"
        if crash["items_redone"] <= batched["max_redone"] and crash["duplicated_effects"] == 0
        else "MISSES"
    )
    parts = delegated["breakdown_ms"]
    latency = runs["resume_latency"]
    DOC.write_text(
        "# Benchmarks\n\n"
        "Written by `.venv/bin/python -m bench`, which runs every benchmark in `bench/`; each one\n"
        "measures the platform beside its baseline in the same run (interleaved rounds, medians).\n"
        "Numbers on a shared machine are noisy: read the ratios, not the milliseconds.\n\n"
        f"Machine: {_machine()}.\n\n"
        "| benchmark | baseline | baseline time | fleet time | ratio | target |\n"
        "|---|---|---|---|---|---|\n"
        f"{_row('checkpoint overhead per step', checkpoint)}\n"
        f"{_row('delegation overhead per step', delegated)}\n"
        f"| {batched['items']:,}-item batch, checkpoint every {batched['checkpoint_every']} | {batched['baseline']} "
        f"| {batched['baseline_s']} s | {batched['fleet_s']} s | **{batched['slowdown']:+.1%}** "
        f"| <= +{batched['target_slowdown']:.0%} ({batch_verdict}) |\n"
        f"| SIGKILL mid-batch, then resume | items redone, duplicated effects | | "
        f"{crash['items_redone']} redone, {crash['duplicated_effects']} duplicated | | "
        f"<= {batched['max_redone']} redone, 0 duplicated ({crash_verdict}) |\n\n"
        "## Checkpoint overhead per step\n\n"
        f"A run of {checkpoint['steps_per_run']} steps, one after another, {checkpoint['rounds']} rounds. "
        "The baseline is a bare\n"
        "LangGraph graph of the coordinator's shape (schedule, `Send` to delegate, fan in) on the same\n"
        "checkpointer. The fleet side is the real worker path: the lease, the graph with its\n"
        "checkpoints, the operations ledger (a durable intent before and a durable result after each\n"
        "step, one statement each), a fenced event-log append per event, the budget check, the terminal\n"
        "transition and artifact, and the pruning of the finished run's checkpoints (retention). The\n"
        "specialist call is replaced by an immediate return on both sides.\n\n"
        f"Pruning took {checkpoint['prune_ms_per_run']} ms per run; without it the ratio is "
        f"{checkpoint['ratio_without_pruning']}x.\n\n"
        "Why it misses 1.3x: the fleet makes about six more round trips to Postgres per step than the\n"
        "bare graph (the ledger's read, intent and result; three event appends), on top of a larger\n"
        "checkpointed state (plan, limits, call hashes). A durable commit costs about 0.3 ms here and a\n"
        "relaxed one about 0.15 ms, so most of the difference is round trips and Python, not fsync.\n"
        "Routing and start/completion markers already skip the WAL flush (the operation's own events\n"
        "are the durable record). What would close the gap: writing the step's events in the same\n"
        "statement as its ledger entries, and batching relaxed events.\n\n"
        "## Delegation overhead per step\n\n"
        f"{delegated['calls_per_round']} calls per round, {delegated['rounds']} rounds, to the same running specialist "
        "of a real stack\n"
        "(the statistician's `outliers` on inline records). Baseline: the a2a-sdk client alone, one\n"
        "streaming round trip. Fleet: `StepDispatcher.run`, a worker's per-step path without the\n"
        "checkpoint (the ledger's intent, the call with its operation id, the result). Where the time\n"
        f"goes: the delegator's call alone takes {parts['delegator_call_without_operation_id']} ms "
        f"(it builds an A2A client per call), {parts['delegator_call_with_operation_id']} ms with an "
        "operation id (the\n"
        "specialist journals the operation to SQLite before and after the skill), and the ledger's\n"
        f"intent and result add {parts['ledger_intent_and_result']} ms. The target is 1.5x plus the "
        "checkpoint; the ledger's\n"
        "two durable writes are what buys exactly-once effects across crashes.\n\n"
        "## Throughput and resume after a crash\n\n"
        f"{runs['runs_per_round']} one-step runs sent at once over A2A (median of three rounds):\n\n"
        "| workers | runs/s |\n|---|---|\n"
        f"| 2 | {runs['runs_per_s_2_workers']} |\n| 1 | {runs['runs_per_s_1_worker']} |\n\n"
        f"Two workers do {runs['scaling_2_vs_1']}x the work of one here: on 2 cores the whole stack "
        "(coordinator API,\n"
        "specialist, Postgres, NATS and the client sending the runs) shares the CPUs, and the workers\n"
        "are not the bottleneck. Workers scale out across machines; this box cannot show it.\n\n"
        f"Resume after a crash: the worker running a step was SIGKILLed; another worker resumed the run\n"
        f"{latency['to_resumed_s']} s later and completed it {latency['to_completed_s']} s after the kill "
        "(the new worker\n"
        "asks the specialist about the step's pending operation before anything is sent again). The\n"
        "bound is JetStream's ack\n"
        f"wait (set to {runs['ack_wait_s']} s here, lease {runs['lease_ttl_s']} s; the defaults are 30 "
        "and 15 s).\n\n"
        "## Batch runs\n\n"
        f"{batched['items']:,} items, each an effect (a review case, opened through the case desk and the "
        "cases MCP server with an\n"
        f"idempotency key per item), {batched['call_size']} items per call, each call a ledgered operation. "
        "The baseline is the same\n"
        "batch run through the coordinator with no checkpoint until the end; the fleet side checkpoints\n"
        f"its progress every {batched['checkpoint_every']} items. Median of {batched['rounds']} interleaved "
        "rounds each. A checkpoint here costs a few\n"
        "milliseconds (two supersteps) against about 80 ms of work per call, so the expected cost is a\n"
        "few percent; single runs vary by more than that on this machine, so read the ratio with care.\n\n"
        f"Then a run's worker was SIGKILLed at item {crash['killed_at_item']:,}; the other worker finished it "
        f"{crash['recovered_in_s']} s\n"
        f"later. At the tool: {crash['cases']:,} cases, {crash['duplicated_effects']} duplicated, "
        f"{crash['items_redone']} items sent again (a repeated key counts one; the call in flight is\n"
        "settled by asking the specialist, and sent again only if it never arrived).\n"
    )
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
