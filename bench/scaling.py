"""Sustained runs/s for 1, 2, 4 and 8 worker processes, and what the whole stack's CPU costs per run:
where adding workers stops paying on this machine, and why.

Each point is a fresh local stack (``FLEET_WORKERS=N``), so no point inherits another's queue,
pools or caches. A run has two steps: the SQL analyst runs ``SELECT pg_sleep(1.0)`` through the SQL
MCP server (time the run spends waiting outside the worker, as a model call or a slow query does),
then the statistician's ``outliers`` on inline records (a cheap step). ``RUNS`` such runs are sent at
once over A2A; runs/s is their number over the time from the first send to the last completion,
median of ``REPEATS`` batches per point after a warm-up.

Each worker process takes ``CONCURRENCY`` (2) runs at once (``FLEET_CONCURRENCY``; the default is
4), so at most ``2 * N`` runs are in flight and N workers finish at most ``2 * N / one_run_s`` runs
a second. A run costs the whole stack about a quarter of a CPU second, so two cores serve about 8
runs/s however many workers there are. The worker count is the limit while ``2 * N / one_run_s`` is
below that: with the default concurrency of 4, or a wait of 0.2 s, two workers would already reach
it and there would be nothing to scale. With 2 runs per worker and a 1 s wait (short for a model
call), the worker count is the limit up to about 4 workers and the CPU beyond. The SQL server gets
a connection per run in flight (``FLEET_SQL_CONNECTIONS_PER_TENANT``), or its per-tenant pool (4 by
default) would cap the runs in flight at 4.

Per batch, the CPU time of every process of the stack (each service's tree from ``endpoints.json``,
Postgres with its backends, NATS, the supervisor) and of the benchmark's own client, before and after;
per run, that gives the CPU-bound ceiling: 2 cores / CPU seconds per run. ``one_run_s``, one run
alone on the idle stack, gives the in-flight bound: ``2 * N / one_run_s``.

Beside it, 4 workers on a routed 3-node NATS cluster with every stream R3 (``deploy/nats_cluster.py``):
what replication costs.

Run: ``.venv/bin/python -m bench.scaling [RUNS]`` (a small RUNS for a smoke test; each point starts
and stops its own stack).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx

from bench._cpu import cpu_by_tree, machine_busy_s
from bench.throughput import Fleet
from deploy.nats_cluster import NatsCluster
from fleetctl.layout import StackLayout
from fleetctl.testing.stack import running_stack

WORKERS = (1, 2, 4, 8)
BASELINE_WORKERS, TARGET_WORKERS = 2, 4
CLUSTER_WORKERS = 4
CONCURRENCY = 2
SLEEP_S = 1.0
RUNS = 80
REPEATS = 3
ALONE = 5  # runs one at a time, for one run's own duration
CORES = os.cpu_count() or 1
CPU_BOUND_SHARE = 0.8  # a rate this close to the CPU bound is bound by the CPU
PLAN: dict[str, Any] = {
    "steps": [
        {
            "id": "wait",
            "skill": "sql-query",
            "input": {"sql": f"SELECT pg_sleep({SLEEP_S}) IS NULL AS slept"},
        },
        {
            "id": "outliers",
            "skill": "outliers",
            "after": ["wait"],
            "input": {
                "records": [{"name": f"r{i}", "x": v} for i, v in enumerate([1, 2, 1, 2, 40, 1])],
                "field": "x",
                "label": "name",
            },
        },
    ]
}


def _role(process: str) -> str:
    """The group a stack process is reported in."""
    if process.startswith("worker"):
        return "workers"
    if process.startswith("nats"):  # the embedded server, or a cluster's nodes
        return "nats"
    if process in ("coordinator", "postgres"):
        return process
    if process.startswith("mcp-") or process in ("sql-analyst", "stats"):
        return "specialists and MCP servers"
    return "the rest"


def _roots(endpoints: Mapping[str, Any], extra: Mapping[str, int]) -> dict[str, int]:
    return {"supervisor": int(endpoints["supervisor_pid"]), **endpoints["processes"], **extra}


async def _batch(fleet: Fleet, runs: int, roots: Mapping[str, int]) -> dict[str, Any]:
    before, client_before, busy_before = cpu_by_tree(roots), time.process_time(), machine_busy_s()
    started = time.perf_counter()
    await asyncio.gather(*(fleet.run(PLAN) for _ in range(runs)))
    elapsed = time.perf_counter() - started
    after, client = cpu_by_tree(roots), time.process_time() - client_before
    stack = sum(after[name] - before[name] for name in roots)
    return {
        "runs_per_s": runs / elapsed,
        # what the rest of the machine (other people's work) took of the cores meanwhile
        "others_cores": max(0.0, machine_busy_s() - busy_before - stack - client) / elapsed,
        "cpu_s": {name: after[name] - before[name] for name in roots},
        "client_cpu_s": client,
    }


async def _alone(fleet: Fleet) -> float:
    took = []
    for _ in range(ALONE):
        started = time.perf_counter()
        await fleet.run(PLAN)
        took.append(time.perf_counter() - started)
    return statistics.median(took)


async def _measure(fleet: Fleet, workers: int, runs: int, roots: Mapping[str, int]) -> dict[str, Any]:
    await asyncio.gather(*(fleet.run(PLAN) for _ in range(2 * workers * CONCURRENCY)))  # warm every worker
    one_run_s = await _alone(fleet)
    batches = [await _batch(fleet, runs, roots) for _ in range(REPEATS)]
    median = sorted(batches, key=lambda b: float(b["runs_per_s"]))[len(batches) // 2]
    per_process = {name: round(cpu / runs * 1000, 2) for name, cpu in median["cpu_s"].items()}
    by_role: dict[str, float] = {}
    for name, ms in per_process.items():
        by_role[_role(name)] = round(by_role.get(_role(name), 0.0) + ms, 2)
    stack_ms = sum(median["cpu_s"].values()) / runs * 1000
    client_ms = median["client_cpu_s"] / runs * 1000
    return {
        "workers": workers,
        "in_flight_max": workers * CONCURRENCY,
        "runs_per_s": round(float(median["runs_per_s"]), 2),
        "runs_per_s_batches": [round(float(b["runs_per_s"]), 2) for b in batches],
        "one_run_s": round(one_run_s, 3),
        "in_flight_bound_per_s": round(workers * CONCURRENCY / one_run_s, 1),
        "stack_cpu_ms_per_run": round(stack_ms, 1),
        "client_cpu_ms_per_run": round(client_ms, 1),
        "cpu_bound_per_s": round(CORES * 1000 / (stack_ms + client_ms), 1),
        "others_cores": round(float(median["others_cores"]), 2),
        # the bound with the cores other work left to the stack during the batch
        "cpu_bound_left_per_s": round(
            (CORES - float(median["others_cores"])) * 1000 / (stack_ms + client_ms), 1
        ),
        "cpu_ms_per_run_by_role": dict(sorted(by_role.items(), key=lambda kv: -kv[1])),
        "cpu_ms_per_run_by_process": per_process,
    }


@contextmanager
def _stack(
    tmp: Path, workers: int, cluster: bool
) -> Iterator[tuple[StackLayout, dict[str, Any], dict[str, int]]]:
    """A fresh stack with ``workers`` worker processes (on a 3-node R3 NATS cluster if ``cluster``),
    and the process roots whose CPU is counted."""
    settings = {
        "FLEET_WORKERS": str(workers),
        "FLEET_CONCURRENCY": str(CONCURRENCY),
        "FLEET_SQL_CONNECTIONS_PER_TENANT": str(max(WORKERS) * CONCURRENCY),
    }
    extra: dict[str, int] = {}
    with ExitStack() as stack:
        if cluster:
            nats = stack.enter_context(NatsCluster(tmp / "nats", size=3))
            settings |= {"FLEET_NATS_URL": nats.url, "FLEET_NATS_REPLICAS": "3"}
            extra = {f"nats-{node.name}": node.process.pid for node in nats.nodes if node.process}
        layout, endpoints = stack.enter_context(running_stack(tmp / "fleet", **settings))
        yield layout, endpoints, _roots(endpoints, extra)


async def _measure_stack(
    layout: StackLayout, endpoints: dict[str, Any], workers: int, runs: int, roots: Mapping[str, int]
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), limits=limits) as http:
        return await _measure(Fleet(layout, endpoints, http), workers, runs, roots)


def point(workers: int, runs: int, cluster: bool = False) -> dict[str, Any]:
    """One point of the curve, on a stack of its own."""
    with TemporaryDirectory(prefix="fleet-bench-") as tmp, _stack(Path(tmp), workers, cluster) as stack:
        measured = asyncio.run(_measure_stack(stack[0], stack[1], workers, runs, stack[2]))
    print(json.dumps({k: v for k, v in measured.items() if k != "cpu_ms_per_run_by_process"}), flush=True)
    return measured


def _ceiling(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The first point that adds less than a tenth over the one before, and the bound it is nearest."""
    best = max(points, key=lambda p: float(p["runs_per_s"]))
    flat = next(
        (p for prev, p in itertools.pairwise(points) if p["runs_per_s"] < 1.1 * prev["runs_per_s"]),
        None,
    )
    return {
        "stops_rising_at_workers": flat["workers"] if flat else None,
        "best_runs_per_s": best["runs_per_s"],
        "best_workers": best["workers"],
        "cpu_use_at_best": round(float(best["runs_per_s"]) / float(best["cpu_bound_per_s"]), 2),
        "cpu_left_use_at_best": round(float(best["runs_per_s"]) / float(best["cpu_bound_left_per_s"]), 2),
    }


