"""Request body caps (``fleet.bodylimit``) and A2A parse errors, attacked over real sockets against
the real stack: every HTTP surface refuses a body over its cap with 413 ``body_too_large`` before
reading it, cuts a chunked body without a length at the cap, and keeps serving other callers."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx
import pytest

from fleet.a2a_support import RPC_PATH
from fleet.bodylimit import DRAIN_BYTES
from fleetctl.testing.e2e import Stack
from fleetctl.testing.mcp import logged

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
CAP = MIB  # FLEET_MAX_BODY_BYTES, the default
MCP_CAP = 4 * MIB  # FLEET_MAX_MCP_BODY_BYTES, the default
TASK_NOT_FOUND = -32001


def _specialist(stack: Stack) -> str:
    first: str = sorted(stack.endpoints["specialists"])[0]
    return first


def _surface(stack: Stack, name: str) -> tuple[str, int, bool]:
    """The URL of surface ``name``, its cap, and whether it answers JSON-RPC."""
    coordinator, registry = stack.endpoints["coordinator"], stack.endpoints["registry"]
    surfaces = {
        "coordinator-a2a": (coordinator + RPC_PATH, CAP, True),
        "run-api": (coordinator + "/v1/runs/r-1/signals", CAP, False),
        "registry-enroll": (registry + "/v1/enroll", CAP, False),
        "registry-keys": (registry + "/v1/identities/sql-analyst/keys", CAP, False),
        "console": (stack.endpoints["console"] + "/session", CAP, False),
        "specialist-a2a": (stack.endpoints["specialists"][_specialist(stack)] + RPC_PATH, CAP, True),
        "mcp": (stack.endpoints["mcp_servers"]["mcp-sql"], MCP_CAP, True),
    }
    return surfaces[name]


def _assert_refused(status: int, body: bytes, jsonrpc: bool, cap: int) -> None:
    assert status == 413, body[:300]
    answer = json.loads(body)
    if jsonrpc:
        assert answer["jsonrpc"] == "2.0" and answer["id"] is None
        error = answer["error"]["data"]
        assert answer["error"]["code"] == -32600
    else:  # RFC 9457 problem details, the envelope in "error"
        assert answer["status"] == 413 and answer["type"].endswith(":body_too_large")
        error = answer["error"]
    assert error["code"] == "body_too_large"
    assert error["details"]["max_bytes"] == cap


def _rpc(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "A2A-Version": "1.0"}


SURFACES = [
    "coordinator-a2a",
    "run-api",
    "registry-enroll",
    "registry-keys",
    "console",
    "specialist-a2a",
    "mcp",
]


@pytest.mark.parametrize("surface", SURFACES)
async def test_a_body_declared_over_the_cap_is_refused_413_without_credentials(
    stack: Stack, surface: str
) -> None:
    url, cap, jsonrpc = _surface(stack, surface)
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            url, content=b"x" * (cap + 1), headers={"Content-Type": "application/json"}
        )
    _assert_refused(response.status_code, response.content, jsonrpc, cap)


async def test_a_body_of_exactly_the_cap_reaches_the_registry(stack: Stack) -> None:
    body = json.dumps({"pad": ""}).encode()
    body = json.dumps({"pad": "x" * (CAP - len(body))}).encode()
    assert len(body) == CAP
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(stack.endpoints["registry"] + "/v1/enroll", content=body)
    assert response.status_code != 413, response.text
    assert response.json()["error"]["code"] != "body_too_large"


async def _post_endless_chunked(
    url: str, headers: dict[str, str], give_up_after: int
) -> tuple[int, bytes, int]:
    """POST a chunked body that does not end (until ``give_up_after`` bytes are sent): the status
    and body of the answer, and how many body bytes were sent when it came."""
    target = httpx.URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    head = [f"POST {target.raw_path.decode()} HTTP/1.1", f"Host: {target.host}:{target.port}"]
    head += ["Content-Type: application/json", "Transfer-Encoding: chunked"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    chunk = b"[" * 65536
    sent = 0
    try:
        async with asyncio.TaskGroup() as group:
            answer = group.create_task(_read_response(reader))
            while not answer.done() and sent < give_up_after:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                sent += len(chunk)
                # drain() does not yield while the kernel takes the bytes: let the answer be read.
                await asyncio.sleep(0)
            async with asyncio.timeout(10):  # no answer by now: the server waits for the end
                status, body = await answer
    finally:
        writer.close()
    return status, body, sent


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
    length = int(next(v for k, v in fields.items() if k.lower() == "content-length"))
    return int(head[0].split()[1]), await reader.readexactly(length)


@pytest.mark.parametrize("surface", ["coordinator-a2a", "run-api", "registry-enroll"])
async def test_a_chunked_body_without_a_length_is_cut_at_the_cap(stack: Stack, surface: str) -> None:
    url, cap, jsonrpc = _surface(stack, surface)
    # The registry reads the body before it authenticates; the coordinator's routes want a token first.
    headers = {} if surface.startswith("registry") else _bearer(stack.token("coordinator"))
    service = "registry" if surface.startswith("registry") else "coordinator"
    offset = _log_size(stack, service)
    status, body, sent = await _post_endless_chunked(url, headers, give_up_after=64 * MIB)
    _assert_refused(status, body, jsonrpc, cap)
    assert sent < 64 * MIB  # answered while the body was still coming: it was not read to the end
    # The refusal names who sent it (the coordinator verified the token before the body was read).
    who = "principal=-" if service == "registry" else "principal=acme/operator"
    await logged(stack, service, "body_too_large", who)
    assert "BodyTooLarge" not in _log_since(stack, service, offset)  # no stack trace of the cut


async def _send_until_closed(url: str, headers: dict[str, str], give_up_after: int) -> int:
    """Send a body without reading any answer until the server stops taking it (it closed the
    connection) or ``give_up_after`` bytes are sent: how many bytes the server took."""
    target = httpx.URL(url)
    _reader, writer = await asyncio.open_connection(target.host, target.port)
    head = [f"POST {target.raw_path.decode()} HTTP/1.1", f"Host: {target.host}:{target.port}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
    chunked = "Transfer-Encoding" in headers
    piece = b"x" * 65536
    data = b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece
    sent = 0
    try:
        async with asyncio.timeout(60):
            while sent < give_up_after:
                writer.write(data)
                await writer.drain()
                sent += len(piece)
                await asyncio.sleep(0)
    except (ConnectionError, OSError):
        pass  # closed by the server
    finally:
        writer.close()
    return sent


@pytest.mark.parametrize(
    "framing",
    [{"Transfer-Encoding": "chunked"}, {"Content-Length": str(10**15)}],
    ids=["chunked-without-end", "declared-petabyte"],
)
async def test_a_refused_body_is_not_read_past_the_drain_before_the_connection_closes(
    stack: Stack, framing: dict[str, str]
) -> None:
    """After the 413 the server reads what comes of the body only up to its drain (16 MiB); it
    does not go on parsing and discarding a body that never ends, at whatever rate the caller sends."""
    url, cap, _ = _surface(stack, "coordinator-a2a")
    headers = {**_bearer(stack.token("coordinator")), "Content-Type": "application/json", **framing}
    taken = await _send_until_closed(url, headers, give_up_after=256 * MIB)
    # What the server took: the cap, the drain, and what the two kernels' socket buffers hold.
    assert taken < cap + DRAIN_BYTES + 32 * MIB, taken


async def test_a_10_mb_a2a_body_is_refused_413_while_the_coordinator_keeps_answering_others(
    stack: Stack,
) -> None:
    url = stack.endpoints["coordinator"] + RPC_PATH
    attacker, other = (
        _bearer(stack.token("coordinator")),
        _bearer(stack.token("coordinator", tenant="globex")),
    )
    attack = json.dumps(_rpc("GetTask", {"id": "x" * (10 * 1000 * 1000)})).encode()
    probe = _rpc("GetTask", {"id": "no-such-task"})
    stop, refusals = asyncio.Event(), []

    async def one_call(http: httpx.AsyncClient) -> float:
        started = time.perf_counter()
        response = await http.post(url, json=probe, headers=other)
        assert response.status_code == 200
        assert response.json()["error"]["code"] == TASK_NOT_FOUND
        return time.perf_counter() - started

    async def flood() -> None:
        async with httpx.AsyncClient(timeout=120) as own:
            while not stop.is_set():
                response = await own.post(url, content=attack, headers=attacker)
                refusals.append((response.status_code, response.content))

    async with httpx.AsyncClient(timeout=60) as http:
        before = [await one_call(http) for _ in range(10)]
        async with asyncio.TaskGroup() as group:
            for _ in range(4):
                group.create_task(flood())
            during = [await one_call(http) for _ in range(20)]
            stop.set()
    print(
        f"\nother client's latency: before {statistics.median(before) * 1000:.1f} ms (median),"
        f" during {statistics.median(during) * 1000:.1f} ms (median), {max(during) * 1000:.1f} ms (max);"
        f" {len(refusals)} refusals of 10 MB"
    )
    assert len(refusals) >= 4
    for status, body in refusals:
        _assert_refused(status, body, True, CAP)
    assert statistics.median(during) < 50 * statistics.median(before) + 1.0
    assert max(during) < 15.0


NOT_UTF8_JSON = {
    "binary": bytes(range(256)) * 4,
    "invalid-utf8": b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "\xff\xfe"}}',
    "truncated": b'{"jsonrpc": "2.0", "id": 1, "method": "GetT',
    "too-deep": b"[" * 100_000,
    "utf16": json.dumps(_rpc("GetTask", {"id": "t"})).encode("utf-16"),
}


def _assert_no_sdk_traceback(log: str) -> None:
    """No error or stack trace of the a2a-sdk's dispatcher (other parts of a loaded stack may log
    their own, e.g. a NATS fetch timing out)."""
    assert "jsonrpc_dispatcher.py" not in log and " ERROR a2a." not in log, log


def _log_size(stack: Stack, service: str) -> int:
    return stack.layout.log_file(service).stat().st_size


def _log_since(stack: Stack, service: str, offset: int) -> str:
    return stack.layout.log_file(service).read_bytes()[offset:].decode(errors="replace")


@pytest.mark.parametrize("agent", ["coordinator", "specialist"])
@pytest.mark.parametrize("kind", sorted(NOT_UTF8_JSON))
async def test_an_a2a_body_that_is_not_utf8_json_is_a_parse_error_without_a_traceback(
    stack: Stack, agent: str, kind: str
) -> None:
    service = "coordinator" if agent == "coordinator" else _specialist(stack)
    base = (
        stack.endpoints["coordinator"] if agent == "coordinator" else stack.endpoints["specialists"][service]
    )
    offset = _log_size(stack, service)
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            base + RPC_PATH, content=NOT_UTF8_JSON[kind], headers=_bearer(stack.token(service))
        )
    assert response.status_code == 200
    answer = response.json()
    assert answer["id"] is None
    assert answer["error"]["code"] == -32700, answer
    assert "Traceback" not in response.text
    await logged(stack, service, "A2A request refused (-32700")
    _assert_no_sdk_traceback(_log_since(stack, service, offset))


@pytest.mark.parametrize("body", [b"5", b'"text"', b"null", b"[]"])
async def test_a2a_json_that_is_not_an_object_is_an_invalid_request_without_a_traceback(
    stack: Stack, body: bytes
) -> None:
    offset = _log_size(stack, "coordinator")
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            stack.endpoints["coordinator"] + RPC_PATH,
            content=body,
            headers=_bearer(stack.token("coordinator")),
        )
    answer = response.json()
    assert answer["id"] is None and answer["error"]["code"] == -32600, answer
    await logged(stack, "coordinator", "A2A request refused (-32600")
    _assert_no_sdk_traceback(_log_since(stack, "coordinator", offset))


INVALID_REQUESTS = {
    "no-method": (b'{"jsonrpc": "2.0", "id": 7}', 7, -32600),
    "empty": (b"{}", None, -32600),
    "bad-params": (json.dumps(_rpc("GetTask", {"id": {"not": "a string"}})).encode(), 1, -32602),
}


@pytest.mark.parametrize("kind", sorted(INVALID_REQUESTS))
async def test_an_invalid_a2a_request_is_refused_without_a_stack_trace_in_the_log(
    stack: Stack, kind: str
) -> None:
    body, request_id, code = INVALID_REQUESTS[kind]
    offset = _log_size(stack, "coordinator")
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            stack.endpoints["coordinator"] + RPC_PATH,
            content=body,
            headers=_bearer(stack.token("coordinator")),
        )
    answer = response.json()
    assert answer["id"] == request_id and answer["error"]["code"] == code, answer
    await logged(stack, "coordinator", f"Code={code}")  # the SDK's WARNING with the reason stays
    _assert_no_sdk_traceback(_log_since(stack, "coordinator", offset))


@pytest.mark.parametrize("kind", ["binary", "invalid-utf8", "truncated", "too-deep"])
@pytest.mark.parametrize("surface", ["run-api", "registry-enroll"])
async def test_http_apis_answer_a_body_that_is_not_json_with_400_invalid_request(
    stack: Stack, surface: str, kind: str
) -> None:
    url, _, _ = _surface(stack, surface)
    headers = {} if surface.startswith("registry") else _bearer(stack.token("coordinator"))
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(url, content=NOT_UTF8_JSON[kind], headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"
