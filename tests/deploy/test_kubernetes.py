"""The Kubernetes base: valid against the API's schemas (offline), complete, and shaped as the
architecture wants it (a 3-node NATS cluster, KEDA on the work queue, gVisor, OPA next to each
service that decides, probes and resources everywhere)."""

from __future__ import annotations

import copy
import posixpath
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]  # ships no type information
import pytest
import yaml

from coordinator.record import work
from deploy import keygen, render
from deploy._bus import NATS_AUTH_INCLUDE, NATS_CLUSTER_INCLUDE
from deploy.local_stack import SERVICES
from fleet.buskeys import FLEET_ACCOUNT, REGISTRY_KEYS
from tests.deploy._files import (
    K8S,
    ONE_SHOTS,
    Doc,
    k8s_containers,
    k8s_docs,
    kustomization,
    pod_specs,
    validate,
)

DOCS = k8s_docs()
KIND_OF = {spec.id: spec.kind for spec in SERVICES}


def _id(item: tuple[str, Doc]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1]['metadata']['name']}"


@pytest.mark.parametrize("item", DOCS, ids=[_id(d) for d in DOCS])
def test_every_manifest_validates_against_its_schema(item: tuple[str, Doc]) -> None:
    validate(item[1])


def _deployment() -> Doc:
    return copy.deepcopy(next(doc for _, doc in DOCS if doc["kind"] == "Deployment"))


