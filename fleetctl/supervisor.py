"""The local stack supervisor behind ``fleet up``/``fleet down``.

It starts NATS and Postgres (unless the settings point at existing ones), then every service of
:mod:`deploy.local_stack` as its own process on a loopback socket that the supervisor binds and hands
down (so there is no port race), waits until each reports healthy, and writes ``endpoints.json``.
The services are forked from one process that imported the platform's code once
(:mod:`fleetctl.forkserver`; ``FLEET_FORK_SERVER=false`` starts each as its own interpreter).

Children run in their own session (a terminal's Ctrl-C reaches only the supervisor, which stops them in
reverse order) and receive SIGTERM from the kernel if the supervisor itself dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import ssl
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeVar

import httpx
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from deploy.enrollment import enrollment_token
from deploy.infra import as_user, nats_command, prepare_postgres
from deploy.local_stack import (
    DATABASE_CONNECTION_LIMITS,
    DATABASES,
    OPERATOR_ID,
    OWNER_CONNECTION_LIMITS,
    ServiceSpec,
    stack_services,
)
from deploy.manifest import FleetManifest, compose_bundle
from fleet.buscatalog import provision
from fleet.buskeys import BusKeys, ServerTls, stack_config
from fleet.errors import ErrorCode, FleetError
from fleet.issuer_certs import certify_issuer_key
from fleet.keys import SigningKey
from fleet.natsconn import Credentials, connect
from fleet.settings import DEFAULT_ISSUER, FleetSettings
from fleet.tlsca import LocalTls, local_tls
from fleetctl import stacklock
from fleetctl.forkserver import Forked, ForkServer
from fleetctl.layout import StackLayout
from policy import DEFAULT_BUNDLE_DIR

log = logging.getLogger(__name__)

T = TypeVar("T")

START_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 3
STOP_TIMEOUT_S = 10.0
FORK_SERVER = "forkserver"
INFRASTRUCTURE = (FORK_SERVER, "nats", "postgres")  # stopped after the services, in reverse
A2A_KINDS = ("coordinator", "specialist")  # the services that speak A2A (and so serve its gRPC binding too)
_PR_SET_PDEATHSIG = 1
# Looked up once, here: loading a library between fork and exec is not safe.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM us when the supervisor dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _bind_loopback(preferred_port: int | None) -> socket.socket:
    """A listening loopback socket, on the port used last time if it is still free (TCP named as its
    protocol: see fleet.service.listening_socket)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", preferred_port or 0))
    except OSError:
        sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    sock.set_inheritable(True)
    return sock


def _free_port(preferred_port: int | None) -> int:
    with _bind_loopback(preferred_port) as sock:
        port: int = sock.getsockname()[1]
        return port


START_ORDER: tuple[str, ...] = ("registry", "mcp_server", "specialist", "coordinator", "worker", "console")
STOP_TIERS: tuple[frozenset[str], ...] = (
    frozenset({"console", "coordinator", "worker"}),
    frozenset({"specialist"}),
    frozenset({"mcp_server"}),
    frozenset({"registry"}),
)


def start_tiers(services: tuple[ServiceSpec, ...]) -> list[list[ServiceSpec]]:
    """The services in tiers that start one after another, the services of a tier at once: the
    registry first (everything enrolls with it), then the MCP servers, the specialists, the
    coordinator (it creates the run tables), the workers, and the console. A tier starts when every service of
    the one before answers its health check."""
    tiers: list[list[ServiceSpec]] = []
    for kind in START_ORDER:
        tier = [spec for spec in services if spec.kind == kind]
        if tier:
            tiers.append(tier)
    missing = {spec.id for spec in services} - {spec.id for tier in tiers for spec in tier}
    if missing:
        raise ValueError(f"services of no start tier: {sorted(missing)}")
    return tiers


@dataclass(slots=True)
class _Child:
    name: str
    process: asyncio.subprocess.Process | Forked
    log_file: TextIO
    stop_signal: int = signal.SIGTERM


@dataclass(slots=True)
class Supervisor:
    """Owns the processes of one local stack (one data dir)."""

    settings: FleetSettings
    layout: StackLayout
    manifest: FleetManifest | None = None  # a project's services, run beside the platform's core
    progress: Callable[[str], None] = field(default=lambda line: None)  # a line per step of a start
    children: list[_Child] = field(default_factory=list)
    endpoints: dict[str, Any] = field(default_factory=dict)
    _lock_fd: int | None = None
    _tls: LocalTls | None = None
    _forks: ForkServer | None = None

    @property
    def roster(self) -> tuple[ServiceSpec, ...]:
        """The services this stack runs: the platform's, or those of the manifest's fleet."""
        if self.manifest is not None:
            return self.manifest.roster(self.settings.workers)
        return stack_services(self.settings.workers)

    def _kind(self, name: str) -> str | None:
        return next((spec.kind for spec in self.roster if spec.id == name), None)

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> dict[str, Any]:
        """Start everything and return the endpoints; on any failure stop what was started."""
        self._take_lock()
        try:
            return await self._start_all()
        except BaseException:
            await self.stop()
            raise

    async def _start_all(self) -> dict[str, Any]:
        self.layout.prepare()
        previous = self.layout.read_endpoints() or {}
        operator = SigningKey.load_or_create(self.layout.key_file(OPERATOR_ID))
        self.layout.operator_jwk_file.write_text(json.dumps(operator.public_jwk()))
        tls = local_tls(self.layout.tls_dir) if self.settings.tls else None
        keys_dir = self._bus_keys_dir(tls)
        self._certify_registry_key(operator)
        roster = self.roster
        if self.settings.fork_server:  # it imports while NATS and Postgres start
            await self._start_fork_server()
        nats_url = self.settings.nats_url or await self._start_nats(previous)
        self.progress(f"nats ready at {nats_url}")
        replicas = self.settings.nats_replicas if self.settings.nats_url else 1
        await _provision_bus(nats_url, BusKeys.load_or_create(keys_dir), replicas, tls)
        pg_port: int | None = None
        if self.settings.pg_dsn:
            dsns = dict.fromkeys(DATABASES, self.settings.pg_dsn)
        else:
            pg_port, admin_dsn = await self._start_postgres(previous)
            self.progress(f"postgres ready on port {pg_port}")
            dsns = await self._provision_databases(admin_dsn)
        endpoints: dict[str, Any] = {
            "data_dir": str(self.layout.home),
            "nats": nats_url,
            "nats_replicas": replicas,
            "postgres_port": pg_port,
            "specialists": {},
            "mcp_servers": {},
            "workers": {},
            "services": {},
            "supervisor_pid": os.getpid(),
            "stack_id": uuid.uuid4().hex,
            "started_at": time.time(),
        }
        env_common = {
            "FLEET_HOME": str(self.layout.home),
            "FLEET_NATS_URL": nats_url,
            # Streams and buckets get one replica on the embedded server; a cluster's are replicated.
            "FLEET_NATS_REPLICAS": str(replicas),
            "FLEET_OPERATOR_JWK_FILE": str(self.layout.operator_jwk_file),
            "FLEET_ISSUER_CERT_FILE": str(self.layout.issuer_cert_file),
            "FLEET_LOG_LEVEL": self.settings.log_level,
            # Every service is on this machine: fetches of outside URLs may reach loopback.
            "FLEET_LOCAL_STACK": "true",
            # regorus appends a Rust backtrace to every policy error when this is 1: slow and noisy.
            "RUST_BACKTRACE": "0",
        }
        if tls is not None:
            endpoints["tls_ca"] = str(tls.ca_file)
            endpoints["tls_trust"] = str(tls.trust_file)
            env_common |= {
                "FLEET_TLS_CA_FILE": str(tls.ca_file),
                "FLEET_TLS_CERT_FILE": str(tls.cert_file),
                "FLEET_TLS_KEY_FILE": str(tls.key_file),
                "SSL_CERT_FILE": str(tls.trust_file),  # every HTTP client of the services trusts the CA
            }
        self._tls = tls
        env_common |= self._project_env(endpoints)
        started_count = 0
        for tier in start_tiers(roster):
            envs = [
                {
                    **env_common,
                    # a project's service gets the settings its manifest gives it here too (the
                    # platform's own records name those of their deployments only)
                    **(dict(spec.env) if spec.origin else {}),
                    **({"FLEET_PG_DSN": dsns[spec.database]} if spec.database else {}),
                    # Only the registry holds the bus's keys: it decides who connects.
                    **({"FLEET_NATS_KEYS_DIR": str(keys_dir)} if spec.kind == "registry" else {}),
                }
                for spec in tier
            ]
            started = await asyncio.gather(
                *(
                    self._start_service(spec, operator, env, previous)
                    for spec, env in zip(tier, envs, strict=True)
                ),
                return_exceptions=True,
            )
            for outcome in started:  # every start has ended, so stop() finds no process half-spawned
                if isinstance(outcome, BaseException):
                    raise outcome
            for spec, url in zip(tier, started, strict=True):
                assert isinstance(url, str)
                self._record(endpoints, spec, url)
                if spec.kind == "registry":
                    env_common["FLEET_REGISTRY_URL"] = url
            started_count += len(tier)
            names = ", ".join(spec.id for spec in tier)
            self.progress(f"{names} ready ({started_count}/{len(roster)} services)")
        endpoints["processes"] = {c.name: c.process.pid for c in self.children}
        self.endpoints = endpoints
        self.layout.write_endpoints(endpoints)
        return endpoints

    def _project_env(self, endpoints: dict[str, Any]) -> dict[str, str]:
        """What every service of a manifest's fleet is told: where the manifest is (``fleet serve``
        finds the project's services there), the project's folder first on the module path, and
        the policy bundle: the platform's with the project's policy added."""
        if self.manifest is None:
            return {}
        endpoints["manifest"] = str(self.manifest.path)
        path = os.pathsep.join(filter(None, [str(self.manifest.root), os.environ.get("PYTHONPATH", "")]))
        env = {"FLEET_MANIFEST": str(self.manifest.path), "PYTHONPATH": path}
        if self.manifest.workflows:  # the coordinator offers them, the workers run them
            env["FLEET_WORKFLOWS"] = self.manifest.workflows_setting
        if self.manifest.policy_dir is not None:
            base = Path(os.environ.get("FLEET_POLICY_DIR") or DEFAULT_BUNDLE_DIR)
            bundle = compose_bundle(base, self.manifest.policy_dir, self.layout.home / "policy-bundle")
            env["FLEET_POLICY_DIR"] = str(bundle)
            endpoints["policy_dir"] = str(bundle)
        return env

    def _certify_registry_key(self, operator: SigningKey) -> None:
        """The operator's certificate for the registry's signing key (made here if new, or left by
        a rotation), without which no service trusts the tokens it signs."""
        registry = SigningKey.load_or_create(self.layout.key_file("registry"))
        cert = certify_issuer_key(operator, DEFAULT_ISSUER, registry.public_jwk())
        self.layout.issuer_cert_file.write_text(cert)

    @staticmethod
    def _record(endpoints: dict[str, Any], spec: ServiceSpec, url: str) -> None:
        endpoints["services"][spec.id] = url
        if spec.kind in ("registry", "coordinator", "console"):
            endpoints[spec.kind] = url
        elif spec.kind == "specialist":
            endpoints["specialists"][spec.id] = url
        elif spec.kind == "mcp_server":
            endpoints["mcp_servers"][spec.id] = url + spec.mcp_path
        elif spec.kind == "worker":
            endpoints["workers"][spec.id] = url

    async def wait(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set. A service that exits stays down (``fleet status`` shows it)
        and the rest carry on: one crashed agent must not take the fleet down with it."""

        async def watch(child: _Child) -> None:
            code = await child.process.wait()
            log.warning("%s exited with code %s; the rest of the stack keeps running", child.name, code)
            print(f"fleet: {child.name} exited with code {code}", flush=True)

        watchers = [asyncio.create_task(watch(c), name=f"watch-{c.name}") for c in self.children]
        try:
            await stop.wait()
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def stop(self) -> None:
        """Stop the services, callers before the services they call (the coordinator and workers,
        then specialists, then MCP servers, then the registry; each tier at once), then Postgres,
        then NATS. A worker thus never sees its specialist vanish under a step in flight: it stops
        first, and its runs resume on the next start."""
        infrastructure = [c for c in self.children if c.name in INFRASTRUCTURE]
        services = [c for c in self.children if c.name not in INFRASTRUCTURE]
        for tier in STOP_TIERS:
            await asyncio.gather(*(self._stop_child(c) for c in services if self._kind(c.name) in tier))
        await asyncio.gather(*(self._stop_child(c) for c in services if self._kind(c.name) is None))
        if self._forks is not None:
            self._forks.close()  # the fork server exits when its socket closes
            self._forks = None
        for child in reversed(infrastructure):
            await self._stop_child(child)
        self.children.clear()
        self.layout.clear_endpoints()
        self._release_lock()

    async def _stop_child(self, child: _Child) -> None:
        if child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(child.stop_signal)
            try:
                await asyncio.wait_for(child.process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("%s did not stop in %ss; killing it", child.name, STOP_TIMEOUT_S)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
                await child.process.wait()
        child.log_file.close()

    # ----------------------------------------------------------------- the lock
    def _take_lock(self) -> None:
        self.layout.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._lock_fd = stacklock.acquire(self.layout.lock_file)
        except BlockingIOError:
            raise FleetError(
                ErrorCode.CONFLICT, f"a stack is already running on {self.layout.home}"
            ) from None

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            stacklock.release(self._lock_fd)
            self._lock_fd = None

    # ----------------------------------------------------------------- processes
    async def _spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        user: str | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> _Child:
        log_file = self.layout.log_file(name).open("a", buffering=1)
        log_file.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {name}\n")
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **as_user(user),
        )
        child = _Child(name, process, log_file, stop_signal)
        self.children.append(child)
        return child

    async def _start_fork_server(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        theirs.set_inheritable(True)
        try:
            argv = [sys.executable, "-m", "fleetctl.forkserver", str(theirs.fileno())]
            await self._spawn(FORK_SERVER, argv, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._forks = ForkServer(ours)

    async def _fork(self, name: str, env: dict[str, str], sock: socket.socket) -> _Child:
        """Start the service ``name`` forked from the fork server, with the environment ``_spawn``
        would give it."""
        assert self._forks is not None
        log_file = self.layout.log_file(name).open("a", buffering=1)
        log_file.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {name} (forked)\n")
        try:
            forked = await self._forks.fork(
                name, name, {**os.environ, **env}, sock.fileno(), log_file.fileno()
            )
        except ConnectionError:
            log_file.close()
            raise ChildExited(f"the fork server exited:\n{self.layout.log_tail(FORK_SERVER)}") from None
        except BaseException:
            log_file.close()
            raise
        child = _Child(name, forked, log_file)
        self.children.append(child)
        return child

    def _bus_keys_dir(self, tls: LocalTls | None) -> Path:
        """Where the bus's keys are: the data dir's own (made on first use) for the embedded server;
        those the given bus trusts (``FLEET_NATS_KEYS_DIR``) for another."""
        if not self.settings.nats_url:
            keys = BusKeys.load_or_create(self.layout.bus_keys_dir)
            server_tls = ServerTls(tls.cert_file, tls.key_file) if tls is not None else None
            self.layout.nats_config_file.write_text(stack_config(keys, server_tls))
            return self.layout.bus_keys_dir
        if self.settings.nats_keys_dir is None:
            raise FleetError(
                ErrorCode.INVALID_REQUEST,
                "FLEET_NATS_URL needs FLEET_NATS_KEYS_DIR: the keys that bus trusts"
                " (python -m deploy.nats_cluster prints them)",
            )
        return self.settings.nats_keys_dir.resolve()

    async def _start_nats(self, previous: dict[str, Any]) -> str:
        async def attempt(port: int) -> str:
            monitor = _free_port(None)
            command = nats_command(self.layout.nats_dir, port, monitor, self.layout.nats_config_file)
            child = await self._spawn("nats", command)
            health = f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"
            await self._wait_until(child, lambda: _http_ok(health), f"NATS on port {port}")
            return f"nats://127.0.0.1:{port}"

        return await _with_port_retry(attempt, _port_of(previous.get("nats")))

    async def _start_postgres(self, previous: dict[str, Any]) -> tuple[int, str]:
        password = self.layout.secret("postgres-password")

        async def attempt(port: int) -> tuple[int, str]:
            launch = await asyncio.to_thread(prepare_postgres, self.layout.pg_dir, port, password)
            child = await self._spawn("postgres", launch.argv, user=launch.user, stop_signal=signal.SIGINT)
            await self._wait_until(child, lambda: _pg_ready(launch.dsn), f"Postgres on port {port}")
            return port, launch.dsn

        return await _with_port_retry(attempt, previous.get("postgres_port"))

    async def _provision_databases(self, admin_dsn: str) -> dict[str, str]:
        """One database per owning service, each owned by a login role only that service gets."""
        dsns: dict[str, str] = {}
        async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as conn:
            for name, may_create_roles in DATABASES.items():
                password = self.layout.secret(f"postgres-{name}-password")
                await ensure_owner_role(conn, name, password, may_create_roles, OWNER_CONNECTION_LIMITS[name])
                await ensure_database(conn, name, DATABASE_CONNECTION_LIMITS[name])
                dsns[name] = make_conninfo(admin_dsn, user=name, password=password, dbname=name)
        return dsns

    async def _wait_until(self, child: _Child, probe: Callable[[], Awaitable[bool]], what: str) -> None:
        """Poll ``probe`` until it is true; fail fast (with the log's tail) if the child exits."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and child.process.returncode is None:
            if await probe():
                return
            await asyncio.sleep(0.05)
        if child.process.returncode is not None:
            self.children.remove(child)
            child.log_file.close()
            raise ChildExited(
                f"{what} exited with code {child.process.returncode}:\n{self.layout.log_tail(child.name)}"
            )
        raise FleetError(
            ErrorCode.STACK_FAILED,
            f"{what} not healthy after {START_TIMEOUT_S:.0f}s; last log lines:\n"
            f"{self.layout.log_tail(child.name)}",
        )

    async def _start_service(
        self,
        spec: ServiceSpec,
        operator: SigningKey,
        env_common: dict[str, str],
        previous: dict[str, Any],
    ) -> str:
        sock = _bind_loopback(_port_of(previous.get("services", {}).get(spec.id)))
        scheme = "https" if self._tls is not None else "http"
        url = f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"
        env = {
            **env_common,
            "FLEET_SERVICE_ID": spec.id,
            "FLEET_KEY_FILE": str(self.layout.key_file(spec.id)),
            "FLEET_LISTEN_FD": str(sock.fileno()),
            "FLEET_PUBLIC_URL": url,
            "FLEET_ENROLLMENT_TOKEN": enrollment_token(operator, spec),
        }
        if spec.kind in A2A_KINDS:
            env["FLEET_A2A_GRPC_PORT"] = "0"  # A2A's gRPC binding too, on a port of its own choosing
        self.layout.write_service_env(
            spec.id, {k: v for k, v in env.items() if k not in ("FLEET_LISTEN_FD", "FLEET_ENROLLMENT_TOKEN")}
        )
        try:
            if self._forks is not None:
                child = await self._fork(spec.id, env, sock)
            else:
                argv = [sys.executable, "-m", "fleetctl", "serve", spec.id]
                child = await self._spawn(spec.id, argv, env=env, pass_fds=(sock.fileno(),))
        finally:
            sock.close()
        ca = self._tls.ca_file if self._tls is not None else None
        await self._wait_until(child, lambda: _http_ok(url + "/healthz", ca), f"{spec.id} at {url}")
        return url


async def _provision_bus(url: str, keys: BusKeys, replicas: int, tls: LocalTls | None) -> None:
    """Create the bus's streams and buckets as its bootstrap identity (nobody else may)."""
    admin = Credentials("fleet-admin", nkey_seed=keys.admin.seed, tls_ca=tls.ca_file if tls else None)
    client = await connect(url, "fleet-bootstrap", replicas=replicas, credentials=admin)
    try:
        made = await provision(client)
    finally:
        await client.close()
    if made:
        log.info("created on the bus: %s", ", ".join(made))


def _port_of(url: object) -> int | None:
    if not isinstance(url, str) or ":" not in url:
        return None
    tail = url.rsplit(":", 1)[1].split("/", 1)[0]
    return int(tail) if tail.isdigit() else None


async def _pg_ready(dsn: str) -> bool:
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, connect_timeout=2)
    except psycopg.Error:
        return False
    await conn.close()
    return True


async def ensure_owner_role(
    conn: psycopg.AsyncConnection[Any],
    name: str,
    password: str,
    may_create_roles: bool,
    connection_limit: int,
) -> None:
    """Create (or update) the login role ``name``, with at most ``connection_limit`` connections."""
    found = await (await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,))).fetchone()
    verb = "ALTER" if found else "CREATE"
    options = "LOGIN NOSUPERUSER NOBYPASSRLS " + ("CREATEROLE" if may_create_roles else "NOCREATEROLE")
    await conn.execute(
        sql.SQL(verb + " ROLE {} " + options + " CONNECTION LIMIT {} PASSWORD {}").format(
            sql.Identifier(name), sql.Literal(connection_limit), sql.Literal(password)
        )
    )


