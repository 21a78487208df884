"""Every container of compose and Kubernetes runs a real command of a real service, with settings
that its settings class has, that it needs, and that are the same names on both platforms."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from pydantic import AliasChoices

from deploy import keygen
from deploy.local_stack import SERVICES, ServiceSpec, service
from fleet.buskeys import REGISTRY_KEYS, BusKeys
from fleet.settings import ServiceSettings
from fleetctl.cli import _parser as fleet_parser
from tests.deploy._files import (
    ONE_SHOTS,
    Container,
    compose_containers,
    k8s_containers,
    kustomization,
    pod_specs,
)

ALL = [*compose_containers(), *k8s_containers()]
MAIN = [c for c in ALL if not c.sidecar and c.workload not in ONE_SHOTS]
SHELLS = ("sh", "bash", "dash", "ash")


def _served(container: Container) -> str:
    """The service id a main container serves: its command is ``fleet serve ID`` itself, with no
    shell around it (nothing is read or set before the service starts)."""
    argv = container.argv
    assert Path(argv[0]).name not in SHELLS, f"{container.workload}: a shell wrapper: {argv}"
    assert argv[0] == "fleet", f"{container.workload}: the service must be started by the fleet CLI: {argv}"
    args = fleet_parser().parse_args(list(argv[1:]))
    assert args.command == "serve", f"{container.workload}: runs {argv}, not fleet serve"
    return str(args.service_id)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on a bad command line
        raise AssertionError(f"not a valid command line: {argv}") from exc


def settings_class(spec: ServiceSpec) -> type[ServiceSettings]:
    """The settings class a service builds at its entry point: the most derived ServiceSettings
    subclass its entry module holds (ServiceSettings itself when it has none of its own)."""
    module = importlib.import_module(spec.entry.partition(":")[0])
    found = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, ServiceSettings)]
    best: type[ServiceSettings] = ServiceSettings
    for cls in found:
        if issubclass(cls, best):
            best = cls
        elif not issubclass(best, cls):
            raise AssertionError(f"{spec.entry}: two unrelated settings classes, {best} and {cls}")
    return best


def env_names(cls: type[ServiceSettings]) -> set[str]:
    names: set[str] = set()
    for name, info in cls.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(str(choice).upper() for choice in alias.choices if str(choice).isupper())
        else:
            names.add(f"FLEET_{name.upper()}")
    return names


def needed(spec: ServiceSpec, env: dict[str, str]) -> set[str]:
    """What the service cannot start (or be reached) without, beyond its settings' required fields."""
    cls = settings_class(spec)
    required = {f"FLEET_{n.upper()}" for n, f in cls.model_fields.items() if f.is_required()}
    out = (required - {"FLEET_SERVICE_ID"}) | {"FLEET_NATS_URL", "FLEET_HOST", "FLEET_PORT", "FLEET_HOME"}
    out.add("FLEET_OPERATOR_JWK_FILE")  # every verifier pins the operator's key (fleet.issuer_certs)
    out |= {"FLEET_TLS_CA_FILE", "FLEET_TLS_CERT_FILE", "FLEET_TLS_KEY_FILE"}  # every hop is TLS
    if spec.kind == "registry":  # it signs its tokens with a certified key; it is the bus's authority
        out |= {"FLEET_ISSUER_CERT_FILE", "FLEET_NATS_KEYS_DIR"}
    else:
        out.add("FLEET_REGISTRY_URL")
    if spec.database:
        out.add("FLEET_PG_DSN")
    if env.get("FLEET_POLICY_ENGINE") == "opa":
        out.add("FLEET_OPA_URL")
    if env.get("FLEET_MEMORY_STORE") == "qdrant":
        out.add("FLEET_MEMORY_QDRANT_URL")
    return out


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_every_service_container_runs_fleet_serve_of_a_known_service_without_a_token(
    container: Container,
) -> None:
    service(_served(container))  # KeyError: not a service of the stack
    assert "FLEET_ENROLLMENT_TOKEN" not in container.env, "services are enrolled by the enroll one-shot"


def test_a_command_that_is_not_fleet_serve_is_refused() -> None:
    with pytest.raises(AssertionError):
        _served(Container("k8s", "x", "x", ("fleet", "status"), {}))
    with pytest.raises(AssertionError):
        _served(Container("k8s", "x", "x", ("/bin/sh", "-c", "exec fleet serve registry"), {}))
    with pytest.raises(SystemExit):
        fleet_parser().parse_args(["serve"])  # no service id: argparse refuses it


