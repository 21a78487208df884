"""Every container of compose and Kubernetes runs a real command of a real service, with settings
that its settings class has, that it needs, and that are the same names on both platforms."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path

import pytest
from pydantic import AliasChoices

from deploy import keygen
from deploy.local_stack import SERVICES, ServiceSpec, service
from fleet.cli import _parser as fleet_parser
from fleet.settings import ServiceSettings
from tests.deploy._files import (
    WRAPPER_EXEC,
    WRAPPER_PREFIX,
    Container,
    compose_containers,
    k8s_containers,
    served_argv,
)

ALL = [*compose_containers(), *k8s_containers()]
MAIN = [c for c in ALL if not c.sidecar and c.workload != "keygen"]


def _served(container: Container) -> tuple[str, bool]:
    """The service id a main container serves, and whether it reads an enrollment token first."""
    argv, wrapped = served_argv(container.argv)
    assert argv[0] == "fleet", f"{container.workload}: the service must be started by the fleet CLI: {argv}"
    args = fleet_parser().parse_args(list(argv[1:]))
    assert args.command == "serve", f"{container.workload}: runs {argv}, not fleet serve"
    return str(args.service_id), wrapped


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
    out |= {"FLEET_OPERATOR_JWK_FILE"} if spec.kind == "registry" else {"FLEET_REGISTRY_URL"}
    if spec.database:
        out.add("FLEET_PG_DSN")
    if env.get("FLEET_POLICY_ENGINE") == "opa":
        out.add("FLEET_OPA_URL")
    if env.get("FLEET_MEMORY_STORE") == "qdrant":
        out.add("FLEET_MEMORY_QDRANT_URL")
    return out


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_every_service_container_runs_fleet_serve_of_a_known_service(container: Container) -> None:
    service_id, wrapped = _served(container)
    spec = service(service_id)  # KeyError: not a service of the stack
    assert wrapped == (spec.kind != "registry"), "every service but the registry enrolls with a fresh token"


def test_a_command_that_is_not_fleet_serve_is_refused() -> None:
    with pytest.raises(AssertionError):
        _served(Container("k8s", "x", "x", ("fleet", "status"), {}))
    with pytest.raises(AssertionError):
        _served(Container("k8s", "x", "x", ("/bin/sh", "-c", "fleet serve registry; rm -rf /"), {}))
    with pytest.raises(SystemExit):
        fleet_parser().parse_args(["serve"])  # no service id: argparse refuses it


def test_every_service_of_the_stack_is_deployed_by_compose_and_by_kubernetes() -> None:
    by_platform: dict[str, set[str]] = {"compose": set(), "k8s": set()}
    for container in MAIN:
        by_platform[container.platform].add(_served(container)[0])
    assert by_platform["compose"] == {spec.id for spec in SERVICES}
    # Kubernetes runs the workers as one autoscaled Deployment whose pods are all worker-1.
    expected_k8s = {spec.id for spec in SERVICES if spec.kind != "worker"} | {keygen.WORKER_ID}
    assert by_platform["k8s"] == expected_k8s
    assert service(keygen.WORKER_ID).kind == "worker"


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_every_fleet_variable_is_a_setting_of_the_service(container: Container) -> None:
    spec = service(_served(container)[0])
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
    service_id, wrapped = _served(container)
    spec = service(service_id)
    provided = container.fleet_vars | ({"FLEET_ENROLLMENT_TOKEN"} if wrapped else set())
    missing = needed(spec, container.env) - provided
    assert missing == set(), f"{container.workload} lacks {sorted(missing)}"
    assert container.env["FLEET_HOST"] == "0.0.0.0", "a container must listen beyond its loopback"


@pytest.mark.parametrize("container", MAIN, ids=lambda c: f"{c.platform}-{c.workload}")
def test_the_settings_parse(container: Container, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = service(_served(container)[0])
    for name in [n for n in os.environ if n.startswith("FLEET_")]:
        monkeypatch.delenv(name)
    for name, value in container.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FLEET_ENROLLMENT_TOKEN", "token")
    settings = settings_class(spec).from_env(spec.id)  # a wrong type or choice raises here
    assert settings.port == 8080


def test_compose_and_kubernetes_give_each_service_the_same_fleet_variables() -> None:
    names: dict[tuple[str, str], set[str]] = {}
    for container in MAIN:
        names[(container.platform, _served(container)[0])] = container.fleet_vars
    for spec in SERVICES:
        k8s_id = keygen.WORKER_ID if spec.kind == "worker" else spec.id
        compose_vars, k8s_vars = names[("compose", spec.id)], names[("k8s", k8s_id)]
        assert compose_vars == k8s_vars, f"{spec.id}: {sorted(compose_vars ^ k8s_vars)} differ"


def test_kubernetes_services_replicate_every_stream_on_the_three_nats_nodes() -> None:
    for container in (c for c in MAIN if c.platform == "k8s"):
        assert container.env["FLEET_NATS_REPLICAS"] == "3", container.workload
        assert container.env["FLEET_NATS_URL"].count("nats://") == 3, container.workload
    for container in (c for c in MAIN if c.platform == "compose"):
        assert container.env["FLEET_NATS_REPLICAS"] == "1", container.workload  # one NATS server


def test_kubernetes_env_references_only_variables_defined_before() -> None:
    for container in (c for c in ALL if c.platform == "k8s"):
        defined: set[str] = set()
        for item in container.doc.get("env", []):
            for ref in re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", str(item.get("value", ""))):
                assert ref in defined, f"{container.workload}: {item['name']} uses $({ref}) before it is set"
            defined.add(item["name"])


def _token_file(container: Container) -> str:
    script = container.argv[-1]
    return script.removeprefix(WRAPPER_PREFIX).split(WRAPPER_EXEC, 1)[0]


def test_every_kubernetes_enroller_mints_for_its_pods_service_into_the_file_it_reads() -> None:
    mains = {c.workload: c for c in MAIN if c.platform == "k8s"}
    enrollers = [c for c in ALL if c.platform == "k8s" and c.sidecar]
    assert {c.workload for c in enrollers} == {w for w, c in mains.items() if _served(c)[1]}
    for enroller in enrollers:
        args = _parse(keygen.parser(), list(enroller.argv[3:]))
        assert enroller.argv[:3] == ("python", "-m", "deploy.keygen")
        main = mains[enroller.workload]
        assert args.command == "token" and args.service_id == _served(main)[0]
        assert str(args.out) == _token_file(main)
        assert 0 < args.every < 600, "a fresh token well within the 10 minutes one lives"
        assert "service" not in str(args.operator_key)


def test_the_compose_keygen_writes_every_token_the_services_read() -> None:
    (init,) = [c for c in ALL if c.platform == "compose" and c.workload == "keygen"]
    args = _parse(keygen.parser(), list(init.argv[3:]))
    assert args.command == "compose-init"
    for container in (c for c in MAIN if c.platform == "compose"):
        service_id, wrapped = _served(container)
        if wrapped:
            assert _token_file(container) == "/run/fleet/identity/enrollment-token"
            (mount,) = [v for v in container.doc["volumes"] if v["target"] == "/run/fleet/identity"]
            assert mount["read_only"] is True
            assert mount["volume"]["subpath"] == f"identities/{service_id}"  # its own key, no one else's
    assert Path(str(args.dir)).is_absolute()
