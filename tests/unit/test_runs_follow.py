"""``fleet runs events --follow`` resumes a dropped stream from the last event it saw: against a real
HTTP server on loopback that cuts the first connection in the middle of the run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from fleet.cli_common import ServiceClient
from fleet.errors import ErrorCode, FleetError
from fleet.runs_cli import events_of

TYPES = ("run.submitted", "run.working", "step.started", "step.failed", "run.failed")


def event(seq: int) -> dict[str, object]:
    return {"run_id": "r1", "seq": seq, "type": TYPES[seq - 1], "ts": "t", "actor": "w", "payload": {}}


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclass
class FlakyCoordinator:
    """Serves ``/v1/runs/r1`` and its SSE; the first stream is cut after ``cut_after`` events."""

    cut_after: int = 2
    cursors: list[int] = field(default_factory=list)
    sent: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        path = head.split(" ")[1]
        headers = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        if path.endswith("/events"):
            await self.stream(writer, int(headers.get("last-event-id", "0")))
        else:
            body = json.dumps({"run_id": "r1", "state": "failed" if self.sent == 5 else "working"}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n")
            writer.write(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    async def stream(self, writer: asyncio.StreamWriter, after: int) -> None:
        self.cursors.append(after)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        first = len(self.cursors) == 1
        for seq in range(after + 1, len(TYPES) + 1):
            if first and seq > self.cut_after:
                return  # cut: no closing chunk, as when a proxy or the coordinator goes away
            data = f"id: {seq}\nevent: {TYPES[seq - 1]}\ndata: {json.dumps(event(seq))}\n\n"
            writer.write(chunk(data.encode()))
            self.sent = max(self.sent, seq)
        writer.write(b"0\r\n\r\n")


@pytest.fixture
async def coordinator() -> AsyncIterator[tuple[FlakyCoordinator, str]]:
    fake = FlakyCoordinator()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield fake, f"http://127.0.0.1:{port}"


async def test_a_dropped_stream_resumes_after_the_last_event_with_no_gap_and_no_repeat(
    coordinator: tuple[FlakyCoordinator, str],
) -> None:
    fake, url = coordinator
    async with httpx.AsyncClient(timeout=10) as http:
        api = ServiceClient(http, url, {"Authorization": "Bearer t"})
        async with asyncio.timeout(20):
            seen = [e["seq"] async for e in events_of(api, "r1", 0, follow=True, last_seq=0)]
    assert seen == [1, 2, 3, 4, 5]
    assert fake.cursors == [0, 2]  # the second connection asked for what came after seq 2


async def test_a_replay_without_follow_stops_at_the_runs_last_event(
    coordinator: tuple[FlakyCoordinator, str],
) -> None:
    fake, url = coordinator
    fake.cut_after = 99  # no cut
    async with httpx.AsyncClient(timeout=10) as http:
        api = ServiceClient(http, url, {})
        seen = [e["seq"] async for e in events_of(api, "r1", 1, follow=False, last_seq=3)]
        nothing = [e async for e in events_of(api, "r1", 3, follow=False, last_seq=3)]
    assert (seen, nothing) == ([2, 3], [])
    assert fake.cursors == [1]  # nothing new: not even a connection


async def test_an_unreachable_coordinator_is_a_clear_error() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with httpx.AsyncClient(timeout=2) as http:
        api = ServiceClient(http, f"http://127.0.0.1:{port}", {})
        with pytest.raises(FleetError) as caught:
            await api.get("/v1/runs/r1")
    assert caught.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE
