"""Hosts on one machine, joined by a switch that can be made to fail: for tests of the fleet across
real network boundaries (addresses, routes, TCP timeouts), not one loopback interface.

Each host is a Linux network namespace (``ip netns``) with its own address on one subnet. Their links
meet in a switch: a process of its own (``python -m fleetctl.testing.netlab switch``) that holds one
TAP device per host, the host's ``eth0``, and forwards Ethernet frames between them, learning which
address is behind which port as a hardware switch does. Every frame between hosts passes through it,
so it is also where the faults are made:

* **partition**: frames between a host and others are dropped, silently, as a cut cable or a
  firewall's DROP would: connections stall until their own timeouts, nothing is refused;
* **latency and loss** on a host's link: each frame the host sends waits ``delay_ms`` (in order)
  and is lost with probability ``loss``, as ``tc netem`` on its interface would do (a round trip
  through the host takes ``delay_ms`` longer);
* **a host's processes killed at once** (:meth:`NetLab.kill_host`: SIGKILL to every process in its
  namespace, as a power cut would).

It needs neither a kernel queueing discipline (``netem`` is not built into every kernel; it is not
on the machines this project is built on) nor a firewall tool: only ``ip`` (iproute2) and
``/dev/net/tun``, and root.

Names are hosts' names in ``/etc/netns/<namespace>/hosts`` (which ``ip netns exec`` mounts over
``/etc/hosts``): a process finds another host, or a service given an address of its own on a host
(:meth:`NetLab.alias`), by name, as in the compose file. :meth:`NetLab.down` removes every namespace
and hosts file it made and stops the switch; :func:`sweep` removes what a lab whose owner was
killed left (the switch's pid file names the owner).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import pwd
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

PREFIX = "fl"  # every namespace this module makes starts with it (and sweep() removes only those)
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/run/netns")  # ip netns add bind-mounts each namespace here
ENTER_WAIT_S = 5.0


def _wait_entered(process: subprocess.Popen[bytes], namespace: str) -> None:
    """Return once ``process`` is in ``namespace`` (``ip netns exec`` moves it there just after it
    starts), so that what comes next (killing the host's processes, say) finds it there; a process
    that ends first is left to its caller."""
    try:
        wanted = (NETNS_RUN / namespace).stat().st_ino
    except OSError:
        return
    deadline = time.monotonic() + ENTER_WAIT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if Path(f"/proc/{process.pid}/ns/net").stat().st_ino == wanted:
                return
        except OSError:
            return
        time.sleep(0.005)


TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65_536
SWITCH_START_S = 10.0
MAX_DELAY_MS = 10_000.0


IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True)


def namespaces() -> list[str]:
    """The network namespaces of the machine."""
    listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace ``name``."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_namespace(name: str) -> None:
    _kill_namespace(name)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def sweep(prefix: str = PREFIX) -> list[str]:
    """Remove what labs whose owner is gone left behind (e.g. a test process killed mid-run): their
    switch, and the namespaces named ``<prefix><lab>-<host>`` with their processes and hosts files."""
    left = []
    for name in namespaces():
        if not name.startswith(prefix) or "-" not in name:
            continue
        lab = name.split("-", 1)[0]
        if _owner_alive(lab):
            continue
        _remove_namespace(name)
        left.append(name)
    for pid_file in Path("/run").glob(f"{prefix}*-switch.pid"):
        lab = pid_file.name.removesuffix("-switch.pid")
        if not _owner_alive(lab):
            switch, _ = _pids(pid_file)
            if switch is not None:
                with contextlib.suppress(OSError):
                    os.kill(switch, signal.SIGKILL)
            pid_file.unlink(missing_ok=True)
    return left


def _pids(pid_file: Path) -> tuple[int | None, int | None]:
    """The switch's pid and its owner's, as the switch wrote them."""
    try:
        switch, owner = (int(word) for word in pid_file.read_text().split())
    except (OSError, ValueError):
        return None, None
    return switch, owner


def _owner_alive(lab: str) -> bool:
    """Whether the process that made lab ``lab`` still runs (if it does not, nothing will clean up)."""
    _, owner = _pids(Path("/run") / f"{lab}-switch.pid")
    if owner is None:
        return False
    try:
        os.kill(owner, 0)
    except OSError:
        return False
    return True


@dataclass(slots=True)
class Host:
    name: str
    namespace: str
    address: str
    aliases: dict[str, str] = field(default_factory=dict)  # a service's name -> its own address here


class NetLab:
    """Hosts (namespaces) on the subnet ``10.<a>.<b>.0/24`` joined by a switch that can fail.

    ``with NetLab(["h1", "h2", "h3"]) as lab:`` makes them; ``lab.spawn("h1", argv)`` starts a
    process on a host; ``lab.partition("h1")`` / ``lab.heal()``, ``lab.link("h2", delay_ms=200)``,
    ``lab.kill_host("h3")`` make the faults."""

    def __init__(
        self, hosts: Sequence[str], *, subnet: str | None = None, work_dir: Path | None = None
    ) -> None:
        if len(set(hosts)) != len(hosts) or not hosts or len(hosts) > 200:
            raise ValueError("hosts: 1 to 200 distinct names")
        self.lab = f"{PREFIX}{uuid.uuid4().hex[:6]}"
        octets = subnet or f"10.{random.randint(64, 127)}.{random.randint(0, 255)}"
        self.hosts = {
            name: Host(name, f"{self.lab}-{name}", f"{octets}.{i + 1}") for i, name in enumerate(hosts)
        }
        self._next_address = len(hosts) + 1
        self._octets = octets
        self.work_dir = work_dir or Path("/tmp") / self.lab
        self._switch: subprocess.Popen[str] | None = None
        self._switch_log: IO[str] | None = None
        self._spawned: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> NetLab:
        """Make the namespaces, start the switch with a port in each, address them."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            for host in self.hosts.values():
                _ip("netns", "add", host.namespace)
                _ip("-n", host.namespace, "link", "set", "lo", "up")
            self._switch_log = (self.work_dir / "switch.log").open("a")
            self._switch = subprocess.Popen(
                [sys.executable, "-m", "fleetctl.testing.netlab", "switch", self.lab, *self._ports()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._switch_log,
                text=True,
                start_new_session=True,
            )
            self._answer("ready", timeout_s=SWITCH_START_S)
            for host in self.hosts.values():
                _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            self._write_hosts_files()
        except BaseException:
            self.down()
            raise
        return self

    def _ports(self) -> list[str]:
        return [f"{h.name}={h.namespace}" for h in self.hosts.values()]

    def down(self) -> None:
        """Stop every process it started and every process on its hosts, remove the namespaces and
        hosts files, stop the switch (idempotent)."""
        for process in self._spawned:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for host in self.hosts.values():
            _remove_namespace(host.namespace)
        if self._switch is not None:
            with contextlib.suppress(ProcessLookupError):
                self._switch.kill()
            self._switch.wait(timeout=10)
            for pipe in (self._switch.stdin, self._switch.stdout):
                if pipe is not None:
                    pipe.close()
            self._switch = None
            (Path("/run") / f"{self.lab}-switch.pid").unlink(missing_ok=True)
        if self._switch_log is not None:
            self._switch_log.close()
            self._switch_log = None
        for process in self._spawned:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self._spawned.clear()

    def __enter__(self) -> NetLab:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # ------------------------------------------------------------------ names and addresses
    def address(self, name: str) -> str:
        """The address of host ``name``, or of a service given its own address (:meth:`alias`)."""
        for host in self.hosts.values():
            if host.name == name:
                return host.address
            if name in host.aliases:
                return host.aliases[name]
        raise KeyError(name)

    def host_of(self, name: str) -> Host:
        """The host that ``name`` (a host or an alias) is on."""
        for host in self.hosts.values():
            if host.name == name or name in host.aliases:
                return host
        raise KeyError(name)

    def alias(self, host: str, service: str) -> str:
        """Give ``service`` an address of its own on ``host`` (so that several services may each
        listen on the port the manifests give them), named in every host's hosts file."""
        if any(service == h.name or service in h.aliases for h in self.hosts.values()):
            raise ValueError(f"{service} already has an address")
        self._next_address += 1
        if self._next_address > 250:
            raise ValueError("the subnet is full")
        address = f"{self._octets}.{self._next_address}"
        on = self.hosts[host]
        _ip("-n", on.namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        on.aliases[service] = address
        self._write_hosts_files()
        return address

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost"]
        for host in self.hosts.values():
            lines.append(f"{host.address} {host.name}")
            lines += [f"{address} {service}" for service, address in host.aliases.items()]
        for host in self.hosts.values():
            folder = NETNS_ETC / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ processes
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``."""
        return [IP, "netns", "exec", self.hosts[host].namespace, *argv]

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
        user: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (its own session: :meth:`down` kills its group), as ``user``
        if given (its uid and group, no other groups)."""
        if user is not None:
            entry = pwd.getpwnam(user)
            argv = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", *argv]
        with contextlib.ExitStack() as opened:
            out: IO[bytes] | int = (
                opened.enter_context(log.open("ab")) if log is not None else subprocess.DEVNULL
            )
            process = subprocess.Popen(
                self.command(host, argv),
                env=dict(env) if env is not None else None,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
            )
        self._spawned.append(process)
        _wait_entered(process, self.hosts[host].namespace)
        return process

    def run(
        self, host: str, argv: Sequence[str], *, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to its end."""
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout_s)

    def kill_host(self, host: str) -> int:
        """SIGKILL every process on ``host`` at once; how many there were."""
        namespace = self.hosts[host].namespace
        pids = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True
        ).stdout.split()
        _kill_namespace(namespace)
        return len(pids)

    # ------------------------------------------------------------------ faults
    def partition(self, host: str, from_hosts: Sequence[str] | None = None) -> None:
        """Drop every frame between ``host`` and ``from_hosts`` (default: every other host)."""
        others = list(from_hosts) if from_hosts is not None else [h for h in self.hosts if h != host]
        self._control({"op": "partition", "host": host, "from": others})

    def heal(self) -> None:
        """End every partition."""
        self._control({"op": "heal"})

    def link(self, host: str, *, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Each frame ``host`` sends waits ``delay_ms`` and is lost with probability ``loss``, as
        ``tc netem`` on its interface (0, 0: a clean link again)."""
        if not 0 <= delay_ms <= MAX_DELAY_MS or not 0 <= loss <= 1:
            raise ValueError("delay_ms: 0 to 10,000; loss: 0 to 1")
        self._control({"op": "link", "host": host, "delay_ms": delay_ms, "loss": loss})

    def _control(self, order: dict[str, Any]) -> None:
        if self._switch is None or self._switch.stdin is None:
            raise RuntimeError("the lab is not up")
        if order.get("host") is not None and order["host"] not in self.hosts:
            raise KeyError(order["host"])
        self._switch.stdin.write(json.dumps(order) + "\n")
        self._switch.stdin.flush()
        self._answer("ok")

    def _answer(self, expected: str, timeout_s: float = 5.0) -> None:
        assert self._switch is not None and self._switch.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = ""
        while time.monotonic() < deadline:
            line = self._switch.stdout.readline().strip()
            if line or self._switch.poll() is not None:
                break
        if line != expected:
            raise RuntimeError(f"the switch answered {line!r} (see {self.work_dir / 'switch.log'})")


# ---------------------------------------------------------------------------- the switch process
@dataclass(slots=True)
class _Port:
    host: str
    fd: int
    delay_s: float = 0.0
    loss: float = 0.0


class Switch:
    """A learning Ethernet switch over TAP devices, with a partition table and per-port latency
    and loss on what a port's host sends. Frames from one port keep their order (each is written
    at its time, and all of a port's frames wait the same)."""

    def __init__(self, ports: Mapping[str, int]) -> None:
        self.ports = {host: _Port(host, fd) for host, fd in ports.items()}
        self.cut: set[frozenset[str]] = set()
        self._where: dict[bytes, str] = {}  # MAC -> port
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for port in self.ports.values():
            loop.add_reader(port.fd, self._read, port)

    def order(self, order: Mapping[str, Any]) -> None:
        op = order.get("op")
        if op == "partition":
            self.cut |= {
                frozenset((order["host"], other)) for other in order["from"] if other != order["host"]
            }
        elif op == "heal":
            self.cut.clear()
        elif op == "link":
            port = self.ports[order["host"]]
            port.delay_s, port.loss = float(order["delay_ms"]) / 1000, float(order["loss"])
        else:
            raise ValueError(f"unknown order {op!r}")

    def _read(self, port: _Port) -> None:
        while True:
            try:
                frame = os.read(port.fd, MAX_FRAME)
            except BlockingIOError:
                return
            except OSError:  # the host's end went away (its namespace was removed)
                if self._loop is not None:
                    self._loop.remove_reader(port.fd)
                return
            if len(frame) < 14:
                continue
            self._where[frame[6:12]] = port.host
            to = self._where.get(frame[0:6])
            targets = (
                [to] if to is not None and to != port.host else [h for h in self.ports if h != port.host]
            )
            for target in targets:
                self._forward(port, self.ports[target], frame)

    def _forward(self, source: _Port, target: _Port, frame: bytes) -> None:
        if frozenset((source.host, target.host)) in self.cut:
            return
        if source.loss and random.random() < source.loss:
            return
        if source.delay_s and self._loop is not None:
            self._loop.call_later(source.delay_s, _write, target.fd, frame)
        else:
            _write(target.fd, frame)


def _write(fd: int, frame: bytes) -> None:
    with contextlib.suppress(BlockingIOError, OSError):  # a full queue drops, as a switch does
        os.write(fd, frame)


def _tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def _serve_switch(lab: str, ports: Sequence[str]) -> None:
    """The switch process: make a TAP per ``host=namespace`` and move it into the namespace as
    ``eth0``, say ``ready``, then forward frames and take orders (JSON lines on stdin, ``ok`` each)
    until stdin closes."""
    fds: dict[str, int] = {}
    for i, spec in enumerate(ports):
        host, namespace = spec.split("=", 1)
        device = f"{lab[-6:]}p{i}"
        fds[host] = _tap(device)
        _ip("link", "set", device, "netns", namespace)
        _ip("-n", namespace, "link", "set", device, "name", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")  # a TAP that is down reads EBADFD
    pid_file = Path("/run") / f"{lab}-switch.pid"
    pid_file.write_text(f"{os.getpid()} {os.getppid()}")  # the switch, and who owns the lab
    switch = Switch(fds)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        switch.start(loop)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        print("ready", flush=True)
        while line := await reader.readline():
            try:
                switch.order(json.loads(line))
                print("ok", flush=True)
            except (ValueError, KeyError) as exc:
                print(f"error {exc}", flush=True)

    try:
        asyncio.run(serve())
    finally:
        pid_file.unlink(missing_ok=True)


@contextlib.contextmanager
def lab(hosts: Sequence[str], **options: Any) -> Iterator[NetLab]:
    """A :class:`NetLab` up for the block, down after it, whatever happens."""
    made = NetLab(hosts, **options)
    with made:
        yield made


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fleetctl.testing.netlab")
    commands = parser.add_subparsers(dest="command", required=True)
    switch = commands.add_parser("switch", help="the switch process of a lab (started by NetLab)")
    switch.add_argument("lab")
    switch.add_argument("ports", nargs="+", help="host=namespace")
    commands.add_parser("sweep", help="remove what labs whose owner is gone left behind")
    args = parser.parse_args(argv)
    if args.command == "switch":
        _serve_switch(args.lab, args.ports)
    else:
        for name in sweep():
            print(f"removed {name}")


if __name__ == "__main__":
    main()