def main(runs: int = RUNS) -> dict[str, Any]:
    load_before = os.getloadavg()
    points = [point(n, runs) for n in WORKERS]
    cluster = point(CLUSTER_WORKERS, runs, cluster=True)
    by_workers = {p["workers"]: p for p in points}
    base, target = by_workers[BASELINE_WORKERS], by_workers[TARGET_WORKERS]
    for p in (*points, cluster):
        p["vs_2_workers"] = round(p["runs_per_s"] / base["runs_per_s"], 2)
    ratio = round(target["runs_per_s"] / base["runs_per_s"], 2)
    result = {
        "benchmark": "scaling",
        "runs_per_batch": runs,
        "repeats": REPEATS,
        "concurrency_per_worker": CONCURRENCY,
        "sleep_s": SLEEP_S,
        "cores": CORES,
        "points": points,
        "cluster_r3": cluster,
        "r3_vs_single_server": round(cluster["runs_per_s"] / target["runs_per_s"], 2),
        "ratio_4_vs_2": ratio,
        "target_met": ratio > 1.0,
        "ceiling": _ceiling(points),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result, indent=2))
    print(f"target: runs/s at 4 workers > at 2 workers: {ratio}x, {'met' if ratio > 1 else 'MISSED'}")
    return result


def _verdict(result: Mapping[str, Any]) -> str:
    return "meets" if result["target_met"] else "MISSES"


