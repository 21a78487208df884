"""The fleet across hosts: the compose deployment run on four network namespaces (three hosts with a
NATS node each, Postgres on one, the services spread over them, and the operator's machine), every
service on its own address and certificate, over TLS, found by its service name; the demo, run by
the ``fleet`` CLI from the operator's host against the deployment, passes; and a steady workload of
refunds, and the demo, keep going through each fault (a worker's host cut off, the NATS leader's
host cut off, 200 ms on the coordinator's link, a Postgres restart) with nothing lost or
duplicated, checked afterwards against the run store and the tool's own records.

Two things only a real network found, each checked here: MCP servers refused every request addressed
to their service name (the MCP SDK's DNS-rebinding check admitted loopback names only), and the CLI
could not reach a deployment at all (it knew only a local stack's data dir)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import netfaults
from fleetctl.testing.netfaults import FAULTS, Shape, clean, run_fault
from fleetctl.testing.netfleet import OPERATOR_HOST, NetFleet

# The suite's short form of the faults benchmark (`python -m bench netfaults` runs it long).
SHORT = Shape(runs=10, interval_s=0.5, lead_s=2.0, hold_s=5.0, deadline_s=300.0)
RESULTS: list[dict[str, Any]] = []  # each fault's, for the benchmark's page (the last test)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetFleet]:
    assert os.geteuid() == 0, "the hosts harness makes network namespaces: it needs root"
    with NetFleet(tmp_path_factory.mktemp("netfleet")) as running:
        yield running


def test_every_service_runs_on_its_own_host_and_address(fleet: NetFleet) -> None:
    hosts = {fleet.host_of(name) for name in fleet.services}
    assert hosts == set(fleet.placement)  # spread over the hosts, none on the operator's machine
    assert fleet.host_of("worker-1") != fleet.host_of("worker-2")
    assert fleet.host_of("postgres") != fleet.host_of("coordinator")
    addresses = {fleet.lab.address(name) for name in fleet.services}
    assert len(addresses) == len(fleet.services)
    # The coordinator's own host sees only its own addresses, not the registry's host's.
    seen = fleet.lab.run(fleet.host_of("coordinator"), ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout
    assert fleet.lab.address("coordinator") in seen and fleet.lab.address("registry") not in seen


def test_the_demo_passes_from_the_operator_s_host(fleet: NetFleet) -> None:
    home = fleet.operator_dir()
    status = fleet.fleet_cli("status", "--data-dir", str(home), "--json", timeout_s=120)
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert report["healthy"] and set(report["services"]) == set(fleet.services)

    demo = fleet.fleet_cli("demo", "--data-dir", str(home), "--auto-approve", "--timeout", "300")
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "demo: OK" in demo.stdout
    assert "report published once by the outbox" in demo.stdout  # the outbox, on another host


def test_a_deployment_is_not_stopped_from_the_cli(fleet: NetFleet) -> None:
    down = fleet.fleet_cli("down", "--data-dir", str(fleet.operator_dir()), "--json")
    assert down.returncode != 0 and "invalid_request" in down.stdout + down.stderr
    assert fleet.lab.run(OPERATOR_HOST, ["true"]).returncode == 0


@pytest.mark.parametrize("fault", FAULTS)
def test_runs_with_effects_survive_the_fault_with_nothing_lost_or_duplicated(
    fleet: NetFleet, fault: str, tmp_path: Path
) -> None:
    result = run_fault(fleet, fault, SHORT, tmp_path)
    RESULTS.append(result)
    check, timeline = result["check"], result["timeline"]
    assert check["asked"] == check["accepted"] == SHORT.runs, check
    assert check["completed"] == check["refunds"] == SHORT.runs, check  # every run ended done, once
    assert clean(result), check  # nothing lost or duplicated, no gap or reordering in any event log
    assert result["demo_passed"], "the demo run during the fault failed (logs/demo-<fault>.log)"
    # The fault was felt: runs waited for the partition or the slow link to end, or Postgres was away.
    if fault == "postgres-restart":
        assert result["made_s"] > 0.1
    else:
        assert timeline["runs_delayed"] >= 1, timeline


def test_the_benchmark_page_reports_each_fault_it_ran() -> None:
    assert [r["fault"] for r in RESULTS] == list(FAULTS)  # the faults above ran, in this process
    summary = netfaults.summarize(RESULTS, SHORT)
    assert summary["all_clean"] and len(summary["faults"]) == len(FAULTS)
    section = netfaults.section(summary)
    for fault in FAULTS:
        assert f"| {fault} |" in section and f"**{fault}**" in section
    assert "0 lost, 0 duplicated" in netfaults.summary_row(summary)