def test_every_service_of_the_stack_is_deployed_by_compose_and_by_kubernetes() -> None:
    by_platform: dict[str, set[str]] = {"compose": set(), "k8s": set()}
    for container in MAIN:
        by_platform[container.platform].add(_served(container))
    assert by_platform["compose"] == {spec.id for spec in SERVICES}
    # Kubernetes runs the workers as one autoscaled Deployment whose pods are all worker-1.
    expected_k8s = {spec.id for spec in SERVICES if spec.kind != "worker"} | {keygen.WORKER_ID}
    assert by_platform["k8s"] == expected_k8s
    assert service(keygen.WORKER_ID).kind == "worker"


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_every_fleet_variable_is_a_setting_of_the_service(container: Container) -> None:
    spec = service(_served(container))
    unknown = container.fleet_vars - env_names(settings_class(spec))
    assert unknown == set(), (
        f"{container.workload} sets {sorted(unknown)}, which {settings_class(spec)} lacks"
    )


def test_a_misspelt_setting_is_caught() -> None:
    assert "FLEET_NATS_REPLICA" not in env_names(ServiceSettings)
    assert {"FLEET_NATS_REPLICAS", "FLEET_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"} <= env_names(
        ServiceSettings
    )


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_every_service_gets_what_it_needs(container: Container) -> None:
    spec = service(_served(container))
    missing = needed(spec, container.env) - container.fleet_vars
    assert missing == set(), f"{container.workload} lacks {sorted(missing)}"
    assert container.env["FLEET_HOST"] == "0.0.0.0", "a container must listen beyond its loopback"


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_the_settings_parse(container: Container, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = service(_served(container))
    for name in [n for n in os.environ if n.startswith("FLEET_")]:
        monkeypatch.delenv(name)
    for name, value in container.env.items():
        monkeypatch.setenv(name, value)
    settings = settings_class(spec).from_env(spec.id)  # a wrong type or choice raises here
    assert settings.port == 8080


def test_compose_and_kubernetes_give_each_service_the_same_fleet_variables() -> None:
    names: dict[tuple[str, str], set[str]] = {}
    for container in MAIN:
        names[(container.platform, _served(container))] = container.fleet_vars
    for spec in SERVICES:
        k8s_id = keygen.WORKER_ID if spec.kind == "worker" else spec.id
        compose_vars, k8s_vars = names[("compose", spec.id)], names[("k8s", k8s_id)]
        assert compose_vars == k8s_vars, f"{spec.id}: {sorted(compose_vars ^ k8s_vars)} differ"


def test_kubernetes_services_replicate_every_stream_on_the_three_nats_nodes() -> None:
    for container in (c for c in MAIN if c.platform == "k8s"):
        assert container.env["FLEET_NATS_REPLICAS"] == "3", container.workload
        assert container.env["FLEET_NATS_URL"].count("tls://") == 3, container.workload
    for container in (c for c in MAIN if c.platform == "compose"):
        assert container.env["FLEET_NATS_REPLICAS"] == "1", container.workload  # one NATS server


def test_kubernetes_env_references_only_variables_defined_before() -> None:
    for container in (c for c in ALL if c.platform == "k8s"):
        defined: set[str] = set()
        for item in container.doc.get("env", []):
            for ref in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", str(item.get("value", ""))):
                assert ref in defined, f"{container.workload}: {item['name']} uses $({ref}) before it is set"
            defined.add(item["name"])


def _one_shot(platform: str, name: str) -> tuple[Container, argparse.Namespace]:
    (container,) = [c for c in ALL if c.platform == platform and c.workload == name]
    assert container.argv[:3] == ("python", "-m", "deploy.keygen"), container.argv
    return container, _parse(keygen.parser(), list(container.argv[3:]))


def _mounts(container: Container) -> dict[str, str]:
    """Where each volume is mounted in ``container`` (by volume name in Kubernetes, by the
    secrets volume's subpath in compose)."""
    if container.platform == "k8s":
        return {m["name"]: m["mountPath"] for m in container.doc["volumeMounts"]}
    return {
        m.get("volume", {}).get("subpath", m["source"]): m["target"]
        for m in container.doc["volumes"]
        if m["type"] == "volume"
    }


@pytest.mark.parametrize(
    ("platform", "operator", "public"),
    [("k8s", "operator-key", "public-keys"), ("compose", "operator", "public")],
)
def test_the_enroll_one_shot_enrolls_the_public_keys_it_mounts_at_the_registry(
    platform: str, operator: str, public: str
) -> None:
    container, args = _one_shot(platform, "enroll")
    assert args.command == "enroll"
    assert args.registry == "https://registry:8080"
    mounts = _mounts(container)
    assert str(args.operator_key.parent) == mounts[operator]
    assert str(args.public_keys) == mounts[public]


def test_the_enroll_job_gets_the_public_key_of_every_identity_kubernetes_runs_and_no_private_one() -> None:
    (generator,) = [g for g in kustomization()["configMapGenerator"] if g["name"] == "fleet-public-keys"]
    names = {entry.split("=", 1)[0] for entry in generator["files"]}
    enrolling = {_served(c) for c in MAIN if c.platform == "k8s"} - {"registry"}
    assert names == {f"{service_id}.jwk.json" for service_id in enrolling}
    (job,) = [spec for name, _, spec in pod_specs() if name == "enroll"]
    secrets = {v["secret"]["secretName"] for v in job["volumes"] if "secret" in v}
    assert secrets == {"fleet-operator-key"}, "no service's private key"


def test_the_enroll_one_shot_reads_the_keys_keygen_writes(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path)
    written = {p.name.removesuffix(".jwk.json") for p in layout.public.glob("*.jwk.json")}
    assert written == {s.id for s in SERVICES if s.kind != "registry"}
    container, args = _one_shot("compose", "enroll")
    mounts = _mounts(container)  # the secrets volume's subpath: where it is mounted
    assert mounts[str(layout.public.relative_to(tmp_path))] == str(args.public_keys)
    assert mounts[str(layout.operator_key.parent.relative_to(tmp_path))] == str(args.operator_key.parent)
    assert args.operator_key.name == layout.operator_key.name


def test_the_compose_keygen_writes_the_secrets_each_service_mounts_its_own_folder_of() -> None:
    _, args = _one_shot("compose", "keygen")
    assert args.command == "secrets"
    assert Path(str(args.dir)).is_absolute()
    for container in (c for c in MAIN if c.platform == "compose"):
        service_id = _served(container)
        (mount,) = [v for v in container.doc["volumes"] if v["target"] == "/run/fleet/identity"]
        assert mount["read_only"] is True
        assert mount["volume"]["subpath"] == f"identities/{service_id}"  # its own key, no one else's


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_every_hop_is_tls(container: Container) -> None:
    urls = {name: value for name, value in container.env.items() if "://" in value}
    for url in container.env["FLEET_NATS_URL"].split(","):
        assert url.startswith("tls://"), (container.workload, url)
    for name, value in urls.items():
        if name in ("FLEET_NATS_URL", "FLEET_OPA_URL", "FLEET_MEMORY_QDRANT_URL"):
            continue  # NATS above; OPA and Qdrant are not fleet services (docs/deployment.md)
        assert value.startswith("https://"), (container.workload, name, value)
    assert container.env["SSL_CERT_FILE"].startswith(str(Path(container.env["FLEET_TLS_CA_FILE"]).parent))
    assert "FLEET_NATS_KEYS_DIR" not in container.env or _served(container) == "registry"


def _mount_of(container: Container, path: str) -> tuple[str, str]:
    """(what is mounted, where) for the mount holding ``path``: a compose subpath of the secrets
    volume, or a Kubernetes Secret or ConfigMap name."""
    if container.platform == "compose":
        for mount in container.doc["volumes"]:
            if path.startswith(mount["target"] + "/"):
                return mount.get("volume", {}).get("subpath", ""), mount["target"]
        raise AssertionError(f"{container.workload}: nothing mounted at {path}")
    (spec,) = [s for name, _, s in pod_specs() if name == container.workload]
    volumes = {
        v["name"]: v.get("secret", {}).get("secretName") or v.get("configMap", {}).get("name")
        for v in spec["volumes"]
    }
    for mount in container.doc["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            return str(volumes[mount["name"]]), mount["mountPath"]
    raise AssertionError(f"{container.workload}: nothing mounted at {path}")


def _files_of(platform: str, source: str, root: Path) -> dict[str, Path]:
    """The files a mount of ``source`` shows (by name), from what keygen wrote under ``root``."""
    if platform == "compose":
        return {p.name: p for p in (root / source).iterdir() if p.is_file()}
    base = kustomization()
    (generator,) = [g for g in base["secretGenerator"] + base["configMapGenerator"] if g["name"] == source]
    return {key: root.parent / relative for key, relative in (e.split("=", 1) for e in generator["files"])}


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_each_service_serves_a_certificate_for_its_name_from_the_ca_it_and_everyone_trusts(
    container: Container, tmp_path: Path
) -> None:
    root = tmp_path / "secrets"
    keygen.make_secrets(root)
    found: dict[str, Path] = {}
    for variable in ("FLEET_TLS_CERT_FILE", "FLEET_TLS_KEY_FILE", "FLEET_TLS_CA_FILE", "SSL_CERT_FILE"):
        source, target = _mount_of(container, container.env[variable])
        files = _files_of(container.platform, source, root)
        name = container.env[variable].removeprefix(target + "/")
        assert name in files, (container.workload, variable)
        found[variable] = files[name]
    cert = x509.load_pem_x509_certificate(found["FLEET_TLS_CERT_FILE"].read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    host = re.sub(r"^https://([^:/]+).*", r"\1", container.env["FLEET_PUBLIC_URL"])
    if host != "$(POD_IP)":  # a Kubernetes worker: nobody calls it
        assert host in names.get_values_for_type(x509.DNSName), (container.workload, host)
    ca = x509.load_pem_x509_certificate(found["FLEET_TLS_CA_FILE"].read_bytes())
    cert.verify_directly_issued_by(ca)
    assert found["SSL_CERT_FILE"].read_text().startswith(found["FLEET_TLS_CA_FILE"].read_text())
    key = serialization.load_pem_private_key(found["FLEET_TLS_KEY_FILE"].read_bytes(), password=None)
    assert key.public_key() == cert.public_key()


def test_the_nats_certificate_names_every_server_the_services_dial(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path)
    cert = x509.load_pem_x509_certificate((layout.nats / "server.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    hosts = {
        re.sub(r"^tls://([^:]+):\d+$", r"\1", url) for c in MAIN for url in c.env["FLEET_NATS_URL"].split(",")
    }
    assert hosts == {"nats", "nats-0.nats", "nats-1.nats", "nats-2.nats"}
    assert hosts <= set(dns)


@pytest.mark.parametrize("platform", ["k8s", "compose"])
def test_the_registry_holds_the_callout_seeds_where_its_keys_dir_points(
    platform: str, tmp_path: Path
) -> None:
    root = tmp_path / "secrets"
    keygen.make_secrets(root)
    (registry,) = [c for c in MAIN if c.platform == platform and _served(c) == "registry"]
    keys_dir = registry.env["FLEET_NATS_KEYS_DIR"]
    source, target = _mount_of(registry, keys_dir + "/x")
    files = _files_of(platform, source, root)
    assert keys_dir == target
    assert {f"{name}.nk" for name in REGISTRY_KEYS} <= set(files)
    assert "admin.nk" not in files
    (folder,) = {files[f"{name}.nk"].parent for name in REGISTRY_KEYS}
    assert set(BusKeys.load(folder, *REGISTRY_KEYS)) == set(REGISTRY_KEYS)  # seeds that load


@pytest.mark.parametrize("platform", ["k8s", "compose"])
def test_the_bootstrap_one_shot_provisions_the_services_nats_with_the_admin_seed_it_mounts(
    platform: str, tmp_path: Path
) -> None:
    root = tmp_path / "secrets"
    keygen.make_secrets(root)
    container, args = _one_shot(platform, "bootstrap")
    assert args.command == "provision"
    services = [c for c in MAIN if c.platform == platform]
    assert {args.nats} == {c.env["FLEET_NATS_URL"] for c in services}
    assert {str(args.replicas)} == {c.env["FLEET_NATS_REPLICAS"] for c in services}
    assert {str(args.tls_ca)} == {c.env["FLEET_TLS_CA_FILE"] for c in services}
    source, target = _mount_of(container, str(args.keys) + "/admin.nk")
    assert str(args.keys) == target and "admin.nk" in _files_of(platform, source, root)
    _mount_of(container, str(args.tls_ca))  # the CA is mounted too
