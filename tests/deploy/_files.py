"""The deployment files as the tests see them: the compose file, the Kubernetes manifests, the
containers in both, and a small evaluator of NetworkPolicy semantics (pod selectors and ports)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
ONE_SHOTS = frozenset({"keygen", "enroll", "bootstrap"})  # the fleet image's containers that serve nothing

Doc = dict[str, Any]
# The Kubernetes version the manifests are checked against: one kubernetes-validate ships, old
# enough for managed clusters of today, new enough for native sidecars (restartPolicy: Always
# init containers, on by default since 1.29).
KUBERNETES_VERSION = "1.33"
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject-v1alpha1.json"}
SCHEMAS = Path(__file__).parent / "schemas"


def validate(doc: Doc) -> None:
    """Raise if ``doc`` does not validate: against the Kubernetes schemas (strict: no unknown
    fields), or for a CRD against the schema written for it here."""
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
        return
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def compose_schema() -> dict[str, Any]:
    """The Compose Specification's JSON schema (the copy check-jsonschema vendors: no network)."""
    schema: dict[str, Any] = json.loads(
        (files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    )
    return schema


def compose_errors(document: Doc) -> list[str]:
    """What the Compose Specification finds wrong with ``document`` (nothing: an empty list)."""
    validator = jsonschema.Draft202012Validator(compose_schema())
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]


@functools.cache
def k8s_docs() -> list[tuple[str, Doc]]:
    """(file name, document) of every manifest of the base, the kustomization excepted (read once:
    callers that change a document change a deep copy)."""
    out: list[tuple[str, Doc]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return out


def kustomization() -> Doc:
    loaded: Doc = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return loaded


@functools.cache
def compose() -> Doc:
    loaded: Doc = yaml.safe_load(COMPOSE.read_text())
    return loaded


@dataclass(frozen=True, slots=True)
class Container:
    """One container of either platform, reduced to what the tests compare."""

    platform: str
    workload: str  # compose service, or Kubernetes workload name
    name: str  # the container's name (compose: the service's)
    argv: tuple[str, ...]  # entrypoint/command and args, as the kernel would exec them
    env: dict[str, str]  # values; a Kubernetes valueFrom is ``<from Secret|field>``
    sidecar: bool = False
    doc: Doc = field(default_factory=dict, compare=False)

    @property
    def fleet_vars(self) -> set[str]:
        return {name for name in self.env if name.startswith("FLEET_")}


def _k8s_env(container: Doc) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            source = item["valueFrom"]
            env[item["name"]] = "<from Secret>" if "secretKeyRef" in source else "<from field>"
    return env


def pod_specs() -> Iterator[tuple[str, Doc, Doc]]:
    """(workload name, pod template metadata, pod spec) of every Deployment, StatefulSet and Job."""
    for _, doc in k8s_docs():
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            template = doc["spec"]["template"]
            yield doc["metadata"]["name"], template["metadata"], template["spec"]


def k8s_containers(image: str = "agent-fleet:dev") -> list[Container]:
    """The containers (sidecars too) of the fleet's own image."""
    out: list[Container] = []
    for workload, _, spec in pod_specs():
        for sidecar, container in [(True, c) for c in spec.get("initContainers", [])] + [
            (False, c) for c in spec["containers"]
        ]:
            if container["image"] != image:
                continue
            argv = tuple(container.get("command", ["fleet"])) + tuple(container.get("args", []))
            out.append(
                Container("k8s", workload, container["name"], argv, _k8s_env(container), sidecar, container)
            )
    return out


def compose_containers(image: str = "agent-fleet:dev") -> list[Container]:
    out: list[Container] = []
    for name, service in compose()["services"].items():
        if service.get("image") != image:
            continue
        entrypoint = service.get("entrypoint", ["fleet"])
        argv = tuple(part.replace("$$", "$") for part in [*entrypoint, *service.get("command", [])])
        env = {key: str(value) for key, value in service.get("environment", {}).items()}
        out.append(Container("compose", name, name, argv, env, False, service))
    return out


# ------------------------------------------------------------------------------- network policies
@dataclass(frozen=True, slots=True)
class Pod:
    workload: str
    labels: dict[str, str]
    namespace: str = "fleet"
    namespace_labels: dict[str, str] = field(default_factory=dict)


@functools.cache
def pods() -> list[Pod]:
    return [Pod(name, dict(meta["labels"])) for name, meta, _ in pod_specs()]


def pod(workload: str) -> Pod:
    return next(p for p in pods() if p.workload == workload)


def outside_pod(namespace: str, labels: dict[str, str] | None = None) -> Pod:
    """A pod of another namespace (an ingress controller, KEDA, the cluster DNS)."""
    return Pod(f"{namespace}-pod", dict(labels or {}), namespace, {"kubernetes.io/metadata.name": namespace})


def network_policies() -> list[Doc]:
    return [doc for _, doc in k8s_docs() if doc["kind"] == "NetworkPolicy"]


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels"}:
        raise AssertionError(f"the evaluator knows matchLabels only: {selector}")
    wanted: dict[str, str] = selector.get("matchLabels", {})
    return all(labels.get(key) == value for key, value in wanted.items())


def _peer_matches(peer: Doc, other: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic is judged by selectors only
    if "namespaceSelector" in peer:
        namespace_ok = _selects(peer["namespaceSelector"], other.namespace_labels)
    else:
        namespace_ok = other.namespace == policy_namespace
    return namespace_ok and _selects(peer.get("podSelector", {}), other.labels)


def _port_matches(rule: Doc, port: int) -> bool:
    ports = rule.get("ports")
    return not ports or any(p.get("port") == port and p.get("protocol", "TCP") == "TCP" for p in ports)


def _direction_allows(policies: list[Doc], local: Pod, remote: Pod, port: int, direction: str) -> bool:
    key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if local.namespace == "fleet"
        and direction in p["spec"]["policyTypes"]
        and _selects(p["spec"]["podSelector"], local.labels)
    ]
    if local.namespace != "fleet" or not selecting:
        return True  # no policy isolates this pod in this direction
    return any(
        _port_matches(rule, port)
        and any(_peer_matches(peer, remote, "fleet") for peer in rule.get(peers, []))
        for p in selecting
        for rule in p["spec"].get(key) or []
    )


def allowed(policies: list[Doc], source: Pod, target: Pod, port: int) -> bool:
    """Whether ``source`` may open a TCP connection to ``target`` on ``port``: the source's egress
    and the target's ingress must both allow it (NetworkPolicy semantics)."""
    return _direction_allows(policies, source, target, port, "Egress") and _direction_allows(
        policies, target, source, port, "Ingress"
    )