def summary_row(result: Mapping[str, Any]) -> str:
    """The target's row in the page's summary table."""
    base, target = (_at(result, n) for n in (BASELINE_WORKERS, TARGET_WORKERS))
    return (
        f"| runs/s, {TARGET_WORKERS} worker processes against {BASELINE_WORKERS} "
        f"| the same runs on {BASELINE_WORKERS} worker processes | {base['runs_per_s']}/s "
        f"| {target['runs_per_s']}/s | **{result['ratio_4_vs_2']}x** | > 1x ({_verdict(result)}) |"
    )


def _at(result: Mapping[str, Any], workers: int) -> dict[str, Any]:
    return next(p for p in result["points"] if p["workers"] == workers)


def _bound(p: Mapping[str, Any]) -> str:
    return "runs in flight" if p["in_flight_bound_per_s"] < p["cpu_bound_left_per_s"] else "CPU"


def _table_row(label: str, p: Mapping[str, Any]) -> str:
    batches = ", ".join(str(b) for b in p["runs_per_s_batches"])
    return (
        f"| {label} | {p['in_flight_max']} | **{p['runs_per_s']}** ({batches}) | {p['vs_2_workers']}x "
        f"| {p['one_run_s']} s | {p['in_flight_bound_per_s']}/s | {p['stack_cpu_ms_per_run']} ms "
        f"| {p['client_cpu_ms_per_run']} ms | {p['cpu_bound_per_s']}/s | {p['others_cores']} "
        f"| {p['cpu_bound_left_per_s']}/s | {_bound(p)} |\n"
    )


