"""Runs inside the sandbox (standard library only; any CPython >= 3.9): restores the run's workspace
into the size-capped ``/work``, runs the untrusted code in a child under resource limits, collects
its output up to a cap, ends every process left in the sandbox, and hands back the workspace.

Protocol. On stdout first ``READY`` (one byte) once the launcher waits for its job. On stdin the job:
``REQUEST`` (the limits and the lengths of what follows), the code (UTF-8), the workspace tar (may be
empty). On stdout then ``TAKEN`` (one byte) once the launcher has read all of it, ``RESULT``, the error text of the restore (UTF-8), the stdout bytes, the stderr
bytes and the workspace tar, whose lengths ``RESULT`` gives. The host trusts none of it beyond the
run's own workspace and output. A launcher takes exactly one job; it exits quietly if stdin closes
before one came (a sandbox started ahead that was not needed).

The launcher imports only what is cheap at its start (``tarfile`` and ``traceback`` cost more than
the rest of it together): a sandbox started ahead of its job imports them while it waits, one that
got its job at once imports them only if the job needs them.
"""

from __future__ import annotations

import os
import resource
import select
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # ``typing`` imports ``re`` and ``enum``: tens of milliseconds at every start
    from typing import Any, NoReturn

try:  # the C half of ``signal``: the same numbers without importing ``enum`` (milliseconds)
    from _signal import SIGKILL, SIGXCPU  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # not CPython
    from signal import SIGKILL, SIGXCPU

WORK = "/work"
READY = b"R"  # waits for its job
TAKEN = b"T"  # has read its job (a launcher that ended before this ran nothing of it)
# wall_s, cpu_s, memory_bytes, processes, file_bytes, output_bytes, workspace_bytes, code_len, workspace_len
REQUEST = struct.Struct(">d6qQQ")
# exit_code (-1: none), signal (-1: none), reason, stdout_truncated, stderr_truncated, duration_s,
# cpu_s, max_rss_kb, restore_error_len, stdout_len, stderr_len, workspace_len (-1: not returned)
RESULT = struct.Struct(">qqBBBddqqqqq")
REASONS = (None, "timeout", "cpu_limit", "output_limit", "workspace_too_large")
# what ``tarfile`` writes for an empty tree: two zero blocks, padded to a 10240-byte record
EMPTY_TAR = bytes(10240)


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("the host closed the request early")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def restore(data: bytes) -> None:
    if not data:
        return
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive:
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts or not member.name:
                continue
            target = os.path.join(WORK, member.name)
            if member.isdir():
                os.makedirs(target, mode=0o755, exist_ok=True)
            elif member.isfile():
                os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
                source = archive.extractfile(member)
                with open(target, "wb") as fh:
                    fh.write(source.read() if source is not None else b"")
                os.chmod(target, member.mode & 0o755)
                os.utime(target, (member.mtime, member.mtime))
        for member in archive.getmembers():  # directory times last: writing files moved them
            if member.isdir() and not member.name.startswith("/") and ".." not in member.name.split("/"):
                os.utime(os.path.join(WORK, member.name), (member.mtime, member.mtime))


def pack(limit: int) -> bytes | None:
    """The workspace as a tar: regular files and directories, sorted, owner-free (same bytes for the
    same tree). Symlinks, devices and sockets are left out. ``None`` if it grew past ``limit``."""
    if not os.listdir(WORK):
        return EMPTY_TAR
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        for root, dirs, files in os.walk(WORK):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                path = os.path.join(root, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                info = tarfile.TarInfo(os.path.relpath(path, WORK))
                info.mtime, info.mode, info.uid, info.gid = int(st.st_mtime), st.st_mode & 0o755, 0, 0
                if os.path.isdir(path) and not os.path.islink(path):
                    info.type = tarfile.DIRTYPE
                    archive.addfile(info)
                elif os.path.isfile(path) and not os.path.islink(path):
                    info.size = st.st_size
                    try:
                        with open(path, "rb") as fh:
                            archive.addfile(info, fh)
                    except OSError:
                        continue
                if out.tell() > limit:
                    return None
    return out.getvalue()


def child(header: dict[str, Any], code: bytes, out_w: int, err_w: int) -> NoReturn:
    os.setsid()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 65536)
    limits = (
        (resource.RLIMIT_CPU, header["cpu_s"], header["cpu_s"] + 1),
        (resource.RLIMIT_AS, header["memory_bytes"], header["memory_bytes"]),
        (resource.RLIMIT_NPROC, header["processes"], header["processes"]),
        (resource.RLIMIT_FSIZE, header["file_bytes"], header["file_bytes"]),
        (resource.RLIMIT_NOFILE, 256, 256),
        (resource.RLIMIT_CORE, 0, 0),
    )
    status = 1
    try:
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        os.chdir(WORK)
        sys.argv = ["main.py"]
        compiled = compile(code.decode(), "main.py", "exec")
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            exec(compiled, namespace)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # the user's traceback, without this file's frame
            import traceback

            tb = exc.__traceback__
            traceback.print_exception(type(exc), exc, tb.tb_next if tb is not None else None)
            status = 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status & 0xFF)


def kill_group(pid: int) -> None:
    try:  # noqa: SIM105 - contextlib is an import more at every start
        os.killpg(pid, SIGKILL)
    except OSError:
        pass


