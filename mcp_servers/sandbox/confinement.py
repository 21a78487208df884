"""The layers around every sandbox beyond bubblewrap's namespaces, and the start-up check of them.

- ``seccomp``: the filter of :mod:`.syscall_filter`, handed to bubblewrap as ``--seccomp FD``.
- ``userns``: ``--disable-userns`` (bubblewrap >= 0.8): the sandbox cannot make a user namespace.
- ``cgroups``: a cgroup per call (:mod:`.cgroups`) with memory, pids and CPU limits.

A layer the host cannot give is fatal if it is ``required``, else a loud warning at every start;
never silently skipped. :func:`~mcp_servers.sandbox.runner.preflight` runs one canary call at server start and checks from
inside that the layers are in force; what every sandbox has without them (no capabilities,
NoNewPrivs, a non-root uid, a clean environment) is always required.
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.errors import ErrorCode, FleetError
from mcp_servers.sandbox.cgroups import CgroupTree
from mcp_servers.sandbox.syscall_filter import build_filter

log = logging.getLogger(__name__)
LAYERS = ("seccomp", "userns", "cgroups")
# what the sandbox's processes may have in their environment (bubblewrap's ``--setenv`` and ``PWD``)
ALLOWED_ENV = frozenset({"PATH", "HOME", "LANG", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PWD"})


@dataclass(slots=True)
class Confinement:
    """The layers in force for one ``Sandbox``; ``missing`` says which are not, and why."""

    seccomp: bytes | None = None
    disable_userns: bool = False
    cgroups: CgroupTree | None = None
    missing: dict[str, str] = field(default_factory=dict)

    @classmethod
    def none(cls) -> Confinement:
        """No layer beyond bubblewrap's namespaces (for comparisons in benchmarks)."""
        return cls(missing=dict.fromkeys(LAYERS, "switched off"))

    @classmethod
    def build(cls, bwrap: Path, *, required: Collection[str]) -> Confinement:
        """Every layer the host can give. A missing one that is in ``required`` raises
        ``dependency_unavailable``; the others are logged as warnings."""
        layers = cls()
        try:
            layers.seccomp = build_filter()
        except FleetError as exc:
            layers.missing["seccomp"] = exc.message
        version = bwrap_version(bwrap)
        if version >= (0, 8):
            layers.disable_userns = True
        else:
            layers.missing["userns"] = f"bubblewrap {version} has no --disable-userns (needs >= 0.8)"
        try:
            layers.cgroups = CgroupTree.create()
        except FleetError as exc:
            layers.missing["cgroups"] = exc.message
        layers.report(required)
        return layers

    def report(self, required: Collection[str]) -> None:
        fatal = {name: why for name, why in self.missing.items() if name in required}
        if fatal:
            self.close()
            detail = "; ".join(f"{name}: {why}" for name, why in fatal.items())
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE,
                f"the sandbox cannot confine calls here ({detail}); FLEET_SANDBOX_REQUIRED_LAYERS"
                " without them runs it anyway, with a warning",
            )
        for name, why in self.missing.items():
            log.warning("SANDBOX LAYER MISSING: %s (%s): untrusted code runs without it", name, why)

    def close(self) -> None:
        if self.cgroups is not None:
            self.cgroups.remove()


def bwrap_version(bwrap: Path) -> tuple[int, ...]:
    done = subprocess.run([str(bwrap), "--version"], capture_output=True, text=True, timeout=10, env={})
    found = re.search(r"(\d{1,9})\.(\d{1,9})(?:\.(\d{1,9}))?", done.stdout)
    return tuple(int(part) for part in found.groups("0")) if found else (0,)


CANARY = r"""
import ctypes, errno, json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
def env(path):
    return sorted(v.split(b"=", 1)[0].decode() for v in open(path, "rb").read().split(b"\0") if v)
report = {
    "seccomp": status["Seccomp"].strip(), "no_new_privs": status["NoNewPrivs"].strip(),
    "cap_eff": status["CapEff"].strip(), "uid": os.getuid(),
    "env_1": env("/proc/1/environ"), "env_self": env("/proc/self/environ"),
}
libc = ctypes.CDLL(None, use_errno=True)
report["unshare_refused"] = libc.unshare(0x10000000) != 0  # CLONE_NEWUSER, last: it would move us
report["unshare_errno"] = errno.errorcode.get(ctypes.get_errno(), "")
print(json.dumps(report))
"""


def check_canary(report: dict[str, Any]) -> list[tuple[str, str]]:
    """What the canary call saw that is wrong, as (layer, problem); ``base`` is what every sandbox
    must have."""
    wrong = []
    if report.get("seccomp") != "2":
        wrong.append(("seccomp", f"Seccomp is {report.get('seccomp')}, not 2"))
    if not report.get("unshare_refused"):
        wrong.append(("userns", "unshare(CLONE_NEWUSER) succeeded"))
    if report.get("no_new_privs") != "1":
        wrong.append(("base", "NoNewPrivs is not 1"))
    if int(str(report.get("cap_eff", "1")), 16) != 0:
        wrong.append(("base", f"CapEff is {report.get('cap_eff')}"))
    if report.get("uid") == 0:
        wrong.append(("base", "the code runs as uid 0"))
    for name in ("env_1", "env_self"):
        extra = set(report.get(name, ["?"])) - ALLOWED_ENV
        if extra:
            wrong.append(("base", f"{name} holds {sorted(extra)}"))
    return wrong
