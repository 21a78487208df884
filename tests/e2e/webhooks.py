"""A webhook receiver outside the fleet, for the outbox's tests: it records every request it gets."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SECRET = "test-webhook-secret"


@dataclass(frozen=True)
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class WebhookReceiver:
    """``/ok/...`` answers 200, ``/refuse/...`` 422, ``/down/...`` 503."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.deliveries.append(Delivery(self.path, dict(self.headers.items()), body))
                status = {"ok": 200, "refuse": 422, "down": 503}.get(self.path.split("/")[1], 404)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def destinations(self) -> dict[str, dict[str, str]]:
        return {
            "ops": {"url": self.url + "/ok/ops", "secret": SECRET},
            "customers": {"url": self.url + "/ok/customers", "secret": SECRET},
            "refusing": {"url": self.url + "/refuse/x"},
            "down": {"url": self.url + "/down/x"},
        }

    def to(self, path: str) -> list[Delivery]:
        return [d for d in self.deliveries if d.path == path]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
