"""The local stack's fork server: the platform's code imported once, every service forked from it.

A Python service of the fleet spends most of its memory and most of its start on importing its
code (the A2A and MCP SDKs, LangGraph, pydantic, psycopg, the policy engine: 75 to 170 MB and 1 to
2.5 s of CPU each). Started one interpreter per service, a stack of 17 services imports it 17
times. The fork server imports it once, with the garbage collector off so that the imported
objects stay packed and untouched, and forks each service from that image: the pages of the
imported code are shared by every service until one of them writes to them (copy on write).

Each service is still its own process, with its own identity (key file, enrollment token, tokens),
its own listening socket, log, settings and database role, started by ``fleetctl.serving.serve`` as
``fleet serve <id>`` would be; a service that crashes or is killed takes no other with it. Only the
way it starts differs. Production runs one image per service and starts no fork server.

The protocol, over a ``SOCK_SEQPACKET`` socket pair with the supervisor (one JSON message each):

* the supervisor sends ``{"id", "service", "name", "env"}`` with two descriptors attached: the
  service's listening socket and its log file (its stdout and stderr);
* the fork server answers ``{"id", "pid"}`` with a pidfd of the service attached (opened before the
  service can be reaped, so it can never name another process), or ``{"id", "error"}``;
* and ``{"exited": pid, "code": code}`` when it has reaped a service (a negative code: killed by
  that signal, as ``asyncio.subprocess`` reports it).

The fork server holds no thread, no event loop and no connection when it forks: it only imports.
It exits when the supervisor closes its end (which the supervisor does once it has stopped its
services; any still running get SIGTERM). It is started with ``PR_SET_PDEATHSIG``: when the
supervisor dies, the kernel sends it SIGTERM, and it sends SIGTERM to every service it forked before
it exits, so nothing outlives the supervisor (the dying supervisor's socket may close first: either
way the services end). Its own death (a crash, the OOM killer) takes no
service with it: they keep running, and the supervisor still sees each one's end (through a pidfd)
and can stop it, though not its exit code (:data:`UNKNOWN_CODE`), which only a parent reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any

_PR_SET_NAME = 15
# Looked up once, before any fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl

MAX_MESSAGE = 1 << 20  # a service's environment is a few KB
UNKNOWN_CODE = 255  # a service's exit code once its fork server is gone (asyncio's for an unknown child)
# Modules the services import only once they run: every service would import them after the fork
# otherwise, each its own copy (found with PYTHONPROFILEIMPORTTIME=1, which the services inherit:
# their logs list what each imported after the fork). Uvicorn's, when a server starts; httpx's
# transport (httpcore with HTTP/2, and anyio's sockets) when a client makes its first connection;
# truststore, for a client's TLS context; the Rego engine, when policy first loads; LangGraph's
# tracers, at a worker's first run; _strptime, at the first date parsed; and a codec.
LAZY_MODULES = (
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.loops.asyncio",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.websockets.auto",
    "httpcore",
    "h2.connection",
    "anyio._core._sockets",
    "anyio._core._streams",
    "anyio.streams.tls",
    "anyio.streams.stapled",
    "httpcore2",
    "truststore",
    "regorus",
    "langchain_core.tracers.context",
    "langchain_core.tracers.stdout",
    "langchain_core.tracers.run_collector",
    "_strptime",
    "encodings.utf_16_be",
)
# Entry modules whose imports start threads (onnxruntime, spaCy and the Qdrant client each start one):
# a fork copies no thread but every lock a thread may hold, so they are imported after the fork, by
# their own service. tests/unit/test_forkserver.py checks that the rest start none.
NOT_PRELOADED = frozenset({"mcp_servers.memory.server"})


def preload() -> list[str]:
    """Import the entry module of every service of the platform's roster (a project's own modules
    are imported by its services after the fork). The modules that failed to import, with why:
    their services then import them, and fail, on their own."""
    from deploy.local_stack import stack_services
    from fleetctl import serving  # noqa: F401  (what runs a service)

    failed = []
    entries = {spec.entry.partition(":")[0] for spec in stack_services(1)} - NOT_PRELOADED
    modules = sorted(entries) + list(LAZY_MODULES)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed.append(f"{module}: {exc!r}")
    return failed


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


# ------------------------------------------------------------------------------- the fork server
def main(control_fd: int) -> int:
    """Serve fork requests on ``control_fd`` until the supervisor closes it."""
    gc.disable()  # no collection while importing: the imported objects stay packed, their pages clean
    for failure in preload():
        print(f"forkserver: not preloaded: {failure}", flush=True)
    gc.freeze()  # what was imported is never collected: no collection in a service writes to it
    if _threads() != 1:  # an import started a thread: a fork would copy its locks mid-use
        print(
            f"forkserver: {_threads()} threads after the imports, where a fork is only safe with one;"
            " set FLEET_FORK_SERVER=false to start each service as its own interpreter",
            flush=True,
        )
        return 2
    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake the loop: reaped below
    forked: set[int] = set()

    def end_services() -> None:
        for pid in forked:  # the services die with the supervisor, as its other children do
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def supervisor_gone(signum: int, frame: object) -> None:
        end_services()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, supervisor_gone)
    print(f"forkserver: ready, {len(sys.modules)} modules imported", flush=True)
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                    forked -= _reap(control)
                    continue
                message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 2)
                if not message:
                    # The supervisor is done with us: it stopped its services first, so any still
                    # here outlived it. Its death closes this socket before the kernel sends the
                    # parent-death signal, and whichever comes first, they end with it.
                    end_services()
                    return 0
                request = json.loads(message)
                try:
                    pid = _fork(request, fds, closing=(control.fileno(), wake_r, wake_w, selector))
                except OSError as exc:
                    _send(control, {"id": request["id"], "error": f"fork failed: {exc}"})
                else:
                    forked.add(pid)
                    pidfd = os.pidfd_open(pid)  # not reaped before this: the pid is still the service's
                    _send(control, {"id": request["id"], "pid": pid}, pidfd)
                    os.close(pidfd)
                finally:
                    for fd in fds:
                        os.close(fd)


def _send(control: socket.socket, message: dict[str, Any], fd: int | None = None) -> None:
    with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
        socket.send_fds(control, [json.dumps(message).encode()], [] if fd is None else [fd])


def _reap(control: socket.socket) -> set[int]:
    """Reap every service that has ended, telling the supervisor its code; their pids."""
    reaped: set[int] = set()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.add(pid)
        _send(control, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict[str, Any], fds: list[int], closing: tuple[Any, ...]) -> int:
    if len(fds) != 2:
        raise OSError(f"a fork request carries a listening socket and a log file, not {len(fds)} descriptors")
    pid = os.fork()
    if pid:
        return pid
    # The child: from here on, the service. Nothing returns into the fork server's loop.
    code = 1
    try:
        code = _become(request, listen_fd=fds[0], log_fd=fds[1], closing=closing)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        _exit(code)
    return 0  # not reached


def _exit(code: int) -> None:
    """End a service as an interpreter's normal exit would (atexit handlers, buffers flushed)
    without unwinding into the fork server's code."""
    with contextlib.suppress(BaseException):
        import atexit

        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _become(request: dict[str, Any], *, listen_fd: int, log_fd: int, closing: tuple[Any, ...]) -> int:
    """Turn this fresh child into the service ``request`` names."""
    os.setsid()  # its own session, as the supervisor's children have: a terminal's Ctrl-C is not for it
    _prctl(_PR_SET_NAME, request["name"].encode()[:15])  # what ps and top show
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    control_fd, wake_r, wake_w, selector = closing
    selector.close()
    for fd in (control_fd, wake_r, wake_w):
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    env: dict[str, str] = request["env"]
    env["FLEET_LISTEN_FD"] = str(listen_fd)  # the number it has here
    os.environ.update(env)
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):  # a project's folder
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    sys.argv = ["fleet", "serve", request["service"]]
    gc.enable()
    from fleetctl.serving import serve

    return serve(request["service"])


