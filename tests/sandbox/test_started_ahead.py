"""Sandboxes started ahead of their job (the real bubblewrap, no mocks): each takes exactly one job,
takes that job's limits, is replaced when it cannot serve, and ends with ``close`` or with the server.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from mcp_servers.sandbox import launcher
from mcp_servers.sandbox.cgroups import trees_of
from mcp_servers.sandbox.runner import Limits, Sandbox, find_bwrap, find_python, prepare_runtime
from mcp_servers.sandbox.server import tar_files

UID_BASE = 62110  # apart from the escape tests' and a running stack's sandbox uids
LIMITS = Limits(wall_s=4, cpu_s=3, memory_bytes=256 * 1024 * 1024, workspace_bytes=4 * 1024 * 1024)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runtime() -> tuple[Path, Path]:
    return prepare_runtime(Path("/tmp") / f"fleet-sandbox-test-{os.getpid()}", find_bwrap(), find_python())


@pytest.fixture
async def sandbox(runtime: tuple[Path, Path]) -> AsyncIterator[Sandbox]:
    bwrap, launcher_path = runtime
    sandbox = Sandbox(bwrap, launcher_path, find_python(), uid_base=UID_BASE, slots=2)
    yield sandbox
    await sandbox.close()
    assert sandbox.waiting_pids() == []
    assert sandbox.processes() == [], "a sandbox outlived its call or close()"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before, or while, its stat was read
        return False


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as fh:
        return dict(line.split(":", 1) for line in fh.read().splitlines())


async def gone(pids: list[int], within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


LOOK = """
import os
print(os.readlink("/proc/self/ns/pid"), os.readlink("/proc/self/ns/mnt"), os.path.exists("/tmp/mark"),
      sorted(os.listdir("/work")))
