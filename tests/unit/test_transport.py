"""Credentials cross plain HTTP only on loopback (``fleet.transport``): a real listener on this
machine's own non-loopback address sees no request that carried one."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import httpx2
import pytest

from fleet import transport
from fleet.errors import ErrorCode, FleetError
from fleet.settings import ServiceSettings


def _own_address() -> str:
    """This machine's address on its default route (not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 9))  # no packet is sent: this only picks the route
        address: str = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no address besides loopback")
    return address


class _Listener:
    """A bare HTTP server that counts the requests it was sent."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.requests.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()


@pytest.fixture
async def listener() -> AsyncIterator[tuple[_Listener, str]]:
    address = _own_address()
    seen = _Listener()
    server = await asyncio.start_server(seen.handle, address, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield seen, f"http://{address}:{port}"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("api.localhost", True),
        ("10.0.0.5", False),
        ("registry", False),
        ("127.0.0.1.nip.io", False),
        ("localhost.evil.example", False),
        ("", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert transport.is_loopback(host) is loopback


async def test_a_token_is_not_sent_over_plain_http_to_another_host(
    listener: tuple[_Listener, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(transport.ALLOW_ENV, raising=False)
    seen, url = listener
    async with httpx.AsyncClient(event_hooks=transport.hooks()) as http:
        with pytest.raises(FleetError) as refused:
            await http.get(url + "/v1/tools", headers={"Authorization": "Bearer secret-token"})
        assert refused.value.code == ErrorCode.INSECURE_TRANSPORT
        with pytest.raises(FleetError):
            await http.get(url, headers={"Cookie": "fleet_session=s"})
        # without a credential the same URL is fine: only credentials are held back
        assert (await http.get(url)).status_code == 200
    async with httpx2.AsyncClient(event_hooks=transport.hooks2()) as http2:
        with pytest.raises(FleetError):
            await http2.post(url, headers={"authorization": "Bearer secret-token"}, json={})
    assert len(seen.requests) == 1
    assert b"secret-token" not in b"".join(seen.requests)


async def test_a_token_added_by_an_auth_flow_is_seen(listener: tuple[_Listener, str]) -> None:
    """The MCP client's bearer is set by an ``Auth`` flow (``specialists.kit._server._ContextBearer``), after
    the request was built: the check runs on the request as sent."""
    seen, url = listener

    class Bearer(httpx2.Auth):
        def auth_flow(self, request: httpx2.Request) -> Iterator[httpx2.Request]:
            request.headers["Authorization"] = "Bearer secret-token"
            yield request

    async with httpx2.AsyncClient(auth=Bearer(), event_hooks=transport.hooks2()) as http2:
        with pytest.raises(FleetError):
            await http2.post(url + "/mcp", json={})
    assert seen.requests == []


async def test_loopback_and_the_opt_out(
    listener: tuple[_Listener, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen, url = listener
    monkeypatch.setenv(transport.ALLOW_ENV, "true")
    async with httpx.AsyncClient(event_hooks=transport.hooks()) as http:
        assert (await http.get(url, headers={"Authorization": "Bearer t"})).status_code == 200
    assert len(seen.requests) == 1


def test_settings_refuse_a_plain_remote_registry() -> None:
    base = {"service_id": "x", "key_file": "k", "public_url": "https://x"}
    with pytest.raises(ValueError, match="FLEET_REGISTRY_URL"):
        ServiceSettings(**base, registry_url="http://registry:8080")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FLEET_LLM_BASE_URL"):
        ServiceSettings(**base, llm_base_url="http://gpu-box:8000/v1", llm_api_key="sk-1")  # type: ignore[arg-type]
    # a keyless model endpoint, loopback, HTTPS, or the explicit opt-out are accepted
    ServiceSettings(**base, llm_base_url="http://gpu-box:8000/v1")  # type: ignore[arg-type]
    ServiceSettings(**base, registry_url="http://127.0.0.1:8701")  # type: ignore[arg-type]
    ServiceSettings(**base, registry_url="https://registry:8080")  # type: ignore[arg-type]
    ServiceSettings(**base, registry_url="http://registry:8080", allow_plain_http=True)  # type: ignore[arg-type]
