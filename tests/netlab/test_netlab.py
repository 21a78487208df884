"""The hosts-on-one-machine harness (fleetctl.testing.netlab) does what the fault tests rely on, on real
namespaces: hosts reach each other by name across the switch, a partition drops traffic silently and
heals, latency and loss on a link are what was asked, a host's processes die at once, and nothing of
a lab is left on the machine afterwards, even when its owner was killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetctl.testing import netlab
from fleetctl.testing.netlab import NetLab

# A TCP echo server on port 7000 of its host; a client that connects by name, sends a line and
# prints the round trip's seconds (or the error's name).
ECHO_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen()
while True:
    c, _ = s.accept()
    with c:
        while (b := c.recv(65536)):
            c.sendall(b)
"""
# A lab made by a process that then dies without taking it down.
ORPHANING = """
import os, sys
from pathlib import Path
from fleetctl.testing.netlab import NetLab
lab = NetLab(["x"], work_dir=Path(sys.argv[1])).up()
sleeper = lab.spawn("x", ["sleep", "300"])
print(lab.hosts["x"].namespace, sleeper.pid, flush=True)
os._exit(0)
"""
ECHO_CLIENT = """
import socket, sys, time
try:
    started = time.monotonic()
    s = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    connected = time.monotonic()
    s.sendall(b"x"); s.recv(1)
    print(connected - started, time.monotonic() - connected)
except OSError as exc:
    print(type(exc).__name__)
"""


def echo(lab: NetLab, frm: str, to: str, timeout_s: float = 5.0) -> tuple[float, float] | str:
    """From ``frm`` to ``to``'s echo server: (connect seconds, one round trip's seconds), or the error."""
    answer = lab.run(frm, [sys.executable, "-c", ECHO_CLIENT, to, str(timeout_s)], timeout_s=timeout_s + 30)
    words = answer.stdout.split()
    assert words, answer.stderr
    return (float(words[0]), float(words[1])) if len(words) == 2 else words[0]


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one has reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def three(tmp_path: Path) -> Iterator[NetLab]:
    assert os.geteuid() == 0, "the hosts harness makes network namespaces: it needs root"
    with NetLab(["a", "b", "c"], work_dir=tmp_path) as lab:
        for host in lab.hosts:
            lab.spawn(host, [sys.executable, "-c", ECHO_SERVER])
        deadline = time.monotonic() + 10
        while isinstance(echo(lab, "a", "b", 1), str) or isinstance(echo(lab, "a", "c", 1), str):
            assert time.monotonic() < deadline, "the echo servers did not come up"
        yield lab


def test_hosts_reach_each_other_by_name_on_their_own_addresses(three: NetLab) -> None:
    for frm, to in (("a", "b"), ("b", "c"), ("c", "a")):
        answer = echo(three, frm, to)
        assert isinstance(answer, tuple), answer
    addresses = {three.address(h) for h in three.hosts}
    assert len(addresses) == 3
    seen = three.run("b", ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout
    assert three.address("b") in seen and three.address("a") not in seen
    assert three.run("a", ["ip", "-4", "-o", "addr", "show", "eth0"]).returncode == 0
    # Not the machine's own network: the host cannot see the lab's hosts, nor they its loopback.
    assert (
        three.address("b") not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    )


def test_a_partition_drops_silently_and_heals(three: NetLab) -> None:
    three.partition("c")
    assert echo(three, "a", "c", timeout_s=2) == "TimeoutError"  # dropped, not refused: a timeout
    assert echo(three, "c", "b", timeout_s=2) == "TimeoutError"
    assert isinstance(echo(three, "a", "b"), tuple)  # the others still talk
    three.heal()
    assert isinstance(echo(three, "a", "c"), tuple)

    three.partition("a", ["b"])  # one pair only
    assert echo(three, "a", "b", timeout_s=2) == "TimeoutError"
    assert isinstance(echo(three, "a", "c"), tuple)
    three.heal()


def test_latency_on_a_link_is_added_to_each_frame_its_host_sends(three: NetLab) -> None:
    before = echo(three, "a", "b")
    assert isinstance(before, tuple) and before[1] < 0.1
    three.link("b", delay_ms=200)
    slow = echo(three, "a", "b")
    assert isinstance(slow, tuple)
    assert 0.2 <= slow[0] < 0.4 and 0.2 <= slow[1] < 0.4  # what b sends waits 200 ms: each round trip
    fast = echo(three, "a", "c")
    assert isinstance(fast, tuple) and fast[1] < 0.1  # only b's link is slow
    three.link("b")
    again = echo(three, "a", "b")
    assert isinstance(again, tuple) and again[1] < 0.1


def test_a_lossy_link_loses_about_what_was_asked(three: NetLab) -> None:
    three.link("c", loss=0.5)
    pings = [echo(three, "a", "c", timeout_s=0.5) for _ in range(20)]
    failed = sum(1 for p in pings if isinstance(p, str))
    # A connect needs c's SYN-ACK back, lost with probability 0.5 (TCP does not retry a SYN within
    # 0.5 s), and the echo needs c's answer (which TCP may send again after 200 ms, in time): from
    # about half to three quarters of the attempts fail. At least 3 of 20 is what a lossy link
    # cannot miss: a fair coin gives fewer about 1 time in 5,000.
    assert 3 <= failed <= 20, pings
    three.link("c")


def test_a_host_s_processes_die_at_once(three: NetLab) -> None:
    sleeper = three.spawn("b", ["sleep", "300"])
    assert three.kill_host("b") >= 2  # the echo server and the sleeper
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert echo(three, "a", "b", timeout_s=2) == "ConnectionRefusedError"  # the host is up, its server is not
    assert isinstance(echo(three, "a", "c"), tuple)


def test_nothing_of_a_lab_is_left_and_sweep_clears_what_a_killed_owner_left(tmp_path: Path) -> None:
    lab = NetLab(["x", "y"], work_dir=tmp_path).up()
    made = [h.namespace for h in lab.hosts.values()]
    lab.down()
    assert not set(made) & set(netlab.namespaces())
    assert not any((netlab.NETNS_ETC / name).exists() for name in made)

    # A lab whose owner dies without cleaning up (killed): its switch and host live on until a sweep.
    owner = subprocess.run(
        [sys.executable, "-c", ORPHANING, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    namespace, sleeper = owner.stdout.split()
    assert namespace in netlab.namespaces()
    removed = netlab.sweep()
    assert namespace in removed and namespace not in netlab.namespaces()
    assert not (netlab.NETNS_ETC / namespace).exists()
    time.sleep(0.2)
    assert not running(int(sleeper))  # its processes killed with it
    assert not list(Path("/run").glob(f"{namespace.split('-')[0]}-switch.pid"))
