"""``fleet up --tls``: the whole stack on a CA it makes in the data dir. NATS takes TLS clients only,
every service answers HTTPS only, with a certificate of that CA, and the demo's night runs over it."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import grpc.aio
import httpx
import nats
import pytest
from a2a.types import GetTaskRequest, a2a_pb2_grpc
from nats.errors import NoServersError

from fleet.a2a_grpc import grpc_target
from fleet.natsconn import connect
from fleetctl.layout import StackLayout, stack_admin
from fleetctl.testing.e2e import Stack, clean_env, fleet, stop_stack

pytestmark = pytest.mark.e2e

DEMO_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("tls") / "fleet"
    result = fleet("up", "--tls", "--data-dir", str(data_dir), "--detach", env=clean_env())
    assert result.returncode == 0, f"fleet up --tls failed:\n{result.stdout}\n{result.stderr}"
    stack = Stack(StackLayout.at(data_dir))
    stack.reload()
    yield stack
    stop_stack(stack)


def _ca(stack: Stack) -> Path:
    return Path(stack.endpoints["tls_ca"])


def _nats_port(stack: Stack) -> int:
    port = urlsplit(stack.endpoints["nats"].split(",")[0]).port
    assert port is not None
    return port


def test_every_service_answers_https_only_with_a_certificate_of_the_stacks_ca(tls_stack: Stack) -> None:
    services: dict[str, str] = tls_stack.endpoints["services"]
    assert services and all(url.startswith("https://127.0.0.1:") for url in services.values()), services
    trusting = ssl.create_default_context(cafile=str(_ca(tls_stack)))
    with httpx.Client(verify=trusting, timeout=10) as http:
        for name, url in services.items():
            assert http.get(url + "/healthz").status_code == 200, name
    # not trusted without the stack's CA: the certificates are the CA's, not a public one's
    with (
        httpx.Client(timeout=10) as http,
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        http.get(services["registry"] + "/healthz")
    # plain HTTP gets no answer at all (so no token could be sent and served over it)
    for name in ("registry", "coordinator"):
        host_port = services[name].removeprefix("https://")
        with httpx.Client(timeout=10) as http, pytest.raises(httpx.HTTPError):
            http.get(f"http://{host_port}/healthz")


async def test_a2a_over_grpc_is_tls_only_on_the_stacks_ca(tls_stack: Stack) -> None:
    """The coordinator's gRPC binding serves TLS with its certificate (its card says https), and a
    call on a plaintext channel gets nowhere."""
    services: dict[str, str] = tls_stack.endpoints["services"]
    trusting = ssl.create_default_context(cafile=str(_ca(tls_stack)))
    async with httpx.AsyncClient(verify=trusting, timeout=10) as http:
        card = (await http.get(services["coordinator"] + "/.well-known/agent-card.json")).json()
    address = next(i["url"] for i in card["supportedInterfaces"] if i["protocolBinding"] == "GRPC")
    assert address.startswith("https://127.0.0.1:"), address
    credentials = grpc.ssl_channel_credentials(root_certificates=_ca(tls_stack).read_bytes())
    async with grpc.aio.secure_channel(grpc_target(address), credentials) as channel:
        stub = a2a_pb2_grpc.A2AServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:  # TLS held: the bearer check answers
            await stub.GetTask(GetTaskRequest(id="nothing"), metadata=(("a2a-version", "1.0"),))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.insecure_channel(grpc_target(address)) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as unreachable:
            await a2a_pb2_grpc.A2AServiceStub(plain).GetTask(
                GetTaskRequest(id="nothing"), metadata=(("a2a-version", "1.0"),), timeout=5
            )
        assert unreachable.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_the_bus_takes_tls_clients_only(tls_stack: Stack) -> None:
    port = _nats_port(tls_stack)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        info = json.loads(conn.recv(65536).decode().split(" ", 1)[1])
        assert info.get("tls_required") is True, info
        # a client that goes on in plain text is dropped before its CONNECT is read
        conn.sendall(b'CONNECT {"verbose":false}\r\nPING\r\n')
        received = b""
        try:
            while chunk := conn.recv(4096):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert b"PONG" not in received


async def test_a_client_must_trust_the_ca_and_present_credentials(tls_stack: Stack) -> None:
    url = f"tls://127.0.0.1:{_nats_port(tls_stack)}"
    # TLS with the system's trust only: the handshake fails before any credential is sent
    with pytest.raises((NoServersError, ssl.SSLError, OSError)):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    # the CA trusted, no credentials: the registry's callout refuses
    anonymous = ssl.create_default_context(cafile=str(_ca(tls_stack)))
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(
            url, tls=anonymous, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5
        )
    # the bootstrap admin over TLS is let in
    client = await connect(
        tls_stack.endpoints["nats"], name="tls-test", credentials=stack_admin(tls_stack.endpoints)
    )
    try:
        assert client.is_connected
        assert client.connected_server_version is not None
    finally:
        await client.close()


def test_the_demo_runs_over_tls(tls_stack: Stack) -> None:
    result = fleet("demo", "--data-dir", tls_stack.data_dir, "--auto-approve", timeout=DEMO_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "globex |" in result.stdout and "completed" in result.stdout
