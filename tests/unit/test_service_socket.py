"""The socket a service serves on: every connection it accepts has Nagle's algorithm off.

With Nagle on, an HTTP answer written in two parts (uvicorn writes the headers, then the body)
waits for the client's delayed ACK, about 40 ms a request. asyncio turns it off only on
connections accepted from a socket whose ``proto`` says TCP, which a socket made with
``socket.socket(AF_INET, SOCK_STREAM)`` does not (its proto is 0)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from fleet.service import listening_socket
from fleet.settings import ServiceSettings
from fleetctl.supervisor import _bind_loopback
from fleetctl.testing.serving import loopback_socket


async def _nodelay_of_an_accepted_connection(sock: socket.socket) -> int:
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
    try:
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(accepted, 10)
        writer.close()
        return value
    finally:
        server.close()
        await server.wait_closed()


def _own(settings: ServiceSettings) -> socket.socket:
    return listening_socket(settings)


def _passed_down(settings: ServiceSettings) -> socket.socket:
    """As the supervisor does: bind, then hand the descriptor to the service."""
    bound = _bind_loopback(None)
    return listening_socket(settings.model_copy(update={"listen_fd": bound.detach()}))


async def test_every_way_a_service_gets_its_socket_accepts_connections_without_nagle() -> None:
    settings = ServiceSettings(service_id="svc", key_file="k", public_url="https://svc")  # type: ignore[call-arg]
    makers: list[Callable[[], socket.socket]] = [
        lambda: _own(settings),
        lambda: _passed_down(settings),
        lambda: loopback_socket()[0],
    ]
    for make in makers:
        assert await _nodelay_of_an_accepted_connection(make()) == 1


async def test_the_check_would_see_a_socket_that_does_not_say_tcp() -> None:
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # proto 0: the old way
    plain.bind(("127.0.0.1", 0))
    plain.listen(8)
    plain.setblocking(False)
    assert await _nodelay_of_an_accepted_connection(plain) == 0
