"""The local stack's fork server (fleetctl.forkserver), as real processes: what it imports starts no
thread; a service forked from it gets its own settings, socket, log, name and session, and its end is
reported with its code; a service dies with the supervisor that asked for it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetctl.forkserver import UNKNOWN_CODE, ForkServer

ROOT = Path(__file__).resolve().parents[2]

SLEEPER = """
import json, os, socket, time
from fleet.settings import ServiceSettings

async def main(settings: ServiceSettings) -> None:
    sock = socket.socket(fileno=settings.listen_fd)
    report = {
        "service_id": settings.service_id,
        "port": sock.getsockname()[1],
        "name": open("/proc/self/comm").read().strip(),
        "own_session": os.getsid(0) == os.getpid(),
        "queue": os.environ["SLEEPER_QUEUE"],
    }
    sock.detach()
    if os.environ["SLEEPER_REPORT"]:
        with open(os.environ["SLEEPER_REPORT"], "w") as out:
            out.write(json.dumps(report))
    print("sleeper up", flush=True)
    time.sleep(3600)
"""

MANIFEST = """\
[fleet]
name = "sleepers"

[[specialists]]
id = "sleeper"
entry = "sleeper:main"
skills = ["sleep"]
"""


def _project(tmp_path: Path) -> Path:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "fleet.toml").write_text(MANIFEST)
    return tmp_path / "fleet.toml"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "FLEET_MANIFEST": str(_project(tmp_path)),
        "FLEET_KEY_FILE": str(tmp_path / "sleeper.pem"),
        "FLEET_PUBLIC_URL": "http://127.0.0.1:1",
        "FLEET_SERVICE_ID": "sleeper",
        "SLEEPER_QUEUE": "tier-1",
        "SLEEPER_REPORT": "",
        **extra,
    }


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        status = Path(f"/proc/{pid}/status")
        if status.exists() and "\nState:\tZ" in status.read_text():
            return True  # exited, not yet reaped by its parent
        time.sleep(0.05)
    return False


def _written(path: Path, text: str = "", timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.05)


@dataclass
class Running:
    server: ForkServer
    process: asyncio.subprocess.Process


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fleetctl.forkserver",
        str(theirs.fileno()),
        pass_fds=(theirs.fileno(),),
        cwd=ROOT,
    )
    theirs.close()
    server = ForkServer(ours)
    yield Running(server, process)
    server.close()
    code = await asyncio.wait_for(process.wait(), 60)
    assert code in (0, -signal.SIGKILL)  # it exits once its socket is closed (unless a test killed it)


@pytest.fixture
def fork_server(running: Running) -> ForkServer:
    return running.server


def test_what_the_fork_server_imports_starts_no_thread() -> None:
    """A fork copies one thread and every lock the others held: the imports must start none. A
    dependency that starts a thread at import breaks this (its module goes in NOT_PRELOADED)."""
    probe = textwrap.dedent(
        """
        import os, sys
        from fleetctl.forkserver import preload
        failed = preload()
        print(len(os.listdir("/proc/self/task")), len(sys.modules), failed)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True, timeout=120
    ).stdout.split(maxsplit=2)
    threads, modules, failed = int(out[0]), int(out[1]), out[2].strip()
    assert threads == 1 and failed == "[]", out
    assert modules > 1000  # the SDKs, LangGraph, pydantic, psycopg: what is worth sharing


async def test_a_forked_service_has_its_own_settings_socket_log_name_and_session(
    fork_server: ForkServer, tmp_path: Path
) -> None:
    report = tmp_path / "report.json"
    with socket.create_server(("127.0.0.1", 0)) as listening, (tmp_path / "sleeper.log").open("a") as log:
        forked = await fork_server.fork(
            "sleeper",
            "sleeper",
            _env(tmp_path, SLEEPER_REPORT=str(report)),
            listening.fileno(),
            log.fileno(),
        )
        await asyncio.to_thread(_written, report)
        seen = json.loads(report.read_text())
        assert seen == {
            "service_id": "sleeper",
            "port": listening.getsockname()[1],
            "name": "sleeper",
            "own_session": True,
            "queue": "tier-1",
        }
        assert forked.returncode is None
        forked.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(forked.wait(), 30) == -signal.SIGTERM
        assert forked.returncode == -signal.SIGTERM
        with pytest.raises(ProcessLookupError):
            forked.send_signal(signal.SIGTERM)  # never to a pid that may be someone else's now
    assert "sleeper up" in (tmp_path / "sleeper.log").read_text()


async def test_a_service_that_cannot_start_reports_its_code_and_says_why_in_its_log(
    fork_server: ForkServer, tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening, (tmp_path / "nobody.log").open("a") as log:
        forked = await fork_server.fork("nobody", "nobody", _env(tmp_path), listening.fileno(), log.fileno())
        assert await asyncio.wait_for(forked.wait(), 30) == 2  # fleet serve's usage error
    assert "unknown service 'nobody'" in (tmp_path / "nobody.log").read_text()


async def test_the_fork_server_s_death_takes_no_service_with_it(running: Running, tmp_path: Path) -> None:
    """SIGKILL the fork server (a crash, the OOM killer): the service it forked runs on, and the
    supervisor still sees its end and can stop it (its exit code, which only a parent reads, is not
    known any more)."""
    with socket.create_server(("127.0.0.1", 0)) as listening, (tmp_path / "sleeper.log").open("a") as log:
        forked = await running.server.fork(
            "sleeper", "sleeper", _env(tmp_path), listening.fileno(), log.fileno()
        )
        await asyncio.to_thread(_written, tmp_path / "sleeper.log", "sleeper up")
        running.process.kill()
        assert await running.process.wait() == -signal.SIGKILL
        await asyncio.sleep(1)
        assert not _gone(forked.pid, timeout_s=0) and forked.returncode is None
        forked.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(forked.wait(), 30) == UNKNOWN_CODE
        assert await asyncio.to_thread(_gone, forked.pid)


STAND_IN = """
import asyncio, json, socket, sys, os
from fleetctl.forkserver import UNKNOWN_CODE, ForkServer
from fleetctl.supervisor import _die_with_parent

async def main():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server_process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetctl.forkserver", str(theirs.fileno()),
        pass_fds=(theirs.fileno(),), preexec_fn=_die_with_parent, stdout=asyncio.subprocess.DEVNULL,
    )
    server = ForkServer(ours)
    listening = socket.create_server(("127.0.0.1", 0))
    log = open(sys.argv[1], "a")
    forked = await server.fork("sleeper", "sleeper", json.loads(sys.argv[2]), listening.fileno(), log.fileno())
    print(json.dumps({"fork_server": server_process.pid, "service": forked.pid}), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_forked_service_dies_with_the_supervisor(tmp_path: Path) -> None:
    """SIGKILL the supervisor (here a stand-in that starts the fork server as the supervisor does):
    the fork server dies with it, and the service with the fork server; nothing is left running."""
    env = _env(tmp_path)
    stand_in = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(tmp_path / "sleeper.log"), json.dumps(env)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert stand_in.stdout is not None
        pids = json.loads(stand_in.stdout.readline())
        _written(tmp_path / "sleeper.log", "sleeper up")
        assert not _gone(pids["service"], timeout_s=0)
        stand_in.kill()
        stand_in.wait(timeout=30)
        assert _gone(pids["fork_server"]) and _gone(pids["service"]), pids
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
        stand_in.wait(timeout=30)
        if stand_in.stdout is not None:
            stand_in.stdout.close()
