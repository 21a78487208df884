"""Untrusted code against the real sandbox (bubblewrap, the launcher, the limits), no mocks.

Each test runs code that tries to get out, use too much, or outlive its call, and checks both what
the code saw and what the host is left with afterwards.
"""

from __future__ import annotations

import asyncio
import io
import os
import socket
import tarfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from mcp_servers.sandbox.runner import Limits, Sandbox, find_bwrap, find_python, prepare_runtime
from mcp_servers.sandbox.server import tar_files

HERE = Path(__file__).resolve()
UID_BASE = 62100  # apart from a running stack's sandbox uids
LIMITS = Limits(
    wall_s=4,
    cpu_s=3,
    memory_bytes=256 * 1024 * 1024,
    processes=16,
    output_bytes=64 * 1024,
    workspace_bytes=4 * 1024 * 1024,
    file_bytes=4 * 1024 * 1024,
)


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = Path("/tmp") / f"fleet-sandbox-test-{os.getpid()}"
    return prepare_runtime(base, find_bwrap(), find_python())


@pytest.fixture
async def sandbox(runtime: tuple[Path, Path]) -> AsyncIterator[Sandbox]:
    bwrap, launcher = runtime
    sandbox = Sandbox(bwrap, launcher, find_python(), uid_base=UID_BASE, slots=2)
    yield sandbox
    await sandbox.close()  # the sandboxes started ahead for the next calls
    assert await no_sandbox_processes(sandbox), "a sandboxed process outlived its call"


async def no_sandbox_processes(sandbox: Sandbox, grace_s: float = 5.0) -> bool:
    """Whether this sandbox's processes (those in its cgroups) are gone, allowing a killed one a
    moment to finish exiting (on a loaded machine the kernel can take that long to tear one down).
    Only its own: other stacks on the host run sandboxes too."""
    deadline = time.monotonic() + grace_s
    while sandbox.processes():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.1)
    return True


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port that the host really listens on."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


async def run(
    sandbox: Sandbox, code: str, workspace: bytes = b"", limits: Limits = LIMITS
) -> dict[str, object]:
    outcome = await sandbox.run(code, workspace, limits)
    return {
        "exit": outcome.exit_code,
        "reason": outcome.reason,
        "out": outcome.stdout.decode(errors="replace"),
        "err": outcome.stderr.decode(errors="replace"),
        "outcome": outcome,
    }


async def test_the_code_runs_as_an_unprivileged_user_in_its_own_workdir(sandbox: Sandbox) -> None:
    result = await run(sandbox, "import os; print(os.getuid(), os.getcwd(), sorted(os.environ))")
    uid, cwd, env = str(result["out"]).split(" ", 2)
    assert int(uid) != 0 and cwd == "/work", result
    assert "FLEET" not in env and "PG" not in env and "KEY" not in env, env


async def test_no_network_reaches_the_host_or_anywhere(sandbox: Sandbox, listener: int) -> None:
    code = f"""
import socket
for target in [("127.0.0.1", {listener}), ("10.0.0.1", 80), ("1.1.1.1", 53)]:
    s = socket.socket(); s.settimeout(1)
    try:
        s.connect(target); print("CONNECTED", target)
    except OSError as exc:
        print("refused", target, type(exc).__name__)
try:
    socket.getaddrinfo("pypi.org", 443); print("RESOLVED")
except OSError:
    print("no dns")
print(sorted(n for _, n in socket.if_nameindex()))
"""
    result = await run(sandbox, code)
    assert result["exit"] == 0, result
    assert "CONNECTED" not in str(result["out"]) and "RESOLVED" not in str(result["out"]), result
    assert "['lo']" in str(result["out"]), result


async def test_host_files_are_not_there(sandbox: Sandbox) -> None:
    code = f"""
import os
for path in ["/etc/passwd", "/etc/shadow", "/root", "/home", {str(HERE)!r}, {str(HERE.parent.parent.parent)!r}, "/var"]:
    print(path, os.path.exists(path))
print(sorted(os.listdir("/")))
print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
"""
    result = await run(sandbox, code)
    out = str(result["out"])
    assert result["exit"] == 0, result
    for line in out.splitlines()[:7]:
        assert line.endswith("False"), out
    pids = [int(p) for p in out.splitlines()[-1].strip("[]").split(", ")]
    assert len(pids) <= 4 and os.getpid() not in pids, out  # its own PIDs: bwrap, launcher, the code


