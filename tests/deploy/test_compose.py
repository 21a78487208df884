"""deploy/compose.yaml against the Compose Specification's JSON schema (the copy check-jsonschema
vendors: no network needed), and what the schema cannot see."""

from __future__ import annotations

import copy
import posixpath
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deploy import keygen
from deploy._bus import NATS_AUTH_INCLUDE
from fleet.buskeys import REGISTRY_KEYS
from tests.deploy._files import ONE_SHOTS, Doc, compose, compose_errors

FLEET_IMAGE = "agent-fleet:dev"


def errors(document: Doc) -> list[str]:
    return compose_errors(document)


def test_the_compose_file_follows_the_compose_specification() -> None:
    assert errors(compose()) == []


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("services", "registry", "imagee"), FLEET_IMAGE),  # a misspelt key
        (("services", "registry", "ports"), "8701:8080"),  # a list, not a string
        (("services", "registry", "depends_on", "nats", "condition"), "service_ready"),  # no such condition
    ],
)
def test_a_broken_compose_file_fails_the_schema(path: tuple[str, ...], value: object) -> None:
    broken = copy.deepcopy(compose())
    target = broken
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    assert errors(broken) != []


def test_every_dependency_volume_and_network_is_declared() -> None:
    document = compose()
    services, volumes, networks = document["services"], document["volumes"], document["networks"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on {dependency}"
        for mount in service.get("volumes", []):
            if mount["type"] == "volume":
                assert mount["source"] in volumes, f"{name} mounts {mount['source']}"
        for network in service.get("networks", []):
            assert network in networks, f"{name} joins {network}"


def test_the_services_start_in_the_tiers_of_fleet_up() -> None:
    services = compose()["services"]
    assert "registry" in services["mcp-sql"]["depends_on"]
    assert "mcp-sql" in services["sql-analyst"]["depends_on"]
    assert "sql-analyst" in services["coordinator"]["depends_on"]
    assert "coordinator" in services["worker-1"]["depends_on"]
    for name, service in services.items():
        if service.get("image") == FLEET_IMAGE and name != "keygen":
            assert service["depends_on"]["keygen"] == {"condition": "service_completed_successfully"}, name
            assert service["read_only"] is True, name
        if service.get("image") == FLEET_IMAGE and name not in ONE_SHOTS | {"registry"}:
            assert service["depends_on"]["enroll"] == {"condition": "service_completed_successfully"}, name
        if service.get("image") == FLEET_IMAGE and name not in ONE_SHOTS:  # the buckets exist first
            assert service["depends_on"]["bootstrap"] == {"condition": "service_completed_successfully"}, name
    assert services["enroll"]["depends_on"]["registry"] == {"condition": "service_healthy"}
    assert services["bootstrap"]["depends_on"]["nats"] == {"condition": "service_healthy"}
    assert "registry" not in services["bootstrap"]["depends_on"]  # the admin bypasses the callout


def test_only_the_keygen_and_enroll_one_shots_see_the_operator_key() -> None:
    seeing = set()
    for name, service in compose()["services"].items():
        for mount in service.get("volumes", []):
            subpath = mount.get("volume", {}).get("subpath", "")  # "": the whole volume
            if mount.get("source") == "fleet-secrets" and subpath in ("", "operator"):
                seeing.add(name)
    assert seeing == {"keygen", "enroll"}


def test_opa_starts_empty_because_each_engine_pushes_its_own_bundle() -> None:
    opa = compose()["services"]["opa"]
    assert opa["command"][:2] == ["run", "--server"]
    assert "volumes" not in opa
    assert not any(arg.startswith(("--bundle", "/")) for arg in opa["command"])


def _secrets_seen(root: Path) -> dict[str, set[str]]:
    """Which files of the secrets volume (as ``deploy.keygen secrets`` writes it under ``root``)
    each compose service sees, by path in the volume."""
    seen: dict[str, set[str]] = {}
    for name, service in compose()["services"].items():
        for mount in service.get("volumes", []):
            if mount.get("source") != "fleet-secrets":
                continue
            folder = root / mount.get("volume", {}).get("subpath", "")
            found = {p.relative_to(root).as_posix() for p in folder.rglob("*") if p.is_file()}
            seen.setdefault(name, set()).update(found)
    return seen


def _seeing(seen: dict[str, set[str]], file_name: str) -> set[str]:
    return {name for name, paths in seen.items() if any(p.endswith("/" + file_name) for p in paths)}


def test_only_the_bootstrap_one_shot_sees_the_bus_admins_seed(tmp_path: Path) -> None:
    keygen.make_secrets(tmp_path)
    assert _seeing(_secrets_seen(tmp_path), "admin.nk") == {"keygen", "bootstrap"}


def test_only_the_registry_sees_the_callout_seeds_and_only_nats_the_route_password(tmp_path: Path) -> None:
    keygen.make_secrets(tmp_path)
    seen = _secrets_seen(tmp_path)
    for name in REGISTRY_KEYS:
        assert _seeing(seen, f"{name}.nk") == {"keygen", "registry"}, name
    assert _seeing(seen, "cluster.conf") == {"keygen", "nats"}
    assert _seeing(seen, "ca-key.pem") == {"keygen"}  # the CA's key: nobody but its maker


def test_the_compose_nats_includes_the_auth_file_keygen_writes_with_tls_and_the_callout(
    tmp_path: Path,
) -> None:
    document = compose()
    nats = document["services"]["nats"]
    (config,) = nats["configs"]
    content = document["configs"][config["source"]]["content"]
    assert f'include "{NATS_AUTH_INCLUDE}"' in content
    assert nats["command"] == ["--config", config["target"]]
    include = posixpath.normpath(posixpath.join(posixpath.dirname(config["target"]), NATS_AUTH_INCLUDE))
    (auth,) = [m for m in nats["volumes"] if m.get("volume", {}).get("subpath") == "nats"]
    assert include == posixpath.join(auth["target"], "auth.conf")
    layout = keygen.make_secrets(tmp_path)
    text = (layout.nats / "auth.conf").read_text()
    assert "auth_callout {" in text and "tls {" in text and "accounts {" in text
    assert str(posixpath.join(auth["target"], "server.pem")) in text  # where the secret is mounted
    assert "http: 127.0.0.1:" in content, "the monitoring port stays inside the container"


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def _https_server(cert: Path, key: Path) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _probe(service: str, port: int, ca_dir: Path) -> int:
    """The compose health check of ``service``, run here against ``port``, trusting ``ca_dir``."""
    test = compose()["services"][service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    code = test[3].replace(":8080/", f":{port}/").replace("/run/fleet/tls-ca", str(ca_dir))
    assert f":{port}/" in code and str(ca_dir) in code
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode


def test_the_health_check_speaks_https_and_trusts_the_deployment_ca(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path / "ours")
    other = keygen.make_secrets(tmp_path / "other")  # another deployment's CA
    for port in _https_server(layout.tls_cert("registry"), layout.tls_key("registry")):
        assert _probe("registry", port, layout.tls_ca) == 0
        assert _probe("registry", port, other.tls_ca) != 0  # a certificate it does not trust
