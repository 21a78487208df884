"""Faults between hosts under load, the long form: the fleet across three hosts and the operator's
(network namespaces, ``fleetctl.testing.netfleet``), a steady workload of refunds through each fault
(``fleetctl.testing.netfaults``), and what the checker found afterwards. The suite runs the same
faults short (``tests/netlab/test_fleet_across_hosts.py``).

What is measured, per fault: the runs asked for and completed, lost and duplicated (from the run
store and the tool's own records, not from the client), gaps in event logs; the baseline (the median
time from asking for a run to seeing it completed, before the fault), how many runs were delayed
(over twice that and a second more), the slowest, and the recovery: from the heal until the last run
that was in flight during the fault ended.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from fleetctl.testing.netfaults import LATENCY_MS, Shape, clean, run_all

LONG = Shape(runs=60, interval_s=0.5, lead_s=6.0, hold_s=20.0, deadline_s=900.0)


def main(shape: Shape = LONG) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-netfaults-") as work:
        results = run_all(Path(work), shape)
    out = summarize(results["faults"], shape)
    print(json.dumps({k: v for k, v in out.items() if k != "faults"}, indent=2))
    for f in out["faults"]:
        print(
            f"{f['fault']:<24} {f['completed']}/{f['asked']} completed, lost {f['lost']}, duplicated "
            f"{f['duplicated']}, gaps {f['gaps']}; delayed {f['runs_delayed']}, slowest {f['slowest_s']} s, "
            f"recovered {f['recovered_s']} s after the heal"
        )
    return out


def summarize(results: list[dict[str, Any]], shape: Shape) -> dict[str, Any]:
    """What the page keeps of each fault's result (``fleetctl.testing.netfaults.run_fault``)."""
    faults = []
    for result in results:
        t, c = result["timeline"], result["check"]
        faults.append(
            {
                "fault": result["fault"],
                "target_host": result["target_host"],
                "made_s": result["made_s"],
                "fault_s": t["fault_s"],
                "asked": c["asked"],
                "completed": c["completed"],
                "lost": len(c["lost"]),
                "duplicated": len(c["duplicated"]),
                "gaps": len(c["gaps"]),
                "reordered": len(c["reordered"]),
                "refunds": c["refunds"],
                "retried_effects": c["retried_effects"],
                "baseline_median_s": t["baseline_median_s"],
                "runs_delayed": t["runs_delayed"],
                "slowest_s": t["slowest_s"],
                "recovered_s": t["recovered_s"],
                "demo_passed": result.get("demo_passed"),
                "clean": clean(result),
                "runs": t["runs"],
            }
        )
    return {
        "benchmark": "netfaults",
        "shape": {
            "runs": shape.runs,
            "interval_s": shape.interval_s,
            "lead_s": shape.lead_s,
            "hold_s": shape.hold_s,
        },
        "latency_ms": LATENCY_MS,
        "faults": faults,
        "all_clean": all(f["clean"] for f in faults),
    }


def summary_row(result: dict[str, Any]) -> str:
    faults = result["faults"]
    return (
        f"| runs through {len(faults)} faults between hosts (partitions, latency, a Postgres restart), the "
        f"demo during each | | | {sum(f['asked'] for f in faults)} runs: {sum(f['lost'] for f in faults)} lost, "
        f"{sum(f['duplicated'] for f in faults)} duplicated, {sum(f['gaps'] for f in faults)} event-log gaps; "
        f"demos passed: {sum(1 for f in faults if f.get('demo_passed'))}/{len(faults)}; recovered within "
        f"{max(f['recovered_s'] for f in faults)} s of each heal | "
        f"| 0 lost, 0 duplicated, no gap ({'meets' if result['all_clean'] else 'MISSES'}) |"
    )


def section(result: dict[str, Any]) -> str:
    shape = result["shape"]
    rows = "".join(
        f"| {f['fault']} | {f['target_host']} | {f['fault_s']} s | {f['completed']}/{f['asked']} | {f['lost']} "
        f"| {f['duplicated']} | {f['gaps']} | {f['baseline_median_s']} s | {f['runs_delayed']} | {f['slowest_s']} s "
        f"| {f['recovered_s']} s | {'passed' if f.get('demo_passed') else 'FAILED' if f.get('demo_passed') is False else 'not run'} |\n"
        for f in faults_of(result)
    )
    timelines = "".join(_timeline(f) for f in faults_of(result))
    return (
        "## Faults between hosts (`bench/netfaults.py`)\n\n"
        "The compose deployment across three hosts and the operator's, each a network namespace with its "
        "own address, joined by a switch that can drop, delay and lose frames (`fleetctl.testing.netlab`): "
        "a NATS node per host (3 replicas), Postgres on one, TLS everywhere "
        "([deployment](deployment.md#across-hosts-the-namespaces-harness)). For each fault, its own tenant "
        f"asks for {shape['runs']} refund runs, one each {shape['interval_s']} s, from the operator's host "
        f"(an `Idempotency-Key` each, sent again while unanswered); the fault starts {shape['lead_s']} s in, "
        "once the first runs have ended (the baseline its delays are measured against), "
        f"and is held {shape['hold_s']} s (a restart is over when Postgres answers again), while `fleet demo` "
        "runs from the operator's host, started with the workload. Afterwards a "
        "checker reads the run store (runs, event logs, the operations ledger) and the refund tool's own "
        "table: a lost run is one the client had accepted that did not complete with its refund; a "
        "duplicate is a subject refunded twice, a run with two refunds, or a run nobody asked for.\n\n"
        "| fault | host | held | completed | lost | duplicated | log gaps | baseline (median) | delayed "
        "| slowest | recovered after the heal | demo during it |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"{rows}\n"
        "Delayed: a run that took over twice the baseline and a second more, from being asked for to "
        "being seen completed. Recovered: from the heal until the last run in flight during the fault "
        "ended. The timelines (seconds from the fault; each run: asked → seen ended):\n\n"
        f"{timelines}"
    )


def faults_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["faults"])


def _timeline(fault: dict[str, Any]) -> str:
    cells = " ".join(
        f"{r['asked']:+.1f}→{r['ended']:+.1f}" if r["ended"] is not None else f"{r['asked']:+.1f}→(none)"
        for r in fault["runs"]
    )
    return f"- **{fault['fault']}** (held {fault['fault_s']} s): {cells}\n"
