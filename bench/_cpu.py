"""CPU time spent by a set of process trees, read from ``/proc`` (Linux), grouped by tree.

A tree's time is the user and system time of every live process in it plus what its reaped children
left in their parent's ``cutime``/``cstime``, so a Postgres backend that exits between two samples is
still counted (in the postmaster's row).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class _Proc:
    ppid: int
    cpu_s: float


def _read(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:  # gone since the listing
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": a comm may hold spaces
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return _Proc(int(fields[1]), (utime + stime + cutime + cstime) / TICKS_PER_S)


def _processes() -> dict[int, _Proc]:
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (proc := _read(int(entry.name))) is not None:
            found[int(entry.name)] = proc
    return found


def _trees(roots: Mapping[str, int]) -> Iterator[tuple[str, int, _Proc]]:
    """Every live process under one of the named roots: (the root's name, its pid, the process). A
    process under two roots counts for the nearer one (a service under the supervisor counts for the
    service)."""
    procs, by_pid = _processes(), {pid: name for name, pid in roots.items()}
    for pid, proc in procs.items():
        ancestor, hops = pid, 0
        while ancestor not in by_pid and ancestor in procs and hops < 64:
            ancestor, hops = procs[ancestor].ppid, hops + 1
        if ancestor in by_pid:
            yield by_pid[ancestor], pid, proc


def cpu_by_tree(roots: Mapping[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named root process and its descendants."""
    totals = dict.fromkeys(roots, 0.0)
    for name, _, proc in _trees(roots):
        totals[name] += proc.cpu_s
    return totals


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process), from ``/proc/stat``."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / TICKS_PER_S  # user nice system idle iowait irq softirq steal


def _pss_bytes(pid: int) -> int:
    """A process's proportional set size (its private memory plus its share of what it shares)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # gone, or not ours to read
        pass
    return 0


def pss_by_tree(roots: Mapping[str, int]) -> dict[str, int]:
    """Bytes of memory (PSS) of each named root process and its descendants: summed over processes,
    PSS counts a page shared by several once in all, where RSS counts it in each."""
    totals = dict.fromkeys(roots, 0)
    for name, pid, _ in _trees(roots):
        totals[name] += _pss_bytes(pid)
    return totals
