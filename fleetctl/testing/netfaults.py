"""Faults between hosts under a steady workload, each checked afterwards: the one command of the
hosts harness.

``python -m fleetctl.testing.netfaults [--runs N] [--interval S] [--hold S] [--out FILE]`` brings
the fleet up across hosts (:mod:`fleetctl.testing.netfleet`), and for each fault in turn drives a
workload of its own tenant from the operator's host (:mod:`fleetctl.testing.netload`), makes the
fault after ``lead`` seconds once its first runs have ended, holds it ``hold`` seconds, heals it, waits for every run to end and
runs the checker. It writes each fault's timeline and the checker's report, tears everything down
(every namespace it made), and exits 1 if any run was lost or duplicated, any event log has a gap,
or the demo failed.

The faults (``FAULTS``):

* ``worker-partition``: the host of ``worker-1`` (with a NATS node and specialists) cut off;
* ``nats-leader-partition``: the host of the JetStream meta leader, found when the fault starts;
* ``coordinator-latency``: 200 ms more on everything the coordinator's host sends;
* ``postgres-restart``: Postgres shut down (fast: sessions cut) and started again, under load.

Each fault's workload also runs ``fleet demo`` from the operator's host, started with the workload so
that the fault finds its runs under way (the night's two batch runs, the sandbox, the outbox, the
memory gate, an approval); it must pass.

The suite runs it short (``tests/netlab/test_fleet_across_hosts.py``); ``python -m bench netfaults`` runs it
long and publishes the timelines.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetctl.testing.netfleet import OPERATOR_HOST, NetFleet
from fleetctl.testing.netlab import sweep

LATENCY_MS = 200.0
FAULTS = ("worker-partition", "nats-leader-partition", "coordinator-latency", "postgres-restart")


@dataclass(frozen=True, slots=True)
class Shape:
    """How long a fault's workload runs: ``runs`` runs one each ``interval_s``, the fault made
    ``lead_s`` after the first is asked for and once ``warm`` runs have ended (the runs the fault's
    delays are measured against), and held ``hold_s``."""

    runs: int = 40
    interval_s: float = 0.5
    lead_s: float = 4.0
    hold_s: float = 12.0
    deadline_s: float = 600.0
    warm: int = 3
    with_demo: bool = True  # fleet demo from the operator's host, its runs under way at the fault


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault's target host, how to make it and heal it, and whether it is held (a restart is
    over when ``make`` returns)."""

    host: str
    make: Callable[[], None]
    heal: Callable[[], None]
    held: bool = True


def _fault(fleet: NetFleet, name: str) -> Fault:
    """What ``name`` does (see the module's doc)."""
    if name == "worker-partition":
        host = fleet.host_of("worker-1")
        return Fault(host, lambda: fleet.lab.partition(host), fleet.lab.heal)
    if name == "nats-leader-partition":
        host = fleet.host_of(fleet.nats_leader())
        return Fault(host, lambda: fleet.lab.partition(host), fleet.lab.heal)
    if name == "coordinator-latency":
        host = fleet.host_of("coordinator")
        return Fault(host, lambda: fleet.lab.link(host, delay_ms=LATENCY_MS), lambda: fleet.lab.link(host))
    if name == "postgres-restart":

        def restart() -> None:
            fleet.restart_postgres()

        return Fault(fleet.host_of("postgres"), restart, lambda: None, held=False)
    raise ValueError(f"unknown fault {name!r}: one of {', '.join(FAULTS)}")


def _wait_ended(progress: Path, count: int, driver: subprocess.Popen[bytes], until: float) -> None:
    """Until the workload has seen ``count`` runs end (the driver's progress file)."""
    while time.time() < until:
        ended = len(progress.read_text().splitlines()) if progress.exists() else 0
        if ended >= count:
            return
        if driver.poll() is not None:
            raise RuntimeError(f"the workload stopped before {count} runs ended")
        time.sleep(0.1)
    raise RuntimeError(f"the workload did not end {count} runs within its deadline")


