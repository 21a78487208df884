"""``fleet runs events --follow`` resumes a dropped stream from the last event it saw: against a real
HTTP server on loopback that cuts the first connection in the middle of the run (or closes it, and is
restarting when asked how the run stands), and that issues tokens each good for one request only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.tokens import TokenClient
from fleetctl import runs_cli
from fleetctl.cli_common import OperatorAuth, ServiceClient
from fleetctl.runs_cli import events_of

TYPES = ("run.submitted", "run.working", "step.started", "step.failed", "run.failed")


def event(seq: int) -> dict[str, object]:
    return {"run_id": "r1", "seq": seq, "type": TYPES[seq - 1], "ts": "t", "actor": "w", "payload": {}}


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@dataclass
class FlakyCoordinator:
    """Serves ``/v1/runs/r1`` and its SSE; the first stream is cut after ``cut_after`` events (or,
    with ``clean_cut``, closed as if the run had ended). The first ``down_for`` state requests get
    no answer (a coordinator restarting); with ``refuse_state``, each is refused (401). With ``one_use_tokens``, it also serves ``/oauth/token``
    and refuses (401) a token it has seen before: the stand-in for one that has expired."""

    cut_after: int = 2
    clean_cut: bool = False
    down_for: int = 0
    one_use_tokens: bool = False
    refuse_state: bool = False
    cursors: list[int] = field(default_factory=list)
    sent: int = 0
    state_requests: int = 0
    issued: int = 0
    bearers: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        path = head.split(" ")[1]
        headers = dict(line.lower().split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        await reader.readexactly(int(headers.get("content-length", "0")))
        if path == "/oauth/token":
            self.issued += 1
            # 30 s is the TokenClient's margin: a token it may never reuse, so one per request.
            respond(writer, {"access_token": f"tok-{self.issued}", "expires_in": 30})
        elif self.one_use_tokens and not self.fresh(headers.get("authorization", "")):
            respond(writer, {"error": {"code": "unauthenticated", "message": "token expired"}}, 401)
        elif path.endswith("/events"):
            await self.stream(writer, int(headers.get("last-event-id", "0")))
        else:
            self.state_requests += 1
            if self.refuse_state:
                respond(writer, {"error": {"code": "unauthenticated", "message": "token expired"}}, 401)
            elif self.state_requests > self.down_for:
                respond(writer, {"run_id": "r1", "state": "failed" if self.sent == 5 else "working"})
        await writer.drain()
        writer.close()

    def fresh(self, authorization: str) -> bool:
        seen = authorization in self.bearers
        self.bearers.append(authorization)
        return bool(authorization) and not seen

    async def stream(self, writer: asyncio.StreamWriter, after: int) -> None:
        self.cursors.append(after)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        first = len(self.cursors) == 1
        for seq in range(after + 1, len(TYPES) + 1):
            if first and seq > self.cut_after and self.clean_cut:
                break  # closed cleanly, though the run goes on
            if first and seq > self.cut_after:
                return  # cut: no closing chunk, as when a proxy or the coordinator goes away
            data = f"id: {seq}\nevent: {TYPES[seq - 1]}\ndata: {json.dumps(event(seq))}\n\n"
            writer.write(chunk(data.encode()))
            self.sent = max(self.sent, seq)
        writer.write(b"0\r\n\r\n")


def respond(writer: asyncio.StreamWriter, document: object, status: int = 200) -> None:
    body = json.dumps(document).encode()
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nConnection: close\r\n".encode())
    writer.write(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


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
        api = ServiceClient(http, url)
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
        api = ServiceClient(http, url)
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
        api = ServiceClient(http, f"http://127.0.0.1:{port}")
        with pytest.raises(FleetError) as caught:
            await api.get("/v1/runs/r1")
    assert caught.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE


async def test_a_follow_that_outlives_its_token_gets_a_fresh_one_for_every_request_and_reconnect(
    coordinator: tuple[FlakyCoordinator, str],
) -> None:
    fake, url = coordinator
    fake.one_use_tokens = True  # a token sent twice is refused: as one sent after it expired
    async with httpx.AsyncClient(timeout=10) as http:
        tokens = TokenClient(
            token_url=url + "/oauth/token", client_id="operator", key=SigningKey.generate(), http=http
        )
        api = ServiceClient(http, url, OperatorAuth(tokens, "coordinator", "acme", ("agent:invoke",)))
        async with asyncio.timeout(20):
            run = await api.get("/v1/runs/r1")
            seen = [e["seq"] async for e in events_of(api, "r1", 0, follow=True, last_seq=0)]
            run = await api.get("/v1/runs/r1")  # the final state check, after the follow
    assert seen == [1, 2, 3, 4, 5] and run["state"] == "failed"
    assert fake.cursors == [0, 2]
    # get, stream, reconnect, the check after the stream closed, the final get: each its own token
    # (the server lowercases the header lines it reads)
    assert fake.bearers == [f"bearer tok-{n}" for n in range(1, 6)]


async def test_a_coordinator_restarting_at_the_state_check_is_retried_and_the_follow_goes_on(
    coordinator: tuple[FlakyCoordinator, str],
) -> None:
    fake, url = coordinator
    fake.clean_cut, fake.down_for = True, 1  # the stream closes early; then the state check fails
    async with httpx.AsyncClient(timeout=10) as http:
        api = ServiceClient(http, url)
        async with asyncio.timeout(20):
            seen = [e["seq"] async for e in events_of(api, "r1", 0, follow=True, last_seq=0)]
    assert seen == [1, 2, 3, 4, 5]
    assert fake.cursors == [0, 2] and fake.state_requests == 2  # the failed check, the final one


async def test_a_coordinator_that_stays_down_at_the_state_check_ends_the_follow_after_the_retries(
    coordinator: tuple[FlakyCoordinator, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url = coordinator
    fake.clean_cut, fake.down_for = True, 99
    monkeypatch.setattr(runs_cli, "RECONNECTS", 1)
    async with httpx.AsyncClient(timeout=10) as http:
        api = ServiceClient(http, url)
        with pytest.raises(FleetError) as caught:
            async with asyncio.timeout(20):
                _ = [e async for e in events_of(api, "r1", 0, follow=True, last_seq=0)]
    assert caught.value.code == ErrorCode.DEPENDENCY_UNAVAILABLE
    assert "lost the coordinator's event stream" in caught.value.message
    # a new event restarts the count: after 3-5, one more reconnect (nothing new) and it gives up
    assert fake.cursors == [0, 2, 5] and fake.state_requests == 3


async def test_a_state_check_refused_otherwise_ends_the_follow_at_once(
    coordinator: tuple[FlakyCoordinator, str],
) -> None:
    fake, url = coordinator
    fake.clean_cut, fake.refuse_state = True, True
    async with httpx.AsyncClient(timeout=10) as http:
        api = ServiceClient(http, url)
        with pytest.raises(FleetError) as caught:
            async with asyncio.timeout(20):
                _ = [e async for e in events_of(api, "r1", 0, follow=True, last_seq=0)]
    assert caught.value.code == ErrorCode.UNAUTHENTICATED
    assert fake.cursors == [0] and fake.state_requests == 1  # no retry: retrying cannot help
