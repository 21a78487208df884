"""The support desk end to end, one command (from this folder): ``python -m support_desk``.

It brings the fleet up (``fleet up --detach``), sends an urgent customer message through the
handle-ticket workflow, answers the person's question the run waits for (as the operator: in real
life someone in the console or ``fleet approve``), prints the answer the customer gets, and brings
the fleet down again (``--keep-running`` leaves it up). Everything goes through the ``fleet`` CLI.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

TENANT = "acme"
MESSAGE = "Checkout is down and I was charged twice, please refund!"


def fleet(*args: str, check: bool = True) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "fleetctl", *args], capture_output=True, text=True, check=False
    )
    if check and done.returncode != 0:
        raise SystemExit(f"fleet {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done.stdout


def run_state(run_id: str) -> dict[str, Any]:
    shown: dict[str, Any] = json.loads(fleet("runs", "show", run_id, "--tenant", TENANT, "--json"))
    return shown


def wait_for(run_id: str, *states: str, timeout_s: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = run_state(run_id)
        if run["state"] in states:
            return run
        time.sleep(0.5)
    raise SystemExit(f"run {run_id} did not reach {', '.join(states)} in {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m support_desk", description=__doc__.splitlines()[0])
    parser.add_argument("--keep-running", action="store_true", help="leave the fleet up afterwards")
    args = parser.parse_args(argv)
    print("desk: bringing the fleet up (fleet up --detach)", flush=True)
    fleet("up", "--detach")
    try:
        request = json.dumps({"message": MESSAGE})
        started = json.loads(
            fleet(
                "runs",
                "start",
                "--workflow",
                "handle-ticket",
                "--input",
                request,
                "--tenant",
                TENANT,
                "--json",
            )
        )
        run_id = started["run_id"]
        print(f"desk: run {run_id} for {MESSAGE!r}", flush=True)
        waiting = wait_for(run_id, "waiting", "completed", "failed")
        if waiting["state"] == "waiting":
            print(f"desk: a person is asked: {waiting['wait']['detail'].get('why', '')}", flush=True)
            fleet(
                "approve",
                run_id,
                "--tenant",
                TENANT,
                "--input",
                json.dumps({"decision": "refund"}),
                "--note",
                "refund it",
            )
            print("desk: answered 'refund' (as the operator)", flush=True)
        ended = wait_for(run_id, "completed", "failed", "rejected", "canceled")
        print(f"desk: run {run_id} {ended['state']}", flush=True)
        print(fleet("runs", "events", run_id, "--tenant", TENANT, check=False), flush=True)
        return 0 if ended["state"] == "completed" else 1
    finally:
        if not args.keep_running:
            fleet("down", check=False)


if __name__ == "__main__":
    raise SystemExit(main())
