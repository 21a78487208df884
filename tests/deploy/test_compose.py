"""deploy/compose.yaml against the Compose Specification's JSON schema (the copy check-jsonschema
vendors: no network needed), and what the schema cannot see."""

from __future__ import annotations

import copy
import json
from importlib.resources import files
from typing import Any

import jsonschema
import pytest

from tests.deploy._files import Doc, compose

FLEET_IMAGE = "agent-fleet:dev"


def compose_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(
        (files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    )
    return schema


def errors(document: Doc) -> list[str]:
    validator = jsonschema.Draft202012Validator(compose_schema())
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]


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
        if service.get("image") == FLEET_IMAGE and name not in ("keygen", "enroll", "registry"):
            assert service["depends_on"]["enroll"] == {"condition": "service_completed_successfully"}, name
    assert services["enroll"]["depends_on"]["registry"] == {"condition": "service_healthy"}


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