async def test_nothing_outside_the_workdir_can_be_written(sandbox: Sandbox, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    code = f"""
import os
for path in ["/usr/escaped", "/escaped", "/etc/escaped", "/proc/escaped", {str(target)!r}, "/usr/lib/os.py"]:
    try:
        open(path, "w").write("x"); print("WROTE", path)
    except OSError as exc:
        print("refused", path, exc.errno)
os.makedirs("/work/deep/er", exist_ok=True); open("/work/deep/er/ok.txt", "w").write("fine")
"""
    result = await run(sandbox, code)
    assert "WROTE" not in str(result["out"]), result
    assert not target.exists()
    outcome = result["outcome"]
    assert tar_files(outcome.workspace or b"")["deep/er/ok.txt"][0] == 4  # type: ignore[attr-defined]


async def test_a_fork_bomb_is_capped_and_leaves_nothing_behind(sandbox: Sandbox) -> None:
    code = """
import os
children = 0
while True:
    try:
        if os.fork() == 0:
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        children += 1
    except OSError:
        print("capped after", children); break
"""
    result = await run(sandbox, code)
    assert "capped after" in str(result["out"]), result
    assert (await run(sandbox, "print('still fine')"))["out"] == "still fine\n"


async def test_a_memory_bomb_fails_inside_the_sandbox(sandbox: Sandbox) -> None:
    result = await run(sandbox, "blocks = [bytearray(64 * 1024 * 1024) for _ in range(64)]")
    assert result["exit"] == 1 and "MemoryError" in str(result["err"]), result


async def test_an_infinite_loop_is_stopped_by_the_cpu_or_wall_limit(sandbox: Sandbox) -> None:
    result = await run(sandbox, "while True: pass")
    outcome = result["outcome"]
    assert result["reason"] in ("cpu_limit", "timeout"), result
    assert outcome.duration_s < LIMITS.wall_s + 3  # type: ignore[attr-defined]
    sleeper = await run(sandbox, "import time; time.sleep(60)")
    assert sleeper["reason"] == "timeout", sleeper


async def test_gigantic_output_is_cut_at_the_cap_and_the_run_stopped(sandbox: Sandbox) -> None:
    result = await run(
        sandbox, "import sys\nwhile True: sys.stdout.write('x' * 65536); sys.stderr.write('y' * 4096)"
    )
    outcome = result["outcome"]
    assert result["reason"] == "output_limit", result
    assert len(outcome.stdout) <= LIMITS.output_bytes and outcome.stdout_truncated  # type: ignore[attr-defined]


async def test_filling_the_workdir_stops_at_its_size(sandbox: Sandbox) -> None:
    code = """
import os
written = 0
try:
    for n in range(1000):
        with open(f"f{n}", "wb") as fh:
            fh.write(b"x" * 1024 * 1024); written += 1
except OSError as exc:
    print("stopped", exc.errno, written)
"""
    result = await run(sandbox, code)
    assert "stopped" in str(result["out"]), result
    assert int(str(result["out"]).split()[-1]) <= LIMITS.workspace_bytes // (1024 * 1024)


async def test_a_process_left_running_does_not_outlive_the_call(sandbox: Sandbox) -> None:
    code = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print("left one behind")
"""
    result = await run(sandbox, code)
    assert result["out"] == "left one behind\n", result
    await asyncio.sleep(0.2)
    assert sandbox.processes(waiting=False) == []  # the call's cgroup is gone, and all in it


async def test_the_workspace_goes_out_and_comes_back(sandbox: Sandbox) -> None:
    first = await run(sandbox, "open('notes.txt', 'w').write('kept'); import os; os.makedirs('d/e')")
    workspace = first["outcome"].workspace  # type: ignore[attr-defined]
    assert workspace and set(tar_files(workspace)) == {"notes.txt"}
    second = await run(sandbox, "import os; print(open('notes.txt').read(), os.path.isdir('d/e'))", workspace)
    assert second["out"] == "kept True\n", second
    assert second["outcome"].workspace == workspace  # type: ignore[attr-defined]  # same tree, same bytes
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:") as archive:
        info = tarfile.TarInfo("../../etc/escaped")
        info.size = 1
        archive.addfile(info, io.BytesIO(b"x"))
    third = await run(sandbox, "import os; print(os.listdir('.'))", evil.getvalue())
    assert third["out"] == "[]\n", third
