"""Per-call cgroups: memory, processes and CPU of everything one sandbox call runs, together.

A :class:`CgroupTree` is one directory of a ``Sandbox``'s own below this process's cgroup in each
hierarchy (parsed from ``/proc/self/cgroup``; the parent is never written); each call gets a child
of it (:class:`CallCgroup`) with its limits written and read back, which the call's first process
joins before it execs bubblewrap, and which is killed and removed after the call.

cgroup v1 (tested): ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (RAM and swap
together), ``memory.swappiness`` 0, ``pids.max``, ``cpu.cfs_quota_us``. A v1 OOM kills only as many
processes as it takes to get under the limit and the call may still exit 0, so the OOM is read from
``oom_kill`` in ``memory.oom_control``. Kill: ``cgroup.kill`` of a v2 directory when the host mounts
one beside v1 (hybrid), else SIGKILL to every pid in ``cgroup.procs`` until it is empty.

cgroup v2 (written, NOT tested: the development host's v2 has only ``hugetlb``): ``memory.max``,
``memory.swap.max`` 0, ``memory.oom.group`` 1, ``pids.max``, ``cpu.max``, OOM from ``memory.events``,
kill by ``cgroup.kill``. v2 needs the memory, pids and cpu controllers delegated to this process's
cgroup (its ``cgroup.subtree_control``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import ErrorCode, FleetError

log = logging.getLogger(__name__)
PAGE = os.sysconf("SC_PAGE_SIZE")
CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu")
PREFIX = "fleet-sandbox-"  # then the server's pid, "-", a number
_sequence = itertools.count()


@dataclass(frozen=True, slots=True)
class CallCaps:
    """The limits of one call, for all its processes together."""

    memory_bytes: int = 1024 * 1024 * 1024
    pids: int = 64
    cpus: float = 1.0


@dataclass(frozen=True, slots=True)
class CallStats:
    oom_kills: int  # processes the kernel's OOM killer ended in the call
    pids_refused: int  # forks refused at pids.max
    memory_peak: int
    cpu_throttled: int  # CFS periods in which the call was held back at its quota


def unavailable(reason: str) -> FleetError:
    return FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, f"no per-call cgroups: {reason}")


def _mounts() -> dict[str, tuple[Path, str]]:
    """controller (``unified`` for cgroup2) -> (mount point, the mount's root in the hierarchy)."""
    found: dict[str, tuple[Path, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(kind) < 3 or kind[0] not in ("cgroup", "cgroup2"):
            continue
        where = (Path(fields[4]), fields[3])
        if kind[0] == "cgroup2":
            found.setdefault("unified", where)
            continue
        for option in kind[2].split(","):
            if option in V1_CONTROLLERS:
                found.setdefault(option, where)
    return found


def _own() -> dict[str, str]:
    """controller (``unified`` for cgroup2) -> this process's cgroup path in it."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["unified"]:
            own[name] = path
    return own


def _below(mount: Path, root: str, path: str) -> Path:
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return mount / relative.lstrip("/")


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise unavailable(f"writing {value!r} to {path}: {exc.strerror}") from exc


def _read_int(path: Path) -> int:
    text = path.read_text().strip()
    return -1 if text == "max" else int(text.split()[0])


def _field(path: Path, name: str) -> int:
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == name:
                return int(parts[1])
    return 0


class CgroupTree:
    """The cgroups of one ``Sandbox``. ``create`` raises ``dependency_unavailable`` where the host
    cannot give every call a memory, pids and CPU limit."""

    def __init__(self, dirs: dict[str, Path], v2: bool) -> None:
        self.dirs = dirs  # controller (or "unified") -> this tree's directory
        self.v2 = v2

    @classmethod
    def create(cls, name: str = "") -> CgroupTree:
        name = name or f"{PREFIX}{os.getpid()}-{next(_sequence)}"
        tree = cls._at(name)
        if tree.v2:  # the controllers for this tree, then for its calls
            _write(tree.dirs["unified"].parent / "cgroup.subtree_control", "+memory +pids +cpu")
        tree._mkdirs()
        if tree.v2:
            _write(tree.dirs["unified"] / "cgroup.subtree_control", "+memory +pids +cpu")
        for stale in trees_of(None):  # those of servers that died without closing theirs
            stale.remove()
        return tree

    @classmethod
    def _at(cls, name: str) -> CgroupTree:
        """The tree called ``name`` below this process's cgroups (not created)."""
        mounts, own = _mounts(), _own()
        unified = mounts.get("unified")
        if unified is not None and not any(c in mounts for c in V1_CONTROLLERS):
            base = _below(*unified, own.get("unified", "/"))
            enabled = set((base / "cgroup.controllers").read_text().split())
            if not {"memory", "pids", "cpu"} <= enabled:
                raise unavailable(f"cgroup v2 at {base} lacks memory, pids or cpu ({sorted(enabled)})")
            return cls({"unified": base / name}, v2=True)
        missing = [c for c in V1_CONTROLLERS if c not in mounts or c not in own]
        if missing:
            raise unavailable(f"no cgroup v1 {', '.join(missing)} hierarchy")
        dirs = {c: _below(*mounts[c], own[c]) / name for c in V1_CONTROLLERS}
        if unified is not None and "unified" in own:  # hybrid: v2 only to kill the call at once
            dirs["unified"] = _below(*unified, own["unified"]) / name
        return cls(dirs, v2=False)

    def _mkdirs(self) -> None:
        for path in self.dirs.values():
            try:
                path.mkdir(exist_ok=True)
            except OSError as exc:
                raise unavailable(f"cannot create {path}: {exc.strerror}") from exc

    def call(self, caps: CallCaps) -> CallCgroup:
        """A new cgroup for one call with ``caps`` written and read back (``dependency_unavailable``
        if the kernel did not take one)."""
        name = f"call-{next(_sequence)}"
        self._mkdirs()  # again: a Sandbox still runs calls after close() removed the tree
        group = CallCgroup({c: d / name for c, d in self.dirs.items()}, self.v2)
        try:
            for path in group.dirs.values():
                path.mkdir()
            group.limit(caps)
        except BaseException:
            group.remove_now()
            raise
        return group

    def remove(self) -> None:
        """Removes this tree, killing what a call whose loop is gone left in it."""
        calls = {p.name for d in self.dirs.values() if d.is_dir() for p in d.iterdir() if p.is_dir()}
        for name in calls:
            group = CallCgroup({c: d / name for c, d in self.dirs.items()}, self.v2)
            group.kill()
            group.remove_now()
        for path in self.dirs.values():
            with contextlib.suppress(OSError):  # EBUSY: a killed call still exiting; logged below
                path.rmdir()
        if any(path.exists() for path in self.dirs.values()):
            log.warning("sandbox cgroups left behind: %s", sorted(map(str, self.dirs.values())))

    def processes(self) -> dict[str, list[int]]:
        """The pids in each call's cgroup of this tree (``""``: in the tree itself)."""
        base = self.dirs["unified" if self.v2 else "pids"]
        if not base.is_dir():
            return {}
        found = {"": _pids(base)}
        found.update({p.name: _pids(p) for p in base.iterdir() if p.is_dir()})
        return {name: pids for name, pids in found.items() if pids}


def trees_of(pid: int | None) -> list[CgroupTree]:
    """The trees of the ``Sandbox``es of process ``pid`` beside this process's (None: of processes
    that are gone)."""
    try:
        tree = CgroupTree._at("x")
    except FleetError:
        return []
    parent = next(iter(tree.dirs.values())).parent
    found = []
    for path in parent.glob(f"{PREFIX}*"):
        owner = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if not owner.isdigit() or (pid is not None and int(owner) != pid):
            continue
        if pid is None and Path(f"/proc/{owner}").exists():
            continue
        found.append(CgroupTree._at(path.name))
    return found


def _pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


class CallCgroup:
    """One call's cgroup in every hierarchy."""

    def __init__(self, dirs: dict[str, Path], v2: bool) -> None:
        self.dirs = dirs
        self.v2 = v2

    @property
    def name(self) -> str:
        return next(iter(self.dirs.values())).name

    @property
    def procs(self) -> list[Path]:
        """The ``cgroup.procs`` files the call's first process writes its pid to."""
        return [path / "cgroup.procs" for path in self.dirs.values()]

    def _path(self, controller: str) -> Path:
        return self.dirs["unified" if self.v2 else controller]

    def limit(self, caps: CallCaps) -> None:
        memory = max(caps.memory_bytes // PAGE, 1) * PAGE
        quota = max(int(caps.cpus * CPU_PERIOD_US), 1000)
        mem, pids, cpu = self._path("memory"), self._path("pids"), self._path("cpu")
        if self.v2:
            wanted = [(mem / "memory.max", memory), (pids / "pids.max", caps.pids)]
            swap = mem / "memory.swap.max"
            if swap.exists():
                wanted.append((swap, 0))
            wanted.append((mem / "memory.oom.group", 1))
            for path, value in wanted:
                _write(path, str(value))
            _write(cpu / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            if (cpu / "cpu.max").read_text().split() != [str(quota), str(CPU_PERIOD_US)]:
                raise unavailable("cpu.max did not take")
        else:
            wanted = [(mem / "memory.limit_in_bytes", memory)]
            memsw = mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():  # after the RAM limit: memsw must be >= it at every moment
                wanted.append((memsw, memory))
            elif _swap_total() > 0:
                raise unavailable("swap is on and memory.memsw is missing: swap would be unlimited")
            wanted += [
                (mem / "memory.swappiness", 0),
                (pids / "pids.max", caps.pids),
                (cpu / "cpu.cfs_period_us", CPU_PERIOD_US),
                (cpu / "cpu.cfs_quota_us", quota),
            ]
            for path, value in wanted:
                _write(path, str(value))
        for path, value in wanted:
            if _read_int(path) != value:
                raise unavailable(f"{path.name} reads {path.read_text().strip()}, not {value}")

    def stats(self) -> CallStats:
        mem, pids = self._path("memory"), self._path("pids")
        if self.v2:
            oom = max(
                _field(mem / "memory.events", "oom_kill"), _field(mem / "memory.events", "oom_group_kill")
            )
            peak_file = mem / "memory.peak"
        else:
            oom, peak_file = _field(mem / "memory.oom_control", "oom_kill"), mem / "memory.max_usage_in_bytes"
        peak = 0
        with contextlib.suppress(OSError, ValueError):
            peak = _read_int(peak_file)
        return CallStats(
            oom_kills=oom,
            pids_refused=_field(pids / "pids.events", "max"),
            memory_peak=peak,
            cpu_throttled=_field(self._path("cpu") / "cpu.stat", "nr_throttled"),
        )

    def kill(self) -> None:
        """SIGKILL to every process of the call (``cgroup.kill`` where there is one)."""
        unified = self.dirs.get("unified")
        if unified is not None and (unified / "cgroup.kill").exists():
            with contextlib.suppress(FileNotFoundError):
                (unified / "cgroup.kill").write_text("1")
            return
        for path in self.dirs.values():
            for pid in _pids(path):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def alive(self) -> bool:
        return any(_pids(path) for path in self.dirs.values())

    async def destroy(self, within_s: float = 5.0) -> None:
        """Kills what is left of the call and removes its cgroup."""
        deadline = time.monotonic() + within_s
        self.kill()
        while self.alive():
            if time.monotonic() > deadline:
                raise FleetError(ErrorCode.INTERNAL, f"the call's processes outlived {within_s} s")
            await asyncio.sleep(0.002)
            self.kill()
        while not self.remove_now():
            if time.monotonic() > deadline:
                raise FleetError(ErrorCode.INTERNAL, "the call's cgroup could not be removed")
            await asyncio.sleep(0.005)

    def remove_now(self) -> bool:
        """Removes the (empty) cgroup; False if the kernel still holds one of its directories."""
        removed = True
        for path in self.dirs.values():
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: its last processes are still exiting
                removed = False
        return removed


def _swap_total() -> int:
    return _field(Path("/proc/meminfo"), "SwapTotal:")
