"""Tracing's cost on a tool call: a tool call over Streamable HTTP to a fleet MCP server
(``TracedMCPServer``: its ``execute_tool`` SERVER span and latency histogram) from a client that
opens an ``execute_tool`` CLIENT span and injects ``traceparent`` as the kit does, with tracing on
(the SDK, batching to an OTLP/HTTP receiver in the parent process) against tracing off (no endpoint:
the API's non-recording spans) on the same code.

A process's tracer provider is set once, so each mode runs in its own process; rounds alternate
between the modes. No target: the page reports the ratio and the time added per call. Both sides
of the call run in this one process, so the figure is a call's whole cost (in the fleet, the client
and the server each pay their half in their own process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Generator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from opentelemetry.trace import SpanKind

from bench._mcp import serving
from fleet import telemetry
from mcp_servers._base import READ_ONLY, TracedMCPServer

ROUNDS, CALLS, WARMUP = 4, 300, 30
# Per call: our execute_tool CLIENT and SERVER spans, and the MCP SDK's client and server span of each
# of the three requests a fresh client makes (server/discover, tools/list, tools/call).
SPANS_PER_CALL = 8


class _Inject(httpx2.Auth):
    """What the kit's auth flow does besides the token: the current span's trace context goes along."""

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        telemetry.inject(request.headers)
        yield request


def _server() -> TracedMCPServer:
    mcp = TracedMCPServer("bench", "mcp-bench")

    @mcp.tool(annotations=READ_ONLY)
    async def lookup(n: int) -> dict[str, Any]:
        """A fixed answer: the measurement is the tracing, not the work."""
        return {"n": n, "status": "paid"}

    return mcp


async def _calls(url: str, n: int) -> list[float]:
    samples = []
    async with httpx2.AsyncClient(auth=_Inject()) as http:
        for i in range(n):
            started = time.perf_counter()
            with telemetry.execute_tool_span("lookup", kind=SpanKind.CLIENT, server="mcp-bench", run_id="r"):
                # A client per call, as the kit makes one per attempt.
                async with Client(streamable_http_client(url, http_client=http)) as client:
                    result = await client.call_tool("lookup", {"n": i})
            samples.append(time.perf_counter() - started)
            assert not result.is_error, result.content
    return samples


async def _round(mode: str, otlp_url: str, calls: int = CALLS) -> list[float]:
    tracing = telemetry.configure("bench", otlp_url) if mode == "on" else None
    try:
        async with serving(_server(), telemetry.with_metrics) as url:
            await _calls(url, min(WARMUP, calls))
            return await _calls(url, calls)
    finally:
        if tracing is not None:
            tracing.shutdown()


class _Sink:
    """An OTLP/HTTP receiver that counts the export requests and answers them (empty response)."""

    def __init__(self) -> None:
        self.requests = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                sink.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    @contextlib.contextmanager
    def serving(self) -> Iterator[_Sink]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join(timeout=5)


def _in_a_process(mode: str, otlp_url: str, calls: int) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.telemetry", mode, otlp_url, str(calls)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    samples: list[float] = json.loads(done.stdout.strip().splitlines()[-1])
    return samples


def run(rounds: int = ROUNDS, calls: int = CALLS) -> dict[str, Any]:
    """Both modes' p50 and p99 per call and their ratio."""
    off: list[float] = []
    on: list[float] = []
    with _Sink().serving() as sink:
        for _ in range(rounds):
            off += _in_a_process("off", sink.url, calls)
            on += _in_a_process("on", sink.url, calls)
    off_p50, on_p50 = statistics.median(off), statistics.median(on)
    result = {
        "baseline": "the same call with tracing off",
        "calls": len(on),
        "off_p50_ms": round(off_p50 * 1000, 3),
        "on_p50_ms": round(on_p50 * 1000, 3),
        "off_p99_ms": round(sorted(off)[int(0.99 * len(off))] * 1000, 3),
        "on_p99_ms": round(sorted(on)[int(0.99 * len(on))] * 1000, 3),
        "ratio": round(on_p50 / off_p50, 3),
        "added_p50_ms": round((on_p50 - off_p50) * 1000, 3),
        "spans_per_call": SPANS_PER_CALL,
        "export_requests": sink.requests,
    }
    return result


def main() -> dict[str, Any]:
    result = run()
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4:
        print(json.dumps(asyncio.run(_round(sys.argv[1], sys.argv[2], int(sys.argv[3])))))
    else:
        main()
