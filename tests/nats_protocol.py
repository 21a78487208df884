"""Speaking NATS's client protocol by hand, for tests of what a server answers a CONNECT (nats-py
leaves a refused connection's socket to the garbage collector; a raw socket closes when asked)."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any


def answer_to_connect(port: int, connect: Callable[[dict[str, Any]], dict[str, Any]]) -> str:
    """What the server on ``port`` answers the CONNECT that ``connect`` makes from its INFO (its
    PINGs meanwhile aside), until PONG (taken) or -ERR (refused), or it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        info = json.loads(conn.recv(65536).decode().split(" ", 1)[1])
        options = {"verbose": False, "pedantic": False, **connect(info)}
        conn.sendall(f"CONNECT {json.dumps(options)}\r\nPING\r\n".encode())
        received = b""
        while b"PONG" not in received and b"-ERR" not in received:
            chunk = conn.recv(4096)
            if not chunk:
                break
            received += chunk
        return received.decode(errors="replace")