async def ensure_database(conn: psycopg.AsyncConnection[Any], name: str, connection_limit: int) -> None:
    """Create database ``name`` owned by the role of the same name, if it does not exist; at most
    ``connection_limit`` connections to it, all roles together (superusers excepted)."""
    found = await (await conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))).fetchone()
    if found is None:
        await conn.execute(
            sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(name))
        )
    await conn.execute(
        sql.SQL("ALTER DATABASE {} CONNECTION LIMIT {}").format(
            sql.Identifier(name), sql.Literal(connection_limit)
        )
    )


class ChildExited(FleetError):
    """A child process exited while it was starting (for example: its port was taken)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.STACK_FAILED, message)


async def _with_port_retry(attempt: Callable[[int], Awaitable[T]], preferred: int | None) -> T:
    """Start something on a free port; if it exits at once (the port was taken in the meantime),
    try again on another port."""
    for tries_left in range(PORT_ATTEMPTS - 1, -1, -1):
        try:
            return await attempt(_free_port(preferred))
        except ChildExited:
            if tries_left == 0:
                raise
            preferred = None
    raise AssertionError("unreachable")


async def _http_ok(url: str, ca: Path | None = None) -> bool:
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca is not None else True
    try:
        async with httpx.AsyncClient(timeout=2.0, verify=verify) as http:
            response = await http.get(url)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