open("/tmp/mark", "w").write("x"); open("/work/left.txt", "w").write("y")
"""


async def test_a_sandbox_started_ahead_takes_one_job_and_the_next_call_gets_a_new_one(
    sandbox: Sandbox,
) -> None:
    await sandbox.prestart(LIMITS)
    assert len(sandbox.waiting_pids()) == 2
    seen = []
    for _ in range(3):
        ahead = set(sandbox.waiting_pids())
        outcome = await sandbox.run(LOOK, b"", LIMITS)  # each call: an empty workspace (no run)
        assert outcome.exit_code == 0 and outcome.info["warm"] is True, outcome
        pid_ns, mnt_ns, mark, work = outcome.stdout.decode().split(" ", 3)
        assert mark == "False" and work.strip() == "[]", outcome.stdout  # nothing of the call before
        seen.append((pid_ns, mnt_ns))
        used = ahead - set(sandbox.waiting_pids())
        assert len(used) == 1 and await gone(list(used))  # the one that ran has ended, not waiting
        await sandbox.ready()
    assert len(set(seen)) == 3, seen  # new namespaces every call
    assert set(tar_files(outcome.workspace or b"")) == {"left.txt"}


async def test_the_job_brings_its_limits_and_its_clock(sandbox: Sandbox) -> None:
    await sandbox.prestart(LIMITS)
    await asyncio.sleep(1.2)  # waiting is not running: the wall clock starts with the job
    quick = await sandbox.run("import time; time.sleep(0.3); print('done')", b"", replace(LIMITS, wall_s=1))
    assert quick.stdout == b"done\n" and quick.reason is None and quick.info["warm"] is True, quick
    code = (
        "import os, resource; s = os.statvfs('/work')\n"
        "print(s.f_blocks * s.f_frsize, resource.getrlimit(resource.RLIMIT_NPROC)[0])"
    )
    # another /work size than the sandboxes started ahead have: a new sandbox for it
    outcome = await sandbox.run(code, b"", Limits(wall_s=4, workspace_bytes=1024 * 1024, processes=7))
    size, nproc = outcome.stdout.split()
    assert outcome.info["warm"] is False and int(size) == 1024 * 1024 and int(nproc) == 7, outcome
    for _ in range(2):  # each slot started its next one for the size last asked for
        again = await sandbox.run(code, b"", Limits(wall_s=4, workspace_bytes=1024 * 1024, processes=9))
    assert again.info["warm"] is True and again.stdout.split() == [size, b"9"], again


async def test_a_sandbox_started_ahead_holds_the_slot_uid_and_nothing_more(sandbox: Sandbox) -> None:
    await sandbox.prestart(LIMITS)
    uids = set()
    for pid in sandbox.waiting_pids():  # bubblewrap on the host, as the server left it
        status = proc_status(pid)
        ids = {*status["Uid"].split(), *status["Gid"].split()}
        assert len(ids) == 1 and status["Groups"].strip() == "", status
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapAmb"], 16) == 0, (
            status
        )
        uids |= ids
    if os.geteuid() == 0:
        assert uids == {str(UID_BASE), str(UID_BASE + 1)}, uids  # one uid a slot


async def test_a_sandbox_started_ahead_that_died_is_replaced(sandbox: Sandbox) -> None:
    await sandbox.prestart(LIMITS)
    for pid in sandbox.waiting_pids():
        os.kill(pid, signal.SIGKILL)
    assert await gone(sandbox.waiting_pids())
    for _ in range(100):  # and the launchers inside, which end with their PID namespace
        if not sandbox.processes():
            break
        await asyncio.sleep(0.02)
    outcome = await sandbox.run("print('fine')", b"", LIMITS)
    assert outcome.stdout == b"fine\n" and outcome.info["warm"] is False, outcome


async def test_concurrent_calls_each_get_their_own(sandbox: Sandbox) -> None:
    await sandbox.prestart(LIMITS)
    code = "import os, time; time.sleep(0.3); print(os.readlink('/proc/self/ns/pid'), os.getuid())"
    first, second = await asyncio.gather(*(sandbox.run(code, b"", LIMITS) for _ in range(2)))
    assert first.info["warm"] and second.info["warm"]
    assert first.stdout != second.stdout, (first.stdout, second.stdout)  # other namespace, other slot


async def test_close_ends_the_sandboxes_started_ahead(sandbox: Sandbox) -> None:
    await sandbox.prestart(LIMITS)
    pids = sandbox.waiting_pids()
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    await sandbox.close()
    assert sandbox.waiting_pids() == [] and not any(alive(pid) for pid in pids)
    assert sandbox.processes() == []
    outcome = await sandbox.run("print('after close')", b"", LIMITS)  # still runs, starts none ahead
    assert outcome.stdout == b"after close\n" and sandbox.waiting_pids() == []


async def test_a_cold_start_without_sandboxes_started_ahead(runtime: tuple[Path, Path]) -> None:
    bwrap, compiled = runtime
    assert compiled.suffix == ".pyc"  # the launcher as bytecode of the sandbox's interpreter
    for launcher_path in (compiled, compiled.with_suffix(".py")):  # and its source, which works alike
        cold = Sandbox(bwrap, launcher_path, find_python(), uid_base=UID_BASE, slots=1, prestart=False)
        outcome = await cold.run("import sys; print('cold', sys.argv)", b"", LIMITS)
        assert outcome.stdout == b"cold ['main.py']\n" and outcome.info["warm"] is False, outcome
        assert cold.waiting_pids() == []
        await cold.close()


SERVER = """
import asyncio, os, sys, time
from pathlib import Path
from mcp_servers.sandbox.runner import Limits, Sandbox, find_python
async def main():
    sandbox = Sandbox(Path(sys.argv[1]), Path(sys.argv[2]), find_python(), uid_base=int(sys.argv[3]), slots=2)
    await sandbox.prestart(Limits())
    print(*sandbox.waiting_pids(), flush=True)
    await asyncio.sleep(300)
asyncio.run(main())
"""


async def test_the_sandboxes_started_ahead_die_with_the_server(runtime: tuple[Path, Path]) -> None:
    bwrap, launcher_path = runtime
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER,
        str(bwrap),
        str(launcher_path),
        str(UID_BASE),
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert server.stdout is not None
        pids = [int(pid) for pid in (await server.stdout.readline()).split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    finally:
        server.kill()  # no close(): the server is gone at once
        await server.wait()
    assert await gone(pids), "a sandbox started ahead outlived its server"
    trees = trees_of(server.pid)  # the server's cgroups, left as it died: nothing runs in them
    assert trees or os.geteuid() != 0
    for _ in range(100):
        if not any(tree.processes() for tree in trees):
            break
        await asyncio.sleep(0.02)
    assert [tree.processes() for tree in trees if tree.processes()] == []
    for tree in trees:
        tree.remove()


def test_an_empty_workspace_is_packed_without_tarfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "WORK", str(tmp_path))
    made = io.BytesIO()
    with tarfile.open(fileobj=made, mode="w:", format=tarfile.PAX_FORMAT):
        pass
    assert launcher.pack(1 << 20) == launcher.EMPTY_TAR == made.getvalue()
    (tmp_path / "a.txt").write_text("x")
    assert set(tar_files(launcher.pack(1 << 20) or b"")) == {"a.txt"}