def _ceiling_text(result: Mapping[str, Any]) -> str:
    ceiling, best = result["ceiling"], _at(result, result["ceiling"]["best_workers"])
    stops = ceiling["stops_rising_at_workers"]
    busiest, busiest_ms = max(
        ((n, ms) for n, ms in best["cpu_ms_per_run_by_process"].items() if n not in ("postgres", "nats")),
        key=lambda kv: float(kv[1]),
    )
    roles = ", ".join(f"{role} {ms} ms" for role, ms in best["cpu_ms_per_run_by_role"].items())
    cpu_ms = round(float(best["stack_cpu_ms_per_run"]) + float(best["client_cpu_ms_per_run"]), 1)
    return (
        (
            f"Runs/s stops rising at {stops} worker processes (less than a tenth more than the point "
            "before); "
            if stops
            else "Runs/s rose at every point measured; "
        )
        + f"the most was {best['runs_per_s']} runs/s at {best['workers']}. There, the bound by CPU is "
        f"{best['cpu_bound_per_s']} runs/s: {result['cores']} cores / {cpu_ms} ms of CPU per run (the stack's "
        f"{best['stack_cpu_ms_per_run']} ms and the client's {best['client_cpu_ms_per_run']} ms), and the "
        f"runs/s measured are {ceiling['cpu_use_at_best']:.0%} of it; other work took "
        f"{best['others_cores']} cores meanwhile, and of the bound by the CPU it left "
        f"({best['cpu_bound_left_per_s']} runs/s) they are {ceiling['cpu_left_use_at_best']:.0%}. Where a run's CPU goes there (ms per "
        f"run): {roles}. The busiest single process, {busiest} at {busiest_ms} ms per run, could do "
        f"{1000 / float(busiest_ms):.0f} runs/s on a core of its own, and Postgres spends "
        f"{best['cpu_ms_per_run_by_process'].get('postgres', 0)} ms per run (its sleep is a wait, "
        "not CPU). "
        + (
            "So neither one process, nor the specialist, nor Postgres binds first: the two cores that "
            "every process of the stack shares do. "
            if ceiling["cpu_left_use_at_best"] >= CPU_BOUND_SHARE
            else f"The rate measured is below {CPU_BOUND_SHARE:.0%} of the CPU bound: the cores are not "
            "all it takes (see the bound by runs in flight in the table). "
        )
        + "Where the bound by runs in flight is the lower one (the table's last column; each worker "
        f"holds {result['concurrency_per_worker']} runs, each lasting about one run alone), runs/s follows "
        "it: there the worker count is the limit. More cores, or workers on other machines with the rest "
        "of the stack kept off their cores, raise the CPU bound: cores / CPU per run. "
    )


def _confound_text(result: Mapping[str, Any]) -> str:
    """What the other work on the machine did to the ratio, when it bound the baseline point."""
    base, target = _at(result, BASELINE_WORKERS), _at(result, TARGET_WORKERS)
    if _bound(base) != "CPU":
        return ""
    return (
        f"Read the ratio with care: at {BASELINE_WORKERS} workers the CPU that other work left bound the "
        f"rate before the workers did ({base['cpu_bound_left_per_s']}/s against "
        f"{base['in_flight_bound_per_s']}/s by runs in flight), and other work took {base['others_cores']} "
        f"cores there against {target['others_cores']} at {TARGET_WORKERS}: part of the rise is that "
        "share moving.\n\n"
    )


