"""``fleet demo`` end to end, as a user runs it: a night of invoice reconciliation for two tenants on a
stack it starts (real processes: NATS, Postgres, the registry, the coordinator and its workers, seven
specialists, five MCP servers). What it did is then checked where it happened: the outbox's
operations, the memory server's entries, and the runs' event logs."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleetctl.layout import StackLayout
from fleetctl.testing.e2e import Stack, clean_env, fleet

pytestmark = pytest.mark.e2e

DEMO_TIMEOUT_S = 300
# Personal data in the night's billing events (fleetctl/demo.py NIGHT), which memory must not keep.
CONTACTS = ("ravi.patel@fabrikam.example", "+44 20 7946 0958", "billing@contoso.example", "415 555 0134")


def _publications(stack: Stack) -> dict[str, list[dict[str, Any]]]:
    """The outbox's publication operations, by tenant (as the superuser: every tenant's)."""
    with psycopg.connect(stack.pg_dsn("fleet_data")) as conn:
        rows = conn.execute(
            "SELECT tenant_id, operation_id, status, approved_by FROM outbox.operations"
            " WHERE kind = 'publication' ORDER BY created_at"
        ).fetchall()
    found: dict[str, list[dict[str, Any]]] = {}
    for tenant, op_id, status, approved_by in rows:
        found.setdefault(tenant, []).append({"op": op_id, "status": status, "approved_by": approved_by})
    return found


def _memories(stack: Stack, tenant: str, query: str) -> list[dict[str, Any]]:
    result = fleet(
        "memory", "search", query, "--data-dir", stack.data_dir, "--tenant", tenant, "--limit", "20", "--json",
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return list(json.loads(result.stdout))


def test_the_demo_reconciles_both_tenants_approves_only_over_the_threshold_and_publishes_once(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "fleet"
    stack = Stack(StackLayout.at(data_dir))
    result = fleet(
        "demo", "--data-dir", str(data_dir), "--auto-approve", "--keep-running", timeout=DEMO_TIMEOUT_S
    )
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        assert "signature verified" in out
        assert "\ndemo: OK\n" in out
        # acme's report is over the threshold (a duplicate payment, an unpaid invoice): approved once;
        # globex's is not, and goes out without asking anyone.
        assert out.count("approved as the operator (--auto-approve)") == 1
        assert "demo: acme   | approved as the operator" in out
        acme, globex = out.split("== acme:")[1].split("== globex:")
        assert "5 invoices reconciled, 2 anomalies" in acme
        assert re.search(r"INV-A-1003 score 10\.0: .*no payment received", acme)
        assert re.search(r"INV-A-1004 score 10\.0: paid 2 times", acme)
        assert "approved by operator" in acme
        assert "3 invoices reconciled, 0 anomalies" in globex
        # globex's publication needed no person: policy approved it on the score the run computed
        # (the outbox takes no caller's word for a score, so it never publishes without a grant).
        assert "approved by policy" in globex.split("demo: ->")[0]
        assert "approved by operator" not in globex.split("demo: ->")[0]

        stack.reload()
        published = _publications(stack)
        assert {t: [p["status"] for p in ps] for t, ps in published.items()} == {
            "acme": ["done"],
            "globex": ["done"],
        }
        assert published["acme"][0]["approved_by"] == "operator"
        assert published["globex"][0]["approved_by"] == "policy"

        # Memory: the findings are kept, their personal data is not; each tenant sees its own.
        kept = _memories(stack, "acme", "invoice anomalies payment")
        texts = " ".join(m["text"] for m in kept)
        assert "INV-A-1003" in texts and "INV-A-1004" in texts
        assert not [c for c in CONTACTS if c in texts], texts
        assert any("EMAIL_ADDRESS" in m.get("redacted", []) for m in kept)
        assert {m["tier"] for m in kept} >= {"episodic", "semantic"}  # consolidated at the run's end
        assert all(m["run_id"] for m in kept)  # provenance: the run that wrote it
        theirs = " ".join(m["text"] for m in _memories(stack, "globex", "invoice anomalies payment"))
        assert "INV-A" not in theirs

        # The answer over A2A comes from acme's memory, as the gate kept it.
        asked = out.split("demo: <- from the researcher")[1]
        assert "INV-A-1003" in asked and not [c for c in CONTACTS if c in asked]

        # The next night on the same stack is a new batch per tenant, published once more.
        again = fleet("demo", "--data-dir", str(data_dir), "--auto-approve", timeout=DEMO_TIMEOUT_S)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "using the stack already running" in again.stdout
        published = _publications(stack)
        assert [len(published[t]) for t in ("acme", "globex")] == [2, 2]
        assert len({p["op"] for p in published["acme"]}) == 2
    finally:
        fleet("down", "--data-dir", str(data_dir), timeout=90)


async def test_without_auto_approve_the_demo_says_how_to_approve_and_resumes_when_someone_does(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "fleet"
    demo = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetctl", "demo", "--data-dir", str(data_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=clean_env(),
    )  # fmt: skip
    assert demo.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(DEMO_TIMEOUT_S):
        while not (asked := re.search(r"fleet approve (\S+) --tenant acme", "".join(seen))):
            line = (await demo.stdout.readline()).decode()
            assert line, "".join(seen)  # the demo ended without asking
            seen.append(line)
        assert "approved as the operator" not in "".join(seen)
        # The run waits holding no process; a person approves from another terminal.
        approved = await asyncio.to_thread(
            fleet, "approve", asked.group(1), "--data-dir", str(data_dir), "--tenant", "acme", "--note", "ok"
        )
        assert approved.returncode == 0, approved.stderr
        rest = (await demo.stdout.read()).decode()
        assert await demo.wait() == 0, "".join(seen) + rest
    assert "== acme: completed" in rest and "== globex: completed" in rest
    assert "approved by operator" in rest
    assert "\ndemo: OK\n" in rest
    status = await asyncio.to_thread(fleet, "status", "--data-dir", str(data_dir), "--json")
    assert status.returncode == 3  # the demo stopped the stack it started