# ---------------------------------------------------------------------------- the supervisor's side
@dataclass(slots=True)
class Forked:
    """A service forked by the fork server, with what the supervisor uses of an
    ``asyncio.subprocess.Process``: its pid, its exit code once the fork server has reaped it,
    ``wait``, ``send_signal`` and ``kill`` (through a pidfd: a signal never reaches a reused pid)."""

    pid: int
    _exit: asyncio.Future[int]
    _pidfd: int

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    def send_signal(self, signum: int) -> None:
        if self._exit.done():
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._pidfd)


class ForkServer:
    """The supervisor's end of the fork server's socket."""

    def __init__(self, control: socket.socket) -> None:
        control.setblocking(False)
        self._control = control
        self._loop = asyncio.get_running_loop()
        self._next_id = 0
        self._asked: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._services: dict[int, Forked] = {}
        self._gone = False
        self._loop.add_reader(control.fileno(), self._on_message)

    async def fork(self, service: str, name: str, env: dict[str, str], listen_fd: int, log_fd: int) -> Forked:
        """Fork the service ``service`` (its process named ``name``) with ``env`` (the whole
        environment it would be started with), ``listen_fd`` as its listening socket and
        ``log_fd`` as its output."""
        if self._gone:
            raise ConnectionError("the fork server has exited")
        self._next_id += 1
        asked = self._loop.create_future()
        self._asked[self._next_id] = asked
        request = {"id": self._next_id, "service": service, "name": name, "env": env}
        message = json.dumps(request).encode()
        while True:
            try:
                socket.send_fds(self._control, [message], [listen_fd, log_fd])
                break
            except BlockingIOError:  # the fork server is still importing and its queue is full
                await asyncio.sleep(0.05)
        pid, pidfd = await asked
        exit_code = self._exits.setdefault(pid, self._loop.create_future())
        forked = Forked(pid, exit_code, pidfd)
        self._services[pid] = forked
        return forked

    def _on_message(self) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._control, MAX_MESSAGE, 1)
            except BlockingIOError:
                return
            except OSError:
                message, fds = b"", []
            if not message:
                self._lost()
                return
            answer = json.loads(message)
            if "pid" not in answer:
                for fd in fds:
                    os.close(fd)
            if "exited" in answer:
                exit_code = self._exits.setdefault(answer["exited"], self._loop.create_future())
                if not exit_code.done():
                    exit_code.set_result(answer["code"])
                continue
            asked = self._asked.pop(answer["id"])
            if "error" in answer:
                asked.set_exception(OSError(answer["error"]))
            else:
                asked.set_result((answer["pid"], fds[0]))

    def _lost(self) -> None:
        """The fork server exited; its services run on. Each one's end is known by its pidfd from
        now on, its code is not (``UNKNOWN_CODE``)."""
        self._gone = True
        self._loop.remove_reader(self._control.fileno())
        for asked in self._asked.values():
            if not asked.done():
                asked.set_exception(ConnectionError("the fork server exited"))
        for pid, exit_code in self._exits.items():
            if not exit_code.done() and pid in self._services:
                self._watch_unreaped(self._services[pid], exit_code)

    def _watch_unreaped(self, forked: Forked, exit_code: asyncio.Future[int]) -> None:
        def gone() -> None:
            self._loop.remove_reader(forked._pidfd)
            if not exit_code.done():
                exit_code.set_result(UNKNOWN_CODE)

        self._loop.add_reader(forked._pidfd, gone)

    def close(self) -> None:
        """Close the supervisor's end (the fork server then exits) and every pidfd."""
        if not self._gone:
            self._loop.remove_reader(self._control.fileno())
            self._gone = True
        self._control.close()
        for forked in self._services.values():
            forked.close()


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