def _idle_text(result: Mapping[str, Any]) -> str:
    """Where the ceiling would be on the same machine with nothing else on it."""
    points = result["points"]
    bound = statistics.median(float(p["cpu_bound_per_s"]) for p in points)
    one_run = statistics.median(float(p["one_run_s"]) for p in points)
    needed = bound * one_run / result["concurrency_per_worker"]
    return (
        f"With the two cores to itself, the stack's ceiling is the bound by CPU, about {bound:.1f} runs/s "
        f"(median over the points); with {result['concurrency_per_worker']} runs per worker and a run "
        f"lasting about {one_run:.2f} s, it takes {needed:.1f} worker processes to reach it, and more "
        "add nothing.\n"
    )


def _cluster_text(result: Mapping[str, Any]) -> str:
    cluster, single = result["cluster_r3"], _at(result, CLUSTER_WORKERS)
    nats_ms = sum(float(ms) for n, ms in cluster["cpu_ms_per_run_by_process"].items() if n.startswith("nats"))
    return (
        f"\nOn the 3-node NATS cluster with every stream R3, {CLUSTER_WORKERS} workers did "
        f"{cluster['runs_per_s']} runs/s against {single['runs_per_s']} on the single server "
        f"({result['r3_vs_single_server']}x); the three NATS processes spent {nats_ms:.1f} ms of CPU per "
        f"run against {single['cpu_ms_per_run_by_process'].get('nats', 0)} ms for the single server. Each "
        "write to a stream is acknowledged once a majority of the three has it; on loopback the time is "
        "small and the cost is the CPU of the replicas, on the same two cores.\n"
    )


def section(result: Mapping[str, Any]) -> str:
    """The page's section on scaling out workers."""
    before, after = (", ".join(str(x) for x in result[k]) for k in ("load_avg_before", "load_avg_after"))
    rows = "".join(_table_row(str(p["workers"]), p) for p in result["points"])
    rows += _table_row(f"{CLUSTER_WORKERS}, NATS cluster (3 nodes, R3)", result["cluster_r3"])
    return (
        "\n## Scaling out workers (`bench/scaling.py`)\n\n"
        f"{result['measured_on']}. Load average (1, 5, 15 min) {before} before, {after} after; the two cores "
        "were shared with other work at times (another engineer's test suite).\n\n"
        f"Each point is a fresh stack with N worker processes, each taking {result['concurrency_per_worker']} "
        f"runs at once (`FLEET_CONCURRENCY={result['concurrency_per_worker']}`). {result['runs_per_batch']} runs "
        "are sent at once over A2A, each a step through the SQL analyst and the SQL MCP server "
        f"(`SELECT pg_sleep({result['sleep_s']})`: time spent waiting outside the worker) and then the "
        f"statistician's `outliers`; runs/s is the median of {result['repeats']} batches after a warm-up. "
        "CPU per run: the user and system time of every process of the stack (each service with its "
        "children, Postgres with its backends, NATS), before and after each batch; the client (the "
        "benchmark's own process) apart. The two bounds: runs in flight (N x "
        f"{result['concurrency_per_worker']} / one run alone on the idle stack) and CPU ({result['cores']} cores "
        "/ the CPU per run of the stack and the client).\n\n"
        "| worker processes | runs in flight at most | runs/s (median; each batch) | vs 2 workers "
        "| one run alone | bound by runs in flight | stack CPU per run | client CPU per run "
        "| bound by CPU | cores other work took | bound by the CPU left | lower bound |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        f"{rows}\n"
        f"Target: runs/s at {TARGET_WORKERS} worker processes above {BASELINE_WORKERS}: "
        f"**{result['ratio_4_vs_2']}x** ({'met' if result['target_met'] else 'missed'}).\n\n"
        + _confound_text(result)
        + _ceiling_text(result)
        + _idle_text(result)
        + _cluster_text(result)
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else RUNS)