def wait_for_job() -> tuple[dict[str, Any], bytes, bytes] | None:
    if not select.select([0], [], [], 0)[0]:  # started ahead: the slow imports now, not in the job
        import tarfile  # noqa: F401
        import traceback  # noqa: F401
    os.write(1, READY)
    try:
        fields = REQUEST.unpack(read_exact(0, REQUEST.size))
    except EOFError:
        return None  # not needed after all
    names = ("wall_s", "cpu_s", "memory_bytes", "processes", "file_bytes", "output_bytes", "workspace_bytes")
    header = dict(zip(names, fields[:7], strict=True))
    code = read_exact(0, fields[7])
    workspace = read_exact(0, fields[8])
    os.write(1, TAKEN)
    return header, code, workspace


class _Ran:
    """What came of the child: its wait status and resource use, what it wrote, why it was cut.
    (A plain class: ``dataclasses`` costs milliseconds to import.)"""

    __slots__ = ("reason", "status", "streams", "truncated", "usage")

    def __init__(self, out_r: int, err_r: int) -> None:
        self.status = 0
        self.usage: Any = None
        self.streams = {out_r: bytearray(), err_r: bytearray()}
        self.truncated = {out_r: False, err_r: False}
        self.reason: str | None = None


def main() -> None:
    job = wait_for_job()
    if job is None:
        return
    header, code, workspace_in = job
    restore_error = ""
    try:
        restore(workspace_in)
    except Exception as exc:  # OSError, tarfile.TarError: the run starts without it
        restore_error = f"the workspace could not be restored: {exc}"
    del workspace_in
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(header, code, out_w, err_w)
    os.close(out_w)
    os.close(err_w)
    ran = _supervise(pid, header, started, out_r, err_r)
    try:  # noqa: SIM105
        os.kill(-1, SIGKILL)  # every process left in the sandbox but this one and init
    except OSError:
        pass
    _report(ran, header, time.monotonic() - started, restore_error, out_r, err_r)


def _supervise(pid: int, header: dict[str, Any], started: float, out_r: int, err_r: int) -> _Ran:
    """Collect the child's output (up to the cap) until it ends and its pipes are drained, killing
    its process group at the wall-clock deadline or when it writes past the cap."""
    cap, deadline = header["output_bytes"], started + header["wall_s"]
    ran = _Ran(out_r, err_r)
    status: int | None = None
    poller = select.poll()
    for fd in ran.streams:
        poller.register(fd, select.POLLIN | select.POLLHUP)
    exited = -1  # a pidfd: readable once the child has ended, so no wait is a sleep
    if hasattr(os, "pidfd_open"):
        try:
            exited = os.pidfd_open(pid)
            poller.register(exited, select.POLLIN)
        except OSError:
            exited = -1
    open_fds = set(ran.streams)
    drain_until = 0.0
    while True:
        if status is None:
            done, raw, used = os.wait4(pid, os.WNOHANG)
            if done:
                status, ran.usage = raw, used
                drain_until = time.monotonic() + 0.2  # what the child wrote just before it ended
                if exited >= 0:
                    poller.unregister(exited)
                    os.close(exited)
                    exited = -1
        now = time.monotonic()
        if status is None and now >= deadline:
            ran.reason = ran.reason or "timeout"
            kill_group(pid)
        if status is not None and (not open_fds or now >= drain_until):
            break  # done; a process the child left may hold the pipes open: it is killed after
        if not open_fds and exited < 0:
            time.sleep(0.005)
            continue
        wait_ms = max(1, min(int((deadline - now) * 1000) + 1, 20)) if status is None else 20
        for fd, _ in poller.poll(wait_ms):
            if fd != exited and not _take(fd, ran, cap, pid):
                poller.unregister(fd)
                open_fds.discard(fd)
    ran.status = status
    return ran


def _take(fd: int, ran: _Ran, cap: int, pid: int) -> bool:
    """Read what ``fd`` has, keeping up to ``cap`` bytes of it (past the cap, the child's group is
    killed); False at the end of the pipe."""
    chunk = os.read(fd, 65536)
    if not chunk:
        return False
    room = cap - len(ran.streams[fd])
    ran.streams[fd] += chunk[: max(room, 0)]
    if len(chunk) > room and not ran.truncated[fd]:
        ran.truncated[fd] = True
        ran.reason = ran.reason or "output_limit"
        kill_group(pid)
    return True


def _report(
    ran: _Ran, header: dict[str, Any], elapsed: float, restore_error: str, out_r: int, err_r: int
) -> None:
    """Write the result record, then the error text, both outputs and the workspace, to stdout."""
    status, usage, reason = ran.status, ran.usage, ran.reason
    signaled = os.WIFSIGNALED(status)
    term = os.WTERMSIG(status) if signaled else None
    cpu = (usage.ru_utime + usage.ru_stime) if usage is not None else 0.0
    if reason is None and (term == SIGXCPU or (term == SIGKILL and cpu >= header["cpu_s"] - 0.05)):
        reason = "cpu_limit"
    workspace = pack(header["workspace_bytes"])
    if reason is None and workspace is None:
        reason = "workspace_too_large"
    error = restore_error.encode(errors="replace")
    result = RESULT.pack(
        os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1,
        -1 if term is None else term,
        REASONS.index(reason),
        ran.truncated[out_r],
        ran.truncated[err_r],
        elapsed,
        cpu,
        usage.ru_maxrss if usage is not None else 0,
        len(error),
        len(ran.streams[out_r]),
        len(ran.streams[err_r]),
        -1 if workspace is None else len(workspace),
    )
    out = os.fdopen(1, "wb", closefd=False)
    out.write(result)
    out.write(error)
    out.write(bytes(ran.streams[out_r]))
    out.write(bytes(ran.streams[err_r]))
    out.write(workspace or b"")
    out.flush()


if __name__ == "__main__":
    main()
    os._exit(0)  # all is written: no finalizing of the interpreter (tens of milliseconds)
