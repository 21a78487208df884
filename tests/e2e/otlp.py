"""A small real OTLP/HTTP trace receiver for tests: an HTTP server on a free port that decodes each
``ExportTraceServiceRequest`` (protobuf) posted to ``/v1/traces`` and keeps its spans."""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as a collector sees it, with the ``service.name`` of the process that sent it."""

    service: str
    scope: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...] = ()  # (trace id, span id) of each span it links to


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


def spans_of(request: ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ReceivedSpan(
                    service=str(resource.get("service.name", "")),
                    scope=scope_spans.scope.name,
                    name=span.name,
                    kind=span.kind,
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    attributes={a.key: _value(a.value) for a in span.attributes},
                    links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                )


class OtlpReceiver:
    """Use with ``with``: serves on 127.0.0.1 until the block ends; ``url`` is the OTLP base URL."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                with receiver._changed:
                    receiver.spans.extend(spans_of(request))
                    receiver._changed.notify_all()
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test's output is for the test

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _wait(self, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        with self._changed:
            if not self._changed.wait_for(lambda: found(self.spans), timeout=timeout_s):
                names = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"the spans expected did not arrive in {timeout_s} s; got {names}")
            return list(self.spans)

    async def wait_for(
        self, found: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """All spans received, once ``found`` holds of them (AssertionError after ``timeout_s``)."""
        return await asyncio.to_thread(self._wait, found, timeout_s)
