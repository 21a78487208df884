"""``fleet up`` / ``status`` / ``down``: processes, endpoints, durable state, failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from deploy.infra import as_user, nats_command, prepare_postgres
from deploy.local_stack import SERVICES
from fleet.buskeys import BusKeys, stack_config
from fleetctl.layout import StackLayout
from fleetctl.testing.e2e import (
    Stack,
    clean_env,
    fleet,
    send,
    start_stack,
    stop_stack,
    user_message,
)

pytestmark = pytest.mark.e2e

SPECIALISTS = {s.id for s in SERVICES if s.kind == "specialist"}

ONE_STEP = {"steps": [{"id": "totals", "skill": "invoice-totals"}]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        remaining = [p for p in pids if alive(p)]
        if not remaining:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_up_detach_writes_endpoints_status_reports_and_down_stops_everything(tmp_path: Path) -> None:
    stack = start_stack(tmp_path / "fleet")
    try:
        endpoints = stack.endpoints
        assert endpoints["nats"].startswith("nats://127.0.0.1:")
        assert endpoints["registry"].startswith("http://127.0.0.1:")
        assert endpoints["coordinator"].startswith("http://127.0.0.1:")
        assert set(endpoints["specialists"]) == SPECIALISTS
        assert endpoints["mcp_servers"]["mcp-sql"].endswith("/mcp")
        assert endpoints["mcp_servers"]["mcp-cases"].endswith("/mcp")
        assert set(endpoints["mcp_servers"]) == {
            "mcp-sql",
            "mcp-cases",
            "mcp-sandbox",
            "mcp-outbox",
            "mcp-memory",
        }
        status = fleet("status", "--data-dir", stack.data_dir, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["healthy"] is True
        assert all(check["healthy"] for check in report["services"].values())
        agents = {a["id"] for a in report["registry"]["agents"]}
        assert agents == {"coordinator", *SPECIALISTS}
        assert sorted(m["id"] for m in report["registry"]["mcp_servers"]) == [
            "mcp-cases",
            "mcp-memory",
            "mcp-outbox",
            "mcp-sandbox",
            "mcp-sql",
        ]
        pids = [endpoints["supervisor_pid"], *endpoints["processes"].values()]
        down = fleet("down", "--data-dir", stack.data_dir)
        assert down.returncode == 0, down.stderr
        assert wait_gone(pids) == []
        after = fleet("status", "--data-dir", stack.data_dir, "--json")
        assert after.returncode == 3
        assert json.loads(after.stdout)["running"] is False
    finally:
        fleet("down", "--data-dir", stack.data_dir)  # a failed assertion must not leave it running


def test_second_up_on_a_running_dir_is_refused(own_stack: Stack) -> None:
    again = fleet("up", "--data-dir", own_stack.data_dir, "--detach")
    assert again.returncode == 1
    assert "already running" in again.stderr


def checkpoints_of(stack: Stack, thread_id: str) -> int:
    password = (stack.layout.keys_dir / "postgres-password.secret").read_text().strip()
    port = stack.endpoints["postgres_port"]
    dsn = f"postgresql://postgres:{password}@127.0.0.1:{port}/fleet"
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM fleet_runs.checkpoints WHERE thread_id = %s", (thread_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_second_up_on_the_same_dir_keeps_the_durable_state(tmp_path: Path) -> None:
    stack = start_stack(tmp_path / "fleet")
    try:
        outcome = await send(stack, user_message(data=ONE_STEP), token=stack.token("coordinator"))
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        # A finished run keeps only its latest checkpoint (pruned right after the caller sees the end).
        before = wait_for_value(lambda: checkpoints_of(stack, outcome.task_id), 1)
        assert before == 1
    finally:
        stop_stack(stack)
    restarted = start_stack(tmp_path / "fleet")
    try:
        assert checkpoints_of(restarted, outcome.task_id) == before
        again = await send(restarted, user_message(data=ONE_STEP), token=restarted.token("coordinator"))
        assert again.state_name == "TASK_STATE_COMPLETED", again.final_text
    finally:
        stop_stack(restarted)


def test_ctrl_c_in_the_foreground_stops_the_stack_cleanly(tmp_path: Path) -> None:
    layout = StackLayout.at(tmp_path / "fleet")
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetctl", "up", "--data-dir", str(layout.home)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(),
    )
    assert process.stdout is not None
    output: list[str] = []
    for line in process.stdout:
        output.append(line)
        if "stack is up" in line:
            break
    assert any("stack is up" in line for line in output), "".join(output)
    endpoints = json.loads(layout.endpoints_file.read_text())
    pids = list(endpoints["processes"].values())
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert process.returncode == 0, "".join(output) + rest
    assert "fleet: stopped" in rest
    assert wait_gone(pids) == []


async def test_a_specialist_that_is_down_fails_its_step_with_a_reason(own_stack: Stack) -> None:
    stats_pid = own_stack.endpoints["processes"]["stats"]
    os.kill(stats_pid, signal.SIGKILL)
    assert wait_gone([stats_pid]) == []
    steps = {
        "steps": [
            {"id": "totals", "skill": "invoice-totals"},
            {
                "id": "outliers",
                "skill": "outliers",
                "input": {"records": {"$from": "totals.records"}, "field": "largest"},
            },
        ]
    }
    outcome = await send(own_stack, user_message(data=steps), token=own_stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_FAILED"
    assert outcome.codes[0] == "specialist_unavailable", outcome.final_text
    assert outcome.final_text.startswith("step outliers (outliers) failed")
    assert "cannot reach stats" in outcome.final_text
    # The rest of the fleet carries on, and status names the service that is down.
    alone = await send(own_stack, user_message(data=ONE_STEP), token=own_stack.token("coordinator"))
    assert alone.state_name == "TASK_STATE_COMPLETED", alone.final_text
    status = fleet("status", "--data-dir", own_stack.data_dir, "--json")
    assert status.returncode == 1
    services = json.loads(status.stdout)["services"]
    assert [name for name, check in services.items() if not check["healthy"]] == ["stats"]


@dataclass(frozen=True)
class GivenInfra:
    nats_url: str
    pg_dsn: str
    bus_keys: Path


@pytest.fixture
def given_infra(tmp_path: Path) -> Iterator[GivenInfra]:
    """A NATS and a Postgres that the stack did not start (as in production)."""
    nats_port, monitor_port, pg_port = (free_port() for _ in range(3))
    (tmp_path / "nats").mkdir()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # Configured as production configures it: it trusts the bus's keys (the registry's callout).
    keys = BusKeys.load_or_create(tmp_path / "bus-keys")
    config = tmp_path / "nats" / "auth.conf"
    config.write_text(stack_config(keys))
    nats_server = subprocess.Popen(nats_command(tmp_path / "nats", nats_port, monitor_port, config), **quiet)
    launch = prepare_postgres(tmp_path / "pg", pg_port, "given-password")
    postgres = subprocess.Popen(launch.argv, **as_user(launch.user), **quiet)
    try:
        wait_for_postgres(launch.dsn)
        yield GivenInfra(f"nats://127.0.0.1:{nats_port}", launch.dsn, tmp_path / "bus-keys")
    finally:
        postgres.send_signal(signal.SIGINT)
        nats_server.terminate()
        postgres.wait(timeout=30)
        nats_server.wait(timeout=30)


async def test_stack_uses_the_broker_and_database_it_is_given(
    tmp_path: Path, given_infra: GivenInfra
) -> None:
    """With FLEET_NATS_URL and FLEET_PG_DSN the stack starts neither NATS nor Postgres itself."""
    env = clean_env(
        FLEET_NATS_URL=given_infra.nats_url,
        FLEET_PG_DSN=given_infra.pg_dsn,
        FLEET_NATS_KEYS_DIR=str(given_infra.bus_keys),
    )
    stack = start_stack(tmp_path / "fleet", env=env)
    try:
        assert stack.endpoints["nats"] == given_infra.nats_url
        assert "nats" not in stack.endpoints["processes"]
        assert "postgres" not in stack.endpoints["processes"]
        outcome = await send(stack, user_message(data=ONE_STEP), token=stack.token("coordinator"))
        assert outcome.state_name == "TASK_STATE_COMPLETED", outcome.final_text
        with psycopg.connect(given_infra.pg_dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM fleet_runs.checkpoints WHERE thread_id = %s", (outcome.task_id,)
            )
            assert (row.fetchone() or [0])[0] > 0
    finally:
        stop_stack(stack)


def wait_for_value(read: Callable[[], int], wanted: int, timeout_s: float = 10.0) -> int:
    """Read until the value is ``wanted`` or the time is up; return the last value read."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while value != wanted and time.monotonic() < deadline:
        time.sleep(0.05)
        value = read()
    return value


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_postgres(dsn: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            psycopg.connect(dsn).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
