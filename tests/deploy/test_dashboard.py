"""The Grafana dashboard shipped in deploy/grafana: it is what ``deploy.dashboard`` makes, every metric
it reads is one the fleet exports, and it type-checks against Grafana's own dashboard schema (the
``Dashboard`` type of ``@grafana/schema``, generated from Grafana's CUE schema, with TypeScript's
compiler from the npm registry, installed once); a broken copy does not."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import fleet.telemetry  # noqa: F401  (registers the fleet's metrics)
from deploy import dashboard
from fleetctl.testing.node import installed, tool

SCHEMA = "@grafana/schema@13.2.3"
TYPESCRIPT = "typescript@5.6.3"
TSC_ARGS = [
    "--noEmit",
    "--strict",
    "--moduleResolution",
    "bundler",
    "--module",
    "esnext",
    "--target",
    "es2022",
]


@pytest.fixture(scope="module")
def checker() -> Path:
    """A folder with Grafana's schema and TypeScript's compiler, installed from the npm registry once."""
    return installed("grafana-schema/13.2.3", SCHEMA, TYPESCRIPT, marker=".bin/tsc")


def typecheck(checker: Path, board: object, name: str) -> subprocess.CompletedProcess[str]:
    source = checker / f"{name}.ts"
    source.write_text(
        'import type { Dashboard } from "@grafana/schema";\n\n'
        f"export const dashboard: Dashboard = {json.dumps(board, indent=2)};\n"
    )
    tsc = checker / "node_modules" / ".bin" / "tsc"
    return subprocess.run(
        [tool("node"), str(tsc), *TSC_ARGS, str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=checker,
    )


def test_the_file_is_what_the_module_makes() -> None:
    assert dashboard.PATH.read_text() == dashboard.rendered(), "run: python -m deploy.dashboard"


def test_every_metric_the_dashboard_reads_is_one_the_fleet_exports() -> None:
    exported = {
        sample_name
        for family in REGISTRY.collect()
        for sample_name in (
            family.name,
            f"{family.name}_total",
            f"{family.name}_bucket",
            f"{family.name}_count",
            f"{family.name}_sum",
        )
        if family.name.startswith("fleet_")
    }
    expressions = [t["expr"] for p in dashboard.panels() for t in p["targets"]]
    expressions.append(dashboard.dashboard()["templating"]["list"][1]["query"])
    read = {name for expr in expressions for name in re.findall(r"\bfleet_[a-z_]+\b", expr)}
    assert read and read <= exported, read - exported
    assert {
        "fleet_agent_llm_tokens_total",
        "fleet_agent_llm_cost_usd_total",
        "fleet_agent_loop_stops_total",
    } <= read


def test_the_dashboard_type_checks_against_grafanas_schema_and_a_broken_one_does_not(checker: Path) -> None:
    board = json.loads(dashboard.PATH.read_text())
    checked = typecheck(checker, board, "dashboard")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for name, broken, said in (
        ("wrong-type", {**board, "graphTooltip": "shared"}, "DashboardCursorSync"),
        ("unknown-key", {**board, "panelz": []}, "panelz"),
        (
            "bad-panel",
            {**board, "panels": [{**board["panels"][0], "gridPos": {"h": "8"}}]},
            "not assignable to type 'number'",
        ),
    ):
        refused = typecheck(checker, broken, name)
        assert refused.returncode != 0 and said in refused.stdout, (name, refused.stdout)
