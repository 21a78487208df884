"""The local stack's footprint: memory and start-up with the services forked from one process that
imported the platform's code (:mod:`fleetctl.forkserver`, the default) beside each service started
as its own interpreter (``FLEET_FORK_SERVER=false``, the baseline), in the same run.

For each way, interleaved rounds on a fresh data dir each: the time ``fleet up`` takes until the
stack is up (and the part after Postgres is ready, which is the services' own start), the memory
of the stack (PSS of every process: supervisor, fork server, NATS, Postgres, every service) once
it is up and idle, and again after two-step runs (the demo's invoice totals then outliers) have
run through it, with the stack's CPU per run as a check that a forked service costs no more to
run. PSS counts a page shared by several processes once in all, so it is what the stack takes
from the machine.

``python -m bench footprint`` (or ``python -m bench.footprint`` to print only).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx

from bench._cpu import cpu_by_tree, pss_by_tree
from bench.cost import IN_FLIGHT, _bounded, _Stack
from fleetctl.layout import StackLayout
from fleetctl.testing.e2e import TWO_STEPS, fleet
from fleetctl.testing.stack import capacity_bundle
from policy import DEFAULT_BUNDLE_DIR

ROUNDS = 2
RUNS = 40
TARGET_PSS_MB = 1200
WAYS = {"forked": "true", "own interpreter": "false"}


def _start(data_dir: Path, env: dict[str, str]) -> dict[str, float]:
    """``fleet up --detach``, its progress lines timed as they come: seconds to the stack being up,
    and from Postgres being ready to the stack being up (the services' start)."""
    started = time.perf_counter()
    postgres_ready = None
    lines = []
    with subprocess.Popen(
        [sys.executable, "-m", "fleetctl", "up", "--data-dir", str(data_dir), "--detach"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "postgres ready" in line and postgres_ready is None:
                postgres_ready = time.perf_counter()
        up = time.perf_counter()
        code = process.wait()
    if code != 0 or postgres_ready is None:
        raise RuntimeError("fleet up failed:\n" + "".join(lines))
    return {"up_s": round(up - started, 2), "services_s": round(up - postgres_ready, 2)}


def _roots(endpoints: dict[str, Any]) -> dict[str, int]:
    return {"supervisor": int(endpoints["supervisor_pid"]), **endpoints["processes"]}


def _mb(pss: dict[str, int]) -> float:
    return round(sum(pss.values()) / 2**20, 1)


async def _load(layout: StackLayout, endpoints: dict[str, Any], runs: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), limits=limits) as http:
        stack = _Stack(layout, endpoints, http)
        await _bounded(IN_FLIGHT, lambda _: stack.send(TWO_STEPS))  # warm every path
        roots = _roots(endpoints)
        before = cpu_by_tree(roots)
        run_ids = await _bounded(runs, lambda _: stack.send(TWO_STEPS))
        after = cpu_by_tree(roots)
        failed = await stack.failed(run_ids)
    return {
        "cpu_ms_per_run": round(sum(after[n] - before[n] for n in roots) * 1000 / runs, 1),
        "failed": failed,
    }


def _round(way: str, runs: int, root: Path) -> dict[str, Any]:
    data_dir = root / "fleet"
    policy = capacity_bundle(root / "policy", DEFAULT_BUNDLE_DIR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")} | {
        "FLEET_FORK_SERVER": WAYS[way],
        "FLEET_POLICY_DIR": str(policy),
        "FLEET_SQL_CONNECTIONS_PER_TENANT": str(IN_FLIGHT),
    }
    timing = _start(data_dir, env)
    try:
        layout = StackLayout.at(data_dir)
        endpoints = json.loads(layout.endpoints_file.read_text())
        time.sleep(2)  # the services' start-up work settles (enrollment, first policy load)
        idle = pss_by_tree(_roots(endpoints))
        load = asyncio.run(_load(layout, endpoints, runs))
        loaded = pss_by_tree(_roots(endpoints))
    finally:
        fleet("down", "--data-dir", str(data_dir), env=env, timeout=300)
    return {
        **timing,
        "pss_idle_mb": _mb(idle),
        "pss_loaded_mb": _mb(loaded),
        "pss_loaded_mb_by_process": {
            name: round(b / 2**20, 1) for name, b in sorted(loaded.items(), key=lambda kv: -kv[1])
        },
        **load,
    }


def run(rounds: int = ROUNDS, runs: int = RUNS) -> dict[str, Any]:
    measured: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for i in range(rounds):
        for way in WAYS if i % 2 == 0 else reversed(WAYS):
            with TemporaryDirectory(prefix="fleet-bench-") as tmp:
                measured[way].append(_round(way, runs, Path(tmp)))
                print(
                    json.dumps({way: {k: v for k, v in measured[way][-1].items() if "by_process" not in k}})
                )

    def median(way: str, key: str) -> float:
        return round(float(statistics.median(r[key] for r in measured[way])), 2)

    keys = ("up_s", "services_s", "pss_idle_mb", "pss_loaded_mb", "cpu_ms_per_run")
    by_way = {way: {key: median(way, key) for key in keys} for way in WAYS}
    fork, own = by_way["forked"], by_way["own interpreter"]
    last_forked = measured["forked"][-1]["pss_loaded_mb_by_process"]
    return {
        "benchmark": "footprint",
        "rounds": rounds,
        "runs_per_round": runs,
        "by_way": by_way,
        "memory_ratio": round(fork["pss_loaded_mb"] / own["pss_loaded_mb"], 2),
        "start_ratio": round(fork["up_s"] / own["up_s"], 2),
        "services_start_ratio": round(fork["services_s"] / own["services_s"], 2),
        "failed": sum(r["failed"] for way in WAYS for r in measured[way]),
        "target_pss_mb": TARGET_PSS_MB,
        "forked_pss_loaded_mb_by_process": last_forked,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> dict[str, Any]:
    result = run()
    print(json.dumps(result, indent=2))
    return result


def summary_row(result: dict[str, Any]) -> str:
    fork, own = result["by_way"]["forked"], result["by_way"]["own interpreter"]
    target, faster = result["target_pss_mb"], result["start_ratio"] <= 1
    at_rest, loaded = fork["pss_idle_mb"] <= target, fork["pss_loaded_mb"] <= target
    verdict = (
        "meets"
        if at_rest and loaded and faster
        else f"{'meets' if at_rest and faster else 'MISSES'} at rest, {'meets' if loaded else 'MISSES'} after runs"
    )
    return (
        f"| local stack's memory (PSS) at rest / after {result['runs_per_round']} runs, and its start "
        f"| each service its own interpreter | {own['pss_idle_mb']:,} / {own['pss_loaded_mb']:,} MB, up in "
        f"{own['up_s']} s | {fork['pss_idle_mb']:,} / {fork['pss_loaded_mb']:,} MB, up in {fork['up_s']} s "
        f"| **{result['memory_ratio']}x**, start {result['start_ratio']}x "
        f"| <= {target:,} MB, start no slower ({verdict}) |"
    )


def section(result: dict[str, Any]) -> str:
    rows = "".join(
        f"| {way} | {m['up_s']} s | {m['services_s']} s | {m['pss_idle_mb']:,} MB | {m['pss_loaded_mb']:,} MB "
        f"| {m['cpu_ms_per_run']} ms |\n"
        for way, m in result["by_way"].items()
    )
    processes = "".join(
        f"| {name} | {mb} |\n" for name, mb in result["forked_pss_loaded_mb_by_process"].items()
    )
    return (
        "## The local stack's footprint (`bench/footprint.py`)\n\n"
        "The services forked from one process that imported the platform's code once (the fork server, "
        "the default of `fleet up`) beside each service started as its own interpreter "
        f"(`FLEET_FORK_SERVER=false`), {result['rounds']} interleaved rounds each on a fresh data dir, "
        "medians. Start: `fleet up` until the stack is up, and from Postgres ready to the stack up (the "
        "services' own start, one tier after another). Memory: PSS of every process of the stack (a page "
        "shared by several counts once in all), idle once up, and after "
        f"{result['runs_per_round']} two-step runs ({IN_FLIGHT} in flight), with the stack's CPU per run "
        "during them.\n\n"
        "| services | up | services' start | PSS idle | PSS after the runs | CPU per run |\n"
        "|---|---|---|---|---|---|\n"
        f"{rows}\n"
        f"Memory {result['memory_ratio']}x, start {result['start_ratio']}x (the services' part "
        f"{result['services_start_ratio']}x); {result['failed']} runs failed. Each service is still its "
        "own process with its own key, token, socket, log and database role; what it shares with the "
        "others is the pages of the imported code until it writes to them (copy on write), which is "
        "why a service's PSS grows with its work.\n\n"
        "PSS by process after the runs, forked:\n\n"
        "| process | PSS MB |\n|---|---|\n"
        f"{processes}\n"
    )


if __name__ == "__main__":
    main()
