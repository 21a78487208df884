"""Enrollment as a deployment does it (docs/deployment.md): every identity's key is enrolled once,
from outside, by ``python -m deploy.keygen enroll``; services start with no enrollment token and
only check that the registry knows the key they hold. Real processes on the shared stack: a second
console (it registers nothing, so the stack's own console is left as it is) started without a
token, with its enrolled key and with a key the registry has never seen; and the enroll command
against the stack's registry, for an identity no process of the stack runs."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.local_stack import OPERATOR_ID
from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.settings import ServiceSettings
from fleetctl.testing.e2e import Stack
from registry.client import RegistryClient

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def console_env(stack: Stack, key_file: Path) -> tuple[dict[str, str], str]:
    """The settings of the stack's console process, for another console process on a port of its
    own that holds ``key_file`` and has no enrollment token (as a deployed service); its URL."""
    env = {**os.environ, **stack.layout.read_service_env("console")}  # neither its socket nor its token
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env.update(
        FLEET_KEY_FILE=str(key_file), FLEET_HOST="127.0.0.1", FLEET_PORT=str(port), FLEET_PUBLIC_URL=url
    )
    return env, url


@pytest.fixture
def consoles(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Consoles the test starts (stopped at its end), their output in ``tmp_path/console.log``."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)


def start_console(
    started: list[subprocess.Popen[bytes]], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child keeps its copy
        process = subprocess.Popen(
            [sys.executable, "-m", "fleetctl", "serve", "console"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    started.append(process)
    return process


async def healthz_until_ready(url: str, process: subprocess.Popen[bytes]) -> int:
    """Poll ``/healthz`` until it answers 200 (the service joined) or the process exits; the status."""
    async with asyncio.timeout(START_TIMEOUT_S), httpx.AsyncClient(timeout=5) as http:
        while process.poll() is None:
            try:
                status = (await http.get(url + "/healthz")).status_code
            except httpx.TransportError:
                status = 0
            if status == 200:
                return status
            await asyncio.sleep(0.1)
    return -1


async def test_a_service_started_again_without_a_token_joins_with_its_enrolled_key(
    stack: Stack, consoles: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    env, url = console_env(stack, stack.layout.key_file("console"))
    process = start_console(consoles, env, tmp_path / "console.log")
    assert await healthz_until_ready(url, process) == 200, (tmp_path / "console.log").read_text()[-3000:]


async def test_a_service_without_a_token_whose_key_is_not_enrolled_stops_with_a_clear_error(
    stack: Stack, consoles: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    key_file = tmp_path / "unenrolled.pem"
    kid = SigningKey.load_or_create(key_file).kid
    env, url = console_env(stack, key_file)
    process = start_console(consoles, env, tmp_path / "console.log")
    assert await healthz_until_ready(url, process) == -1, "it must not come up"
    await asyncio.to_thread(process.wait, START_TIMEOUT_S)
    log = (tmp_path / "console.log").read_text()
    assert f"identity console is not enrolled with this key (kid {kid}" in log, log[-3000:]
    assert "python -m deploy.keygen enroll" in log
    # Nothing was enrolled: the stack's console still holds the key the registry knows.
    async with httpx.AsyncClient() as http:
        await _registry_client(stack, "console", stack.layout.key_file("console"), http).check_enrolled()


def _registry_client(
    stack: Stack, service_id: str, key_file: Path, http: httpx.AsyncClient
) -> RegistryClient:
    settings = ServiceSettings(
        service_id=service_id,
        key_file=key_file,
        public_url="http://127.0.0.1:9",
        registry_url=stack.endpoints["registry"],
    )
    return RegistryClient(settings, http)


def keygen_enroll(stack: Stack, public_keys: Path) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "deploy.keygen", "enroll", "--registry", stack.endpoints["registry"],
        "--operator-key", str(stack.layout.key_file(OPERATOR_ID)), "--public-keys", str(public_keys),
        "--wait", "30",
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


async def test_keygen_enroll_enrolls_each_public_key_and_running_it_again_changes_nothing(
    stack: Stack, tmp_path: Path
) -> None:
    key_file = tmp_path / "worker-3.pem"  # worker-3: known to the stack definition, run by no process
    key = SigningKey.load_or_create(key_file)
    public_keys = tmp_path / "public"
    public_keys.mkdir()
    (public_keys / "worker-3.jwk.json").write_text(json.dumps(key.public_jwk()))
    async with httpx.AsyncClient() as http:
        client = _registry_client(stack, "worker-3", key_file, http)
        with pytest.raises(FleetError) as refused:
            await client.check_enrolled()
        assert refused.value.code == ErrorCode.UNAUTHENTICATED
        for _ in range(2):  # a Job run again: the same key stays enrolled
            result = keygen_enroll(stack, public_keys)
            assert result.returncode == 0, result.stderr
            assert f"enrolled worker-3 ({key.kid})" in result.stdout
            await _registry_client(stack, "worker-3", key_file, http).check_enrolled()
