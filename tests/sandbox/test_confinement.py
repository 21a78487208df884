"""Attacks on the layers around the sandbox (the real bubblewrap, seccomp and cgroups, no mocks):
the server's environment, nested user namespaces, a memory bomb across processes, a pid bomb, a CPU
hog, and the start-up check that refuses a sandbox without its layers.

Each test looks at its own sandbox only (its cgroups, its processes), never at every process of the
sandbox uids: other stacks on the machine run sandboxes too.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from fleet.errors import ErrorCode, FleetError
from mcp_servers.sandbox.cgroups import CallCaps
from mcp_servers.sandbox.confinement import ALLOWED_ENV, LAYERS, Confinement
from mcp_servers.sandbox.runner import Limits, Sandbox, find_bwrap, find_python, preflight, prepare_runtime
from mcp_servers.sandbox.server import SandboxSettings

UID_BASE = 62120  # apart from the other sandbox tests' and a running stack's sandbox uids
# RLIMIT_AS and RLIMIT_NPROC far above the cgroup's limits: what stops the attack is the cgroup
LOOSE = Limits(wall_s=8, cpu_s=8, memory_bytes=8 << 30, processes=4096)
CANARY = "FLEET_SANDBOX_TEST_CANARY"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-call cgroups need root on this host")


@pytest.fixture(scope="module")
def runtime() -> tuple[Path, Path]:
    return prepare_runtime(Path("/tmp") / f"fleet-sandbox-test-{os.getpid()}", find_bwrap(), find_python())


@pytest.fixture
async def sandbox(runtime: tuple[Path, Path]) -> AsyncIterator[Sandbox]:
    bwrap, launcher = runtime
    confinement = Confinement.build(bwrap, required=LAYERS)
    sandbox = Sandbox(bwrap, launcher, find_python(), uid_base=UID_BASE, slots=1, confinement=confinement)
    yield sandbox
    await sandbox.close()
    tree = confinement.cgroups
    assert tree is not None
    assert not any(path.exists() for path in tree.dirs.values()), tree.processes()


async def test_the_code_sees_nothing_of_the_servers_environment(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CANARY, "hunter2")  # what the server's environment holds (keys, DSNs)
    code = """
