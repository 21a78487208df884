"""A steady workload with effects for the fleet across hosts, and a checker that reads what the fleet
recorded afterwards (Jepsen's way: the client's history against the system's own records).

``drive`` runs on the operator's host: it submits runs at a steady rate, each a refund of one cent
amount to its own subject through ``case-desk`` and ``mcp-cases`` (an effect kept in the server's
own table), with an ``Idempotency-Key`` per logical request, sending a request again for as long as
it gets no answer (a partition, a restart); then it waits for every run to end. It writes the
client's history: when each run was asked for, accepted and seen ended, in what state.

``check`` reads the run store (runs, their event logs, the operations ledger) and the tool's records
(``tenant_data.refunds``) and reports, for the workload's tenant:

* **lost**: a request the client had accepted whose run is missing, did not complete, or completed
  without its refund;
* **duplicated**: a subject refunded more than once, a run with more than one refund, a run the
  client never asked for (a submission made twice), an operation that ran its effect twice;
* **gaps**: a run whose event log is not exactly ``1..last_seq``;
* **reordered**: a run whose events' times go back as their sequence numbers go up.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import ssl
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

AMOUNT_CENTS = 100  # under every approval limit of the refund tool (fleet.tools, data.json)
ENDED = ("completed", "failed", "canceled", "rejected")
ASK_TIMEOUT_S = 10.0
RETRY_S = 0.5


@dataclass(slots=True)
class Asked:
    """One logical request of the workload, as the client saw it."""

    n: int
    key: str
    subject: str
    asked_at: float
    accepted_at: float | None = None
    attempts: int = 0
    run_id: str | None = None
    ended_at: float | None = None
    state: str | None = None


def plan(subject: str) -> dict[str, Any]:
    return {
        "steps": [
            {
                "id": "refund",
                "skill": "issue-refund",
                "input": {"subject": subject, "amount_cents": AMOUNT_CENTS},
            }
        ]
    }


async def drive(
    data_dir: Path, tenant: str, runs: int, interval_s: float, deadline_s: float, progress: Path | None = None
) -> list[Asked]:
    """Ask for ``runs`` runs, one each ``interval_s``, then follow each to its end (within
    ``deadline_s`` of the start); each run seen ended adds a line to ``progress``, if given (so that
    whoever makes a fault can wait for the workload to be under way)."""
    from fleetctl.cli_common import operator_token_client
    from fleetctl.layout import StackLayout

    layout = StackLayout.at(data_dir)
    endpoints = json.loads(layout.endpoints_file.read_text())
    context = ssl.create_default_context(cafile=endpoints["tls_ca"])
    started = time.monotonic()
    async with httpx.AsyncClient(verify=context, timeout=ASK_TIMEOUT_S) as http:
        tokens = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
        base = endpoints["coordinator"]

        async def headers() -> dict[str, str]:
            token = await tokens.token("coordinator", tenant, ["agent:invoke", "runs:admin"])
            return {"Authorization": f"Bearer {token}"}

        async def ask(asked: Asked) -> None:
            while time.monotonic() - started < deadline_s:
                asked.attempts += 1
                try:
                    answer = await http.post(
                        f"{base}/v1/runs",
                        json=plan(asked.subject),
                        headers={**await headers(), "Idempotency-Key": asked.key},
                    )
                    if answer.status_code in (200, 202):
                        asked.run_id, asked.accepted_at = answer.json()["run_id"], time.time()
                        return
                except Exception:  # no answer: send it again (the key makes that safe)
                    pass
                await asyncio.sleep(RETRY_S)

        async def follow(asked: Asked) -> None:
            while asked.run_id is not None and time.monotonic() - started < deadline_s:
                try:
                    answer = await http.get(f"{base}/v1/runs/{asked.run_id}", headers=await headers())
                    state = answer.json().get("state") if answer.status_code == 200 else None
                    if state in ENDED:
                        asked.state, asked.ended_at = state, time.time()
                        if progress is not None:
                            with progress.open("a") as out:
                                out.write(f"{asked.n} {state}\n")
                        return
                except Exception:
                    pass
                await asyncio.sleep(RETRY_S)

        async def one(asked: Asked) -> None:
            await ask(asked)
            await follow(asked)

        history = []
        tasks = []
        for n in range(runs):
            asked = Asked(n, f"{tenant}-{n}", f"{tenant}-{n}", time.time())
            history.append(asked)
            tasks.append(asyncio.create_task(one(asked)))
            await asyncio.sleep(interval_s)
        await asyncio.gather(*tasks)
    return history


async def check(dsn: str, tenant: str, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The checker's report (see the module's doc) for ``tenant``, against the client's ``history``."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn + " dbname=fleet") as fleet:
        runs = {
            run_id: (state, last_seq)
            for run_id, state, last_seq in await (
                await fleet.execute(
                    "SELECT run_id, state, last_seq FROM fleet_runs.runs WHERE tenant = %s", (tenant,)
                )
            ).fetchall()
        }
        logs = await (
            await fleet.execute(
                "SELECT e.run_id, array_agg(e.seq ORDER BY e.seq), array_agg(e.ts ORDER BY e.seq)"
                " FROM fleet_runs.events e JOIN fleet_runs.runs r USING (run_id)"
                " WHERE r.tenant = %s GROUP BY e.run_id",
                (tenant,),
            )
        ).fetchall()
        ops = await (
            await fleet.execute(
                "SELECT o.run_id, o.op_id, o.status, o.attempts FROM fleet_runs.operations o"
                " JOIN fleet_runs.runs r USING (run_id) WHERE r.tenant = %s",
                (tenant,),
            )
        ).fetchall()
    async with await psycopg.AsyncConnection.connect(dsn + " dbname=fleet_data") as data:
        refunds = await (
            await data.execute(
                "SELECT subject, run_id, attempts FROM tenant_data.refunds WHERE tenant_id = %s", (tenant,)
            )
        ).fetchall()

    by_subject = Counter(subject for subject, _, _ in refunds)
    by_run = Counter(run_id for _, run_id, _ in refunds)
    asked_runs = {h["run_id"]: h for h in history if h.get("run_id")}
    lost, duplicated, gaps, reordered = [], [], [], []
    for h in history:
        run_id = h.get("run_id")
        if run_id is None:
            continue  # never accepted: the client knows it was not taken
        state = runs.get(run_id, (None, 0))[0]
        if state != "completed":
            lost.append({"n": h["n"], "run_id": run_id, "why": f"run {state or 'missing'}"})
        elif by_subject[h["subject"]] == 0:
            lost.append({"n": h["n"], "run_id": run_id, "why": "completed without its refund"})
    duplicated += [{"subject": s, "refunds": c} for s, c in by_subject.items() if c > 1]
    duplicated += [{"run_id": r, "refunds": c} for r, c in by_run.items() if c > 1]
    duplicated += [
        {"run_id": r, "why": "a run the client never asked for"} for r in runs if r not in asked_runs
    ]
    for run_id, seqs, times in logs:
        last_seq = runs[run_id][1]
        if list(seqs) != list(range(1, last_seq + 1)):
            gaps.append({"run_id": run_id, "seqs": len(seqs), "last_seq": last_seq})
        if any(b < a for a, b in itertools.pairwise(times)):
            reordered.append({"run_id": run_id})
    return {
        "tenant": tenant,
        "asked": len(history),
        "accepted": sum(1 for h in history if h.get("run_id")),
        "completed": sum(1 for s, _ in runs.values() if s == "completed"),
        "refunds": len(refunds),
        "retried_effects": sum(1 for _, _, attempts in refunds if attempts > 1),
        "operations": len(ops),
        "operations_retried": sum(1 for *_, attempts in ops if attempts > 1),
        "lost": lost,
        "duplicated": duplicated,
        "gaps": gaps,
        "reordered": reordered,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetctl.testing.netload")
    commands = parser.add_subparsers(dest="command", required=True)
    driving = commands.add_parser("drive")
    driving.add_argument("--data-dir", type=Path, required=True)
    driving.add_argument("--tenant", required=True)
    driving.add_argument("--runs", type=int, default=20)
    driving.add_argument("--interval", type=float, default=0.5)
    driving.add_argument("--deadline", type=float, default=600.0)
    driving.add_argument("--out", type=Path, required=True)
    driving.add_argument("--progress", type=Path, help="a line here per run seen ended")
    checking = commands.add_parser("check")
    checking.add_argument("--dsn", required=True, help="libpq keywords without dbname")
    checking.add_argument("--tenant", required=True)
    checking.add_argument("--history", type=Path, required=True)
    checking.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "drive":
        history = asyncio.run(
            drive(args.data_dir, args.tenant, args.runs, args.interval, args.deadline, args.progress)
        )
        args.out.write_text(json.dumps([asdict(h) for h in history], indent=1))
        return 0
    report = asyncio.run(check(args.dsn, args.tenant, json.loads(args.history.read_text())))
    args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