def run_fault(fleet: NetFleet, name: str, shape: Shape, work_dir: Path) -> dict[str, Any]:
    """One fault under its workload: its timeline and the checker's report."""
    tenant = f"load-{name}-{uuid.uuid4().hex[:6]}"
    history_file = work_dir / f"{name}.history.json"
    progress_file = work_dir / f"{name}.progress"
    report_file = work_dir / f"{name}.check.json"
    driver = fleet.lab.spawn(
        OPERATOR_HOST,
        [
            sys.executable,
            "-m",
            "fleetctl.testing.netload",
            "drive",
            "--data-dir",
            str(fleet.operator_dir()),
            "--tenant",
            tenant,
            "--runs",
            str(shape.runs),
            "--interval",
            str(shape.interval_s),
            "--deadline",
            str(shape.deadline_s),
            "--out",
            str(history_file),
            "--progress",
            str(progress_file),
        ],
        env=fleet.operator_env(),
        log=fleet.logs / f"load-{name}.log",
    )
    # The demo starts with the workload, so that the fault finds its runs under way.
    demo = (
        fleet.lab.spawn(
            OPERATOR_HOST,
            [str(Path(sys.executable).parent / "fleet"), "demo", "--data-dir", str(fleet.operator_dir()),
             "--auto-approve", "--timeout", str(shape.deadline_s)],
            env=fleet.operator_env(),
            log=fleet.logs / f"demo-{name}.log",
        )
        if shape.with_demo
        else None
    )  # fmt: skip
    started = time.time()
    time.sleep(shape.lead_s)
    # A cold fleet (the first fault's, on a loaded machine) may not have ended a run by then: with
    # none ended before the fault there is nothing to measure its delays against.
    _wait_ended(progress_file, min(shape.warm, shape.runs), driver, started + shape.deadline_s)
    fault = _fault(fleet, name)
    fault_at = time.time()
    fault.make()
    made_s = time.time() - fault_at  # a restart's: how long Postgres did not answer
    if fault.held:
        time.sleep(max(0.0, shape.hold_s - (time.time() - fault_at)))
    fault.heal()
    healed_at = time.time()
    if driver.wait(timeout=shape.deadline_s + 60) != 0:
        raise RuntimeError(f"the workload of {name} failed (logs/load-{name}.log)")
    demo_passed = None
    if demo is not None:
        finished = demo.wait(timeout=shape.deadline_s + 60) == 0
        demo_passed = finished and "demo: OK" in (fleet.logs / f"demo-{name}.log").read_text()
    history = json.loads(history_file.read_text())
    checked = fleet.lab.run(
        OPERATOR_HOST,
        [
            sys.executable,
            "-m",
            "fleetctl.testing.netload",
            "check",
            "--dsn",
            fleet.postgres_dsn(),
            "--tenant",
            tenant,
            "--history",
            str(history_file),
            "--out",
            str(report_file),
        ],
        timeout_s=120,
    )
    if checked.returncode != 0:
        raise RuntimeError(f"the checker failed: {checked.stderr[-2000:]}")
    return {
        "fault": name,
        "target_host": fault.host,
        "tenant": tenant,
        "shape": {
            "runs": shape.runs,
            "interval_s": shape.interval_s,
            "lead_s": shape.lead_s,
            "hold_s": shape.hold_s,
        },
        "made_s": round(made_s, 2),
        "demo_passed": demo_passed,
        "timeline": timeline(history, started, fault_at, healed_at),
        "check": json.loads(report_file.read_text()),
    }


def timeline(
    history: Sequence[dict[str, Any]], started: float, fault_at: float, healed_at: float
) -> dict[str, Any]:
    """What the client saw around the fault: each run's time from being asked for to being seen
    ended; the runs delayed (taking over twice the median of the runs done before the fault, and a
    second more); when the last run in flight during the fault ended, from the heal."""
    runs = [h for h in history if h.get("ended_at") is not None]
    took = {h["n"]: h["ended_at"] - h["asked_at"] for h in runs}
    before = [took[h["n"]] for h in runs if h["ended_at"] < fault_at]
    baseline = statistics.median(before) if before else None
    limit = (2 * baseline + 1.0) if baseline is not None else None
    delayed = sorted(n for n, t in took.items() if limit is not None and t > limit)
    touched = [h for h in runs if h["asked_at"] < healed_at and h["ended_at"] > fault_at]
    last_end = max((h["ended_at"] for h in touched), default=healed_at)
    return {
        "fault_s": round(healed_at - fault_at, 2),
        "baseline_median_s": round(baseline, 3) if baseline is not None else None,
        "runs_ended": len(runs),
        "runs_delayed": len(delayed),
        "slowest_s": round(max(took.values()), 2) if took else None,
        "recovered_s": round(max(0.0, last_end - healed_at), 2),
        "runs": [
            {
                "n": h["n"],
                "asked": round(h["asked_at"] - fault_at, 2),
                "accepted": round(h["accepted_at"] - fault_at, 2) if h.get("accepted_at") else None,
                "ended": round(h["ended_at"] - fault_at, 2) if h.get("ended_at") else None,
                "attempts": h["attempts"],
                "state": h["state"],
            }
            for h in history
        ],
        "started": round(started - fault_at, 2),
    }


def clean(result: dict[str, Any]) -> bool:
    """Whether the checker found nothing lost, duplicated, missing from or out of order in a log,
    and the demo run during the fault (if one was) passed."""
    check = result["check"]
    demo_failed = result.get("demo_passed") is False
    return not (check["lost"] or check["duplicated"] or check["gaps"] or check["reordered"] or demo_failed)


def run_all(work_dir: Path, shape: Shape, faults: Sequence[str] = FAULTS) -> dict[str, Any]:
    """The fleet up across hosts, each fault in turn, the fleet down: every result."""
    results = []
    sweep()  # what an earlier run that was killed left behind
    with NetFleet(work_dir) as fleet:
        up_s = time.time()
        for name in faults:
            results.append(run_fault(fleet, name, shape, work_dir))
        return {"faults": results, "ran_s": round(time.time() - up_s, 1), "logs": str(fleet.logs)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetctl.testing.netfaults", description=__doc__.split("\n")[0]
    )
    defaults = Shape()
    parser.add_argument("--runs", type=int, default=defaults.runs)
    parser.add_argument("--interval", type=float, default=defaults.interval_s)
    parser.add_argument("--lead", type=float, default=defaults.lead_s)
    parser.add_argument("--hold", type=float, default=defaults.hold_s)
    parser.add_argument("--fault", action="append", choices=FAULTS, help="repeat; default: all")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="the results as JSON")
    args = parser.parse_args(argv)
    # Stopped (a CI timeout, ^C): leave through the context managers, which take every host down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="fleet-netfaults-"))
    shape = Shape(args.runs, args.interval, args.lead, args.hold)
    results = run_all(work_dir, shape, args.fault or FAULTS)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    for result in results["faults"]:
        t, c = result["timeline"], result["check"]
        print(
            f"{result['fault']:<24} on {result['target_host']}: {c['completed']}/{c['asked']} completed,"
            f" lost {len(c['lost'])}, duplicated {len(c['duplicated'])}, gaps {len(c['gaps'])},"
            f" delayed {t['runs_delayed']}, recovered {t['recovered_s']} s after the heal"
        )
    return 0 if all(clean(r) for r in results["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