import json, os
seen = {}
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["self"]:
    try:
        seen[pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError as exc:
        seen[pid] = f"unreadable {exc.errno}"
print(json.dumps(seen))
"""
    outcome = await sandbox.run(code, b"", LOOSE)
    seen = json.loads(outcome.stdout)
    assert "1" in seen and "self" in seen, seen
    for pid, environ in seen.items():
        assert "hunter2" not in environ and CANARY not in environ, (pid, environ)
        names = {entry.split("=", 1)[0] for entry in environ.split("\0") if "=" in entry}
        assert names <= ALLOWED_ENV, (pid, names)


UNSHARE = """
import ctypes, errno, json, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
def attempt(call):
    rc = call()
    if rc == 0:
        return "ALLOWED"
    return errno.errorcode.get(ctypes.get_errno(), "?")
result = {
    "unshare_user": attempt(lambda: libc.unshare(0x10000000)),
    "unshare_net_ns": attempt(lambda: libc.unshare(0x40000000 | 0x00020000)),
    "setns": attempt(lambda: libc.setns(os.open("/proc/1/ns/pid", os.O_RDONLY), 0)),
    "keyctl": attempt(lambda: libc.syscall(250, 0, 0, 0, 0, 0)),
    "bpf": attempt(lambda: libc.syscall(321, 0, 0, 0)),
    "clone3": attempt(lambda: libc.syscall(435, 0, 0)),
    "ptrace_traceme": attempt(lambda: libc.ptrace(0, 0, 0, 0)),
    "unshare_tool": subprocess.run(["unshare", "-Ur", "id", "-u"], capture_output=True, text=True).stdout.strip(),
    "subprocess": subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout,
    "seccomp": [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0],
}
pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
if pid == 0:
    os._exit(0)
result["clone_newuser"] = "ALLOWED" if pid > 0 else errno.errorcode.get(ctypes.get_errno(), "?")
print(json.dumps(result))
"""


async def test_the_code_cannot_make_namespaces_or_use_the_kernels_risky_calls(sandbox: Sandbox) -> None:
    outcome = await sandbox.run(UNSHARE, b"", LOOSE)
    result = json.loads(outcome.stdout)
    assert result["seccomp"] == "2", result
    for name in (
        "unshare_user",
        "unshare_net_ns",
        "setns",
        "keyctl",
        "bpf",
        "ptrace_traceme",
        "clone_newuser",
    ):
        assert result[name] in ("EPERM", "ENOSPC"), (name, result)
    assert result["clone3"] == "ENOSYS", result  # its flags cannot be read: glibc falls back to clone
    assert result["unshare_tool"] == "", result  # no "0": no root in a nested namespace
    assert result["subprocess"] == "42\n", result  # fork and exec still work (clone3 -> clone)


BOMB = """
import os
children = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        blocks = [b"\\x01" * (10 * 1024 * 1024) for _ in range(30)]  # 300 MB, every page touched
        os._exit(0)
    children.append(pid)
print([os.waitpid(pid, 0)[1] for pid in children])
"""


async def test_a_memory_bomb_across_processes_is_stopped_by_the_calls_cgroup(sandbox: Sandbox) -> None:
    limits = replace(LOOSE, call=CallCaps(memory_bytes=512 << 20, pids=64))
    with pytest.raises(FleetError) as refused:  # 5 x 300 MB: each process is under its RLIMIT_AS
        await sandbox.run(BOMB, b"", limits)
    assert refused.value.code == ErrorCode.SANDBOX_OOM, refused.value
    assert "the kernel killed" in refused.value.message  # oom_kill of the call's memory cgroup
    after = await sandbox.run("print('still serving')", b"", LOOSE)
    assert after.stdout == b"still serving\n"


PID_BOMB = """
import os, time
forked = 0
try:
    for _ in range(300):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
except OSError as exc:
    print("refused", exc.errno)
print(forked)
"""


async def test_a_pid_bomb_is_stopped_at_the_calls_pids_max(sandbox: Sandbox) -> None:
    limits = replace(LOOSE, call=CallCaps(pids=32))
    outcome = await sandbox.run(PID_BOMB, b"", limits)
    lines = outcome.stdout.decode().split()
    assert lines[:2] == ["refused", "11"], outcome  # EAGAIN from the kernel at pids.max
    assert int(lines[-1]) < 32, outcome  # bubblewrap's processes and the launcher count as well
    assert outcome.reason == "process_limit" and outcome.info["pids_refused"] > 0, outcome
    assert sandbox.confinement.cgroups is not None
    assert sandbox.confinement.cgroups.processes().keys() <= {_waiting_call(sandbox)}  # the forks are gone


def _waiting_call(sandbox: Sandbox) -> str:
    """The call cgroup of the slot's sandbox started ahead (its only live one between calls)."""
    tree = sandbox.confinement.cgroups
    assert tree is not None
    waiting = set(sandbox.waiting_pids())
    names = [name for name, pids in tree.processes().items() if waiting & set(pids)]
    return names[0] if names else ""


SPIN = """
import os, time
def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return time.process_time()
read, write = os.pipe()
if os.fork() == 0:
    os.write(write, str(spin(2.0)).encode()); os._exit(0)
mine = spin(2.0)
os.wait()
print(mine + float(os.read(read, 64)))
"""


async def test_two_spinning_processes_get_no_more_cpu_than_the_calls_quota(sandbox: Sandbox) -> None:
    outcome = await sandbox.run(SPIN, b"", replace(LOOSE, call=CallCaps(cpus=0.1)))
    used = float(outcome.stdout)
    assert 0 < used < 0.1 * 2.0 * 1.6 + 0.1, outcome  # about 0.2 s of CPU in 2 s; unlimited: up to 4 s
    assert outcome.info["cpu_throttled"] > 0, outcome  # the CFS quota held it back


async def test_the_start_up_check_passes_with_every_layer(sandbox: Sandbox) -> None:
    report = await preflight(sandbox, LOOSE, required=LAYERS)
    assert report["seccomp"] == "2" and report["no_new_privs"] == "1" and report["unshare_refused"], report
    assert int(report["cap_eff"], 16) == 0 and report["uid"] != 0, report


async def test_the_start_up_check_refuses_a_sandbox_without_its_layers(runtime: tuple[Path, Path]) -> None:
    bwrap, launcher = runtime
    bare = Sandbox(bwrap, launcher, find_python(), uid_base=UID_BASE, slots=1, confinement=Confinement.none())
    try:
        with pytest.raises(FleetError) as refused:
            await preflight(bare, LOOSE, required=LAYERS)
        assert refused.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE
        assert "unshare(CLONE_NEWUSER) succeeded" in refused.value.message, refused.value
        with pytest.raises(FleetError) as refused:  # only the layers asked for are fatal
            await preflight(bare, LOOSE, required=("seccomp",))
        assert "Seccomp is 0" in refused.value.message and "unshare" not in refused.value.message
        report = await preflight(bare, LOOSE, required=())  # none required: logged, the server starts
        assert report["seccomp"] == "0" and not report["unshare_refused"]
    finally:
        await bare.close()


def test_a_missing_layer_is_fatal_when_required(tmp_path: Path) -> None:
    old = tmp_path / "bwrap"
    old.write_text("#!/bin/sh\necho bubblewrap 0.7.0\n")
    old.chmod(0o755)  # a bubblewrap without --disable-userns
    with pytest.raises(FleetError) as refused:
        Confinement.build(old, required=LAYERS)
    assert refused.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE and "userns" in refused.value.message
    layers = Confinement.build(old, required=())
    try:
        assert set(layers.missing) == {"userns"} and layers.seccomp and layers.cgroups is not None
    finally:
        layers.close()


def test_the_required_layers_setting_knows_its_layers(tmp_path: Path) -> None:
    def settings(**extra: str) -> SandboxSettings:
        base = {
            "service_id": "mcp-sandbox",
            "key_file": tmp_path / "key.pem",
            "public_url": "http://127.0.0.1:1",
        }
        return SandboxSettings.model_validate({**base, **extra})

    assert settings().required_layers() == set(LAYERS)  # all by default
    assert settings(sandbox_required_layers="").required_layers() == set()
    with pytest.raises(ValidationError, match="unknown sandbox layers"):
        settings(sandbox_required_layers="seccomp,apparmor")