def test_a_broken_manifest_fails_validation() -> None:
    wrong_type = _deployment()
    wrong_type["spec"]["replicas"] = "two"
    misspelt = _deployment()
    misspelt["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    for broken in (wrong_type, misspelt):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(broken)
    scaled = copy.deepcopy(next(doc for _, doc in DOCS if doc["kind"] == "ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 4  # KEDA takes strings
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate({**_deployment(), "apiVersion": "apps/v2"})


def test_the_kustomization_lists_every_manifest_and_nothing_else() -> None:
    listed = kustomization()["resources"]
    on_disk = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk


def test_every_secret_and_config_map_a_pod_uses_is_generated_from_files_keygen_writes(tmp_path: Path) -> None:
    keygen.make_secrets(tmp_path / "secrets")
    generated: set[str] = set()
    base = kustomization()
    for generator in base["secretGenerator"] + base["configMapGenerator"]:
        generated.add(generator["name"])
        for entry in generator["files"]:
            relative = entry.split("=", 1)[1]
            root = tmp_path if relative.startswith("secrets/") else K8S
            assert (root / relative).is_file(), f"{generator['name']}: nothing writes {relative}"
    used: set[str] = set()
    for _, _, spec in pod_specs():
        for volume in spec.get("volumes", []):
            used.update([volume["secret"]["secretName"]] if "secret" in volume else [])
            used.update([volume["configMap"]["name"]] if "configMap" in volume else [])
        for container in spec["containers"]:
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    used.add(ref["name"])
    in_manifests = {doc["metadata"]["name"] for _, doc in DOCS if doc["kind"] in ("Secret", "ConfigMap")}
    assert used - in_manifests <= generated, sorted(used - in_manifests - generated)
    assert not any(doc["kind"] == "Secret" for _, doc in DOCS), "no secret value is committed"


def test_the_rendered_files_are_up_to_date() -> None:
    stale = [str(path) for path, text in render.rendered().items() if path.read_text() != text]
    assert stale == [], "run python -m deploy.render"


def _one(kind: str, name: str) -> Doc:
    (doc,) = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _nats_secret_files(tmp_path: Path) -> dict[str, str]:
    """The Secret ``fleet-nats`` as kustomize would make it from what keygen writes."""
    keygen.make_secrets(tmp_path / "secrets")
    (generator,) = [g for g in kustomization()["secretGenerator"] if g["name"] == "fleet-nats"]
    pairs = [entry.split("=", 1) for entry in generator["files"]]
    return {key: (tmp_path / relative).read_text() for key, relative in pairs}


def test_nats_is_a_three_node_cluster_routed_to_every_node_with_jetstream(tmp_path: Path) -> None:
    statefulset = _one("StatefulSet", "nats")
    assert statefulset["spec"]["replicas"] == 3
    headless = _one("Service", "nats")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    config = _one("ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "jetstream {" in config and "server_name: $POD_NAME" in config
    assert f'include "{NATS_CLUSTER_INCLUDE}"' in config
    # The routes are in the included cluster block (a Secret: it holds their password).
    cluster = _nats_secret_files(tmp_path)["cluster.conf"]
    (password,) = re.findall(r'password: "([^"]+)"', cluster)
    routes = {f"nats://route:{password}@nats-{n}.{statefulset['spec']['serviceName']}:6222" for n in range(3)}
    assert all(route in cluster for route in routes)
    assert _one("PodDisruptionBudget", "nats")["spec"]["maxUnavailable"] == 1


def test_nats_requires_tls_and_the_registrys_callout_from_its_secret(tmp_path: Path) -> None:
    config = _one("ConfigMap", "nats-config")["data"]["nats.conf"]
    assert f'include "{NATS_AUTH_INCLUDE}"' in config
    settings = "\n".join(line for line in config.splitlines() if not line.startswith("#"))
    assert "auth_callout" not in settings and "password" not in settings  # in the Secret only
    spec = _one("StatefulSet", "nats")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (config_path,) = [a for a in container["args"] if a.endswith(".conf")]
    assert config_path == posixpath.join(mounts["config"], "nats.conf")
    assert volumes["config"]["configMap"]["name"] == "nats-config"
    # The include, relative to the configuration, lands in the mounted Secret fleet-nats.
    (secret,) = [n for n, v in volumes.items() if v.get("secret", {}).get("secretName") == "fleet-nats"]
    include = posixpath.normpath(posixpath.join(mounts["config"], NATS_AUTH_INCLUDE))
    assert include == posixpath.join(mounts[secret], "auth.conf")
    auth = _nats_secret_files(tmp_path)["auth.conf"]
    assert "auth_callout {" in auth and "account: AUTH" in auth and "FLEET: { jetstream: enabled" in auth
    assert f'cert_file: "{posixpath.join(mounts[secret], "server.pem")}"' in auth


def test_no_pod_but_the_bootstrap_job_mounts_the_bus_admin_seed_and_only_it_and_the_registry_reach_seeds() -> (
    None
):
    (generator,) = [g for g in kustomization()["secretGenerator"] if g["name"] == "fleet-bus-admin"]
    assert generator["files"] == ["admin.nk=secrets/bus-admin/admin.nk"]
    with_seeds = {
        g["name"] for g in kustomization()["secretGenerator"] if any(".nk=" in f for f in g["files"])
    }
    assert with_seeds == {"fleet-bus-admin", "fleet-key-registry"}
    (registry,) = [g for g in kustomization()["secretGenerator"] if g["name"] == "fleet-key-registry"]
    seeds = {f.split("=", 1)[0] for f in registry["files"] if ".nk=" in f}
    assert seeds == {f"{name}.nk" for name in REGISTRY_KEYS}  # no admin seed
    holders: dict[str, set[str]] = {}
    for name, _, spec in pod_specs():
        for volume in spec.get("volumes", []):
            if volume.get("secret", {}).get("secretName") in with_seeds:
                holders.setdefault(volume["secret"]["secretName"], set()).add(name)
    assert holders == {"fleet-bus-admin": {"bootstrap"}, "fleet-key-registry": {"registry"}}
    assert _one("Job", "bootstrap")["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


_SEED = re.compile(r"\bS[ACNOPUX][A-Z2-7]{56}\b")  # an nkey seed


def test_no_private_key_seed_or_password_is_in_any_config_map(tmp_path: Path) -> None:
    layout = keygen.make_secrets(tmp_path / "secrets")
    secret_values = [
        (layout.nats / "routes.secret").read_text().strip(),
        *(p.read_text().strip() for p in (layout.root / "postgres").glob("*-password")),
    ]
    texts: dict[str, str] = {}
    for generator in kustomization()["configMapGenerator"]:
        for entry in generator["files"]:
            relative = entry.split("=", 1)[1]
            root = tmp_path if relative.startswith("secrets/") else K8S
            texts[f"{generator['name']}/{relative}"] = (root / relative).read_text()
    for _, doc in DOCS:
        if doc["kind"] == "ConfigMap":
            texts.update({f"{doc['metadata']['name']}/{k}": v for k, v in doc["data"].items()})
    assert any("BEGIN CERTIFICATE" in text for text in texts.values())  # the CA's certificate is there
    for where, text in texts.items():
        assert "PRIVATE KEY" not in text and not _SEED.search(text), where
        assert not any(value in text for value in secret_values), where
    assert _SEED.search((layout.bus_admin / "admin.nk").read_text())  # the pattern finds a seed


def _seconds(config: str, key: str) -> int:
    (value,) = re.findall(rf"^{key}: (\d+)s$", config, re.MULTILINE)
    return int(value)


def test_a_stopping_nats_node_drains_its_clients_in_lame_duck_mode() -> None:
    config = _one("ConfigMap", "nats-config")["data"]["nats.conf"]
    (pid_file,) = re.findall(r"^pid_file: (\S+)$", config, re.MULTILINE)
    spec = _one("StatefulSet", "nats")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    # The hook signals the server by its pid file; the kubelet's SIGTERM, sent once the hook
    # returned, is ignored by a server in lame duck mode.
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["nats-server", f"-sl=ldm={pid_file}"]
    # The pid file's folder is writable (the root file system is not).
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == pid_file.rsplit("/", 1)[0]]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume.get("emptyDir") == {} and not mount.get("readOnly")
    # The drain (grace period, then clients closed over the duration) ends before the SIGKILL.
    drain = _seconds(config, "lame_duck_grace_period") + _seconds(config, "lame_duck_duration")
    assert spec["terminationGracePeriodSeconds"] > drain


def test_no_two_nats_nodes_are_scheduled_on_one_kubernetes_node() -> None:
    template = _one("StatefulSet", "nats")["spec"]["template"]
    anti = template["spec"]["affinity"]["podAntiAffinity"]
    assert set(anti) == {"requiredDuringSchedulingIgnoredDuringExecution"}  # not merely preferred
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    wanted = term["labelSelector"]["matchLabels"]
    assert set(term["labelSelector"]) == {"matchLabels"}
    assert all(template["metadata"]["labels"].get(k) == v for k, v in wanted.items())


def test_workers_scale_on_the_lag_of_the_work_queue_consumer() -> None:
    scaled = _one("ScaledObject", "worker")["spec"]
    target = _one("Deployment", scaled["scaleTargetRef"]["name"])
    assert target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "nats-jetstream"
    assert trigger["metadata"]["stream"] == work.STREAM
    assert trigger["metadata"]["consumer"] == work.CONSUMER
    endpoint = trigger["metadata"]["natsServerMonitoringEndpoint"]
    assert endpoint == f"nats.{kustomization()['namespace']}.svc.cluster.local:8222"
    assert trigger["metadata"]["account"] == FLEET_ACCOUNT == "FLEET"  # JetStream's account, not $G
    assert scaled["minReplicaCount"] >= 1, "timers and stranded runs need a worker alive"


def test_the_sandbox_server_runs_in_gvisor_and_nothing_else_needs_to() -> None:
    runtime = _one("RuntimeClass", "gvisor")
    assert runtime["handler"] == "runsc"
    classes = {name: spec.get("runtimeClassName") for name, _, spec in pod_specs()}
    assert classes.pop("mcp-sandbox") == "gvisor"
    assert set(classes.values()) == {None}


def _containers(spec: Doc) -> list[Doc]:
    containers: list[Doc] = [*spec.get("initContainers", []), *spec["containers"]]
    return containers


def test_every_container_has_requests_limits_and_a_hardened_security_context() -> None:
    for name, _, spec in pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        for container in _containers(spec):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(
                resources["limits"]
            )
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (name, container["name"])


def test_every_service_container_is_probed_on_healthz() -> None:
    for container in (c for c in k8s_containers() if not c.sidecar and c.workload not in ONE_SHOTS):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            http = container.doc[probe]["httpGet"]
            assert http["path"] == "/healthz" and http["port"] == "http", (container.workload, probe)
            assert http["scheme"] == "HTTPS", (container.workload, probe)  # the service serves TLS only
        assert container.doc["ports"][0] == {"name": "http", "containerPort": 8080}
        # A2A's gRPC binding, on the services that speak A2A only, on the port their settings name
        speaks_a2a = KIND_OF.get(container.workload) in ("coordinator", "specialist")
        assert container.env.get("FLEET_A2A_GRPC_PORT") == ("8090" if speaks_a2a else None), (
            container.workload
        )
        grpc = [{"name": "grpc", "containerPort": 8090}] if speaks_a2a else []
        assert container.doc["ports"][1:] == grpc, container.workload


def _sidecars(spec: Doc) -> dict[str, Any]:
    return {c["name"]: c for c in spec.get("initContainers", [])}


def test_services_that_decide_have_an_opa_sidecar_on_loopback_and_others_none() -> None:
    for container in (c for c in k8s_containers() if not c.sidecar and c.workload not in ONE_SHOTS):
        spec = next(s for name, _, s in pod_specs() if name == container.workload)
        sidecars = _sidecars(spec)
        if container.env.get("FLEET_POLICY_ENGINE") == "opa":
            opa = sidecars["opa"]
            assert opa["restartPolicy"] == "Always"
            assert "--addr=127.0.0.1:8181" in opa["args"], "OPA's API only on the pod's loopback"
            assert container.env["FLEET_OPA_URL"] == "http://127.0.0.1:8181"
        else:
            assert "opa" not in sidecars, container.workload


def test_no_pod_but_the_enroll_job_mounts_the_operator_key_secret() -> None:
    holders = set()
    for name, _, spec in pod_specs():
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        operator = {volume for volume, secret in secrets.items() if secret == "fleet-operator-key"}
        if operator:
            holders.add(name)
        for container in _containers(spec):
            mounted = {m["name"] for m in container.get("volumeMounts", [])}
            assert not operator & mounted or name == "enroll", (name, container["name"])
    assert holders == {"enroll"}
    assert _one("Job", "enroll")["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


def test_the_registry_gets_only_the_operators_public_jwk_and_the_deployment_ca() -> None:
    (spec,) = [s for name, _, s in pod_specs() if name == "registry"]
    config_maps = {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
    secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert config_maps == {"fleet-operator-jwk", "fleet-tls-ca"} and secrets == {"fleet-key-registry"}
    (generator,) = [g for g in kustomization()["configMapGenerator"] if g["name"] == "fleet-operator-jwk"]
    assert generator["files"] == ["operator.jwk.json=secrets/operator/operator.jwk.json"]


def test_specialists_keep_their_journal_on_a_volume_of_their_own() -> None:
    for name, meta, spec in pod_specs():
        if meta["labels"]["app.kubernetes.io/component"] != "specialist":
            continue
        (state,) = [v for v in spec["volumes"] if v["name"] == "state"]
        claim = state["persistentVolumeClaim"]["claimName"]
        assert _one("PersistentVolumeClaim", claim)
        assert _one("Deployment", name)["spec"]["strategy"] == {"type": "Recreate"}


def test_the_yaml_files_parse_as_the_documents_render_made() -> None:
    for name, docs in render.k8s_files().items():
        assert list(yaml.safe_load_all((K8S / name).read_text())) == docs
