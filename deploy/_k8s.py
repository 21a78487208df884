"""The Kubernetes workloads of the fleet's services: a Deployment, a Service and a NetworkPolicy
each, the workers' KEDA ScaledObject, and the helpers the infrastructure manifests share."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from deploy._topology import (
    A2A_KINDS,
    BOOTSTRAP,
    BUS_ADMIN_DIR,
    DNS_NAMESPACE,
    ENROLL,
    FRONT_DOORS,
    GRPC_PORT,
    IDENTITY_DIR,
    IMAGE,
    INFRA_PORTS,
    INGRESS_NAMESPACE,
    INTERNET_EXCEPT,
    NAMESPACE,
    OPA_IMAGE,
    OPA_PORT,
    OPERATOR_JWK_DIR,
    OPERATOR_KEY_DIR,
    PART_OF,
    POLICY_KINDS,
    PORT,
    PUBLIC_KEYS_DIR,
    STATE_DIR,
    TLS_CA_DIR,
    Deployed,
    Doc,
    Platform,
    Roster,
    bootstrap_command,
    calls,
    deployed,
    enroll_command,
    environment,
    internet,
    port_of,
    resources,
    serve_command,
)
from deploy.local_stack import SERVICES
from fleet.buskeys import FLEET_ACCOUNT


# ------------------------------------------------------------------------------- kubernetes
def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
    }


def selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name}


def meta(name: str, component: str) -> Doc:
    return {"name": name, "labels": labels(name, component)}


def hardened(read_only_root: bool = True) -> Doc:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": read_only_root,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security(uid: int) -> Doc:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def http_probe(path: str, port: int | str, period: int, failures: int, *, https: bool = False) -> Doc:
    get: Doc = {"path": path, "port": port}
    if https:
        get["scheme"] = "HTTPS"  # the kubelet does not verify the certificate
    return {"httpGet": get, "periodSeconds": period, "failureThreshold": failures}


def _k8s_env(unit: Deployed) -> list[Doc]:
    env: list[Doc] = []
    if unit.spec.kind == "worker":
        env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    for name, value in environment(unit, "k8s").items():
        if name == "FLEET_PG_DSN":
            ref = {"name": "fleet-postgres-dsn", "key": unit.spec.database}
            env.append({"name": name, "valueFrom": {"secretKeyRef": ref}})
        else:
            env.append({"name": name, "value": value})
    return env


def _opa_sidecar() -> Doc:
    """OPA next to the service, on the pod's loopback only: the service's opa engine pushes the
    bundle it enforces and asks it for decisions (policy/opa_rest.py)."""
    return {
        "name": "opa",
        "image": OPA_IMAGE,
        "restartPolicy": "Always",
        "args": [
            "run",
            "--server",
            f"--addr=127.0.0.1:{OPA_PORT}",
            "--diagnostic-addr=0.0.0.0:8282",
            "--log-level=error",
        ],
        "ports": [{"name": "opa-diag", "containerPort": 8282}],
        "startupProbe": http_probe("/health", "opa-diag", 2, 30),
        "livenessProbe": http_probe("/health", "opa-diag", 10, 3),
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"cpu": "500m", "memory": "256Mi"},
        },
        "securityContext": {**hardened(), "runAsUser": 1000, "runAsGroup": 1000},
    }


def _volumes(unit: Deployed) -> list[Doc]:
    spec = unit.spec
    volumes: list[Doc] = [
        {"name": "identity", "secret": {"secretName": f"fleet-key-{unit.service_id}", "defaultMode": 0o440}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.kind == "specialist":  # the operation journal must outlive the pod
        volumes.append({"name": "state", "persistentVolumeClaim": {"claimName": f"state-{unit.name}"}})
    else:
        volumes.append({"name": "state", "emptyDir": {}})
    # the operator's public key (every verifier pins it): its private key is the enroll Job's only
    volumes.append({"name": "operator-jwk", "configMap": {"name": "fleet-operator-jwk"}})
    volumes.append(TLS_CA_VOLUME)
    return volumes


def _mounts(unit: Deployed) -> list[Doc]:
    mounts: list[Doc] = [
        {"name": "identity", "mountPath": IDENTITY_DIR, "readOnly": True},
        {"name": "state", "mountPath": STATE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    mounts.append({"name": "operator-jwk", "mountPath": OPERATOR_JWK_DIR, "readOnly": True})
    mounts.append(TLS_CA_MOUNT)
    return mounts


# The deployment CA's certificate (public): what every pod trusts, for NATS and for HTTPS.
TLS_CA_VOLUME: Doc = {"name": "tls-ca", "configMap": {"name": "fleet-tls-ca"}}
TLS_CA_MOUNT: Doc = {"name": "tls-ca", "mountPath": TLS_CA_DIR, "readOnly": True}


def _service_container(unit: Deployed) -> Doc:
    return {
        "name": "service",
        "image": IMAGE,
        "command": serve_command(unit),
        "ports": [
            {"name": "http", "containerPort": PORT},
            *([{"name": "grpc", "containerPort": GRPC_PORT}] if unit.spec.kind in A2A_KINDS else []),
        ],
        "env": _k8s_env(unit),
        "volumeMounts": _mounts(unit),
        # /healthz answers 503 until the service has checked its enrollment and registered, 200
        # after; a key not enrolled (yet: see the enroll Job) stops the container.
        "startupProbe": http_probe("/healthz", "http", 5, 60, https=True),
        "readinessProbe": http_probe("/healthz", "http", 5, 3, https=True),
        "livenessProbe": http_probe("/healthz", "http", 20, 3, https=True),
        "resources": resources(unit),
        "securityContext": hardened(),
    }


def _pod(unit: Deployed) -> Doc:
    spec = unit.spec
    sidecars = [_opa_sidecar()] if spec.kind in POLICY_KINDS else []
    pod: Doc = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(10001),
        "terminationGracePeriodSeconds": 30,
        "initContainers": sidecars,
        "containers": [_service_container(unit)],
        "volumes": _volumes(unit),
    }
    if not sidecars:
        del pod["initContainers"]
    if spec.makes_namespaces:
        pod["runtimeClassName"] = "gvisor"
    return pod


def deployment(unit: Deployed) -> Doc:
    component = unit.spec.kind.replace("_", "-")
    body: Doc = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(unit.name, component),
        "spec": {
            "replicas": 2 if unit.spec.kind == "worker" else 1,
            "selector": {"matchLabels": selector(unit.name)},
            "template": {"metadata": {"labels": labels(unit.name, component)}, "spec": _pod(unit)},
        },
    }
    if unit.spec.kind == "specialist":  # one pod at a time on its journal's volume
        body["spec"]["strategy"] = {"type": "Recreate"}
    return body


def service(name: str, component: str, ports: list[Doc], *, headless: bool = False) -> Doc:
    spec: Doc = {"selector": selector(name), "ports": ports}
    if headless:
        spec.update(clusterIP="None", publishNotReadyAddresses=True)
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, component), "spec": spec}


def pvc(name: str, component: str, size: str) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta(name, component),
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def fleet_docs(unit: Deployed) -> list[Doc]:
    component = unit.spec.kind.replace("_", "-")
    docs = [deployment(unit)]
    if unit.spec.kind != "worker":
        ports = [{"name": "http", "port": PORT, "targetPort": "http"}]
        if unit.spec.kind in A2A_KINDS:
            ports.append({"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"})
        docs.append(service(unit.name, component, ports))
    if unit.spec.kind == "specialist":
        docs.append(pvc(f"state-{unit.name}", component, "1Gi"))
    docs.append(network_policy(unit))
    return docs


def enroll_docs() -> list[Doc]:
    """The Job that enrolls every identity's public key with the registry (it waits for it): the
    only pod that mounts the operator key. Services start without a token and check that their
    key is enrolled. Run it again (delete it, apply) for a new identity or key."""
    pod = _one_shot_pod(
        ENROLL,
        enroll_command(),
        {"name": "operator-key", "mountPath": OPERATOR_KEY_DIR, "secret": "fleet-operator-key"},
        {"name": "public-keys", "mountPath": PUBLIC_KEYS_DIR, "configMap": "fleet-public-keys"},
        env=[{"name": "SSL_CERT_FILE", "value": f"{TLS_CA_DIR}/ca.pem"}],  # the registry's HTTPS
    )
    return [_job(ENROLL, pod), _one_shot_policy(ENROLL, "registry", PORT)]


def bootstrap_docs() -> list[Doc]:
    """The Job that creates the bus's streams and buckets as its admin (it waits for NATS): the
    only pod that mounts the admin's seed, and it reaches NATS only. Services that start before
    it is done cannot bind to their buckets: they exit and the kubelet restarts them."""
    pod = _one_shot_pod(
        BOOTSTRAP,
        bootstrap_command("k8s"),
        {"name": "bus-admin", "mountPath": BUS_ADMIN_DIR, "secret": "fleet-bus-admin"},
    )
    return [_job(BOOTSTRAP, pod), _one_shot_policy(BOOTSTRAP, "nats", INFRA_PORTS["nats"])]


def _one_shot_pod(
    name: str, command: list[str], *mounts: dict[str, str], env: list[Doc] | None = None
) -> Doc:
    """The pod of a one-shot Job: ``command`` in the fleet image with ``mounts`` (each a Secret or a
    ConfigMap, read-only), the deployment's CA and a scratch ``/tmp``; hardened, small."""
    container: Doc = {
        "name": name,
        "image": IMAGE,
        "command": command,
        **({"env": env} if env else {}),
        "volumeMounts": [
            *({"name": m["name"], "mountPath": m["mountPath"], "readOnly": True} for m in mounts),
            copy.deepcopy(TLS_CA_MOUNT),
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": {
            "requests": {"cpu": "10m", "memory": "96Mi"},
            "limits": {"cpu": "200m", "memory": "192Mi"},
        },
        "securityContext": hardened(),
    }
    volumes: list[Doc] = [
        {"name": m["name"], "secret": {"secretName": m["secret"], "defaultMode": 0o440}}
        if "secret" in m
        else {"name": m["name"], "configMap": {"name": m["configMap"]}}
        for m in mounts
    ]
    return {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": pod_security(10001),
        "restartPolicy": "OnFailure",
        "containers": [container],
        "volumes": [*volumes, copy.deepcopy(TLS_CA_VOLUME), {"name": "tmp", "emptyDir": {}}],
    }


def _job(name: str, pod: Doc) -> Doc:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(name, name),
        "spec": {
            "backoffLimit": 6,
            "template": {"metadata": {"labels": labels(name, name)}, "spec": pod},
        },
    }


def _one_shot_policy(name: str, target: str, port: int) -> Doc:
    """A one-shot Job reaches ``target`` on ``port`` (and DNS), and nothing reaches it."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(name, name),
        "spec": {
            "podSelector": {"matchLabels": selector(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [{"to": [peer(target)], "ports": [tcp(port)]}, copy.deepcopy(DNS_EGRESS)],
        },
    }


def scaled_object() -> Doc:
    """The workers scale on the work queue's backlog: messages of ``FLEET_WORK`` not yet delivered
    to the ``run-workers`` consumer (coordinator/record/work.py), about FLEET_CONCURRENCY (4) per worker."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta("worker", "worker"),
        "spec": {
            "scaleTargetRef": {"name": "worker"},
            "minReplicaCount": 2,  # never 0: workers also fire timers and resume stranded runs
            "maxReplicaCount": 5,  # what the `fleet` role's CONNECTION LIMIT (80) admits beside the coordinator
            "pollingInterval": 15,
            "cooldownPeriod": 300,
            "triggers": [
                {
                    "type": "nats-jetstream",
                    "metadata": {
                        "natsServerMonitoringEndpoint": f"nats.{NAMESPACE}.svc.cluster.local:8222",
                        "account": FLEET_ACCOUNT,  # JetStream lives in the FLEET account
                        "stream": "FLEET_WORK",
                        "consumer": "run-workers",
                        "lagThreshold": "4",
                        "activationLagThreshold": "1",
                        "useHttps": "false",
                    },
                }
            ],
        },
    }


# ------------------------------------------------------------------------------- network policies
def peer(name: str) -> Doc:
    return {"podSelector": {"matchLabels": selector(name)}}


def namespace_peer(namespace: str) -> Doc:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}


def tcp(port: int) -> Doc:
    return {"protocol": "TCP", "port": port}


# The cluster DNS: pods labelled k8s-app=kube-dns in kube-system only (both selectors in one peer, so
# both must match): a pod given that label in another namespace is no DNS server to the fleet.
DNS_EGRESS: Doc = {
    "to": [
        {
            **namespace_peer(DNS_NAMESPACE),
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
        }
    ],
    "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
}
INTERNET_EGRESS: Doc = {
    "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": list(INTERNET_EXCEPT)}}],
    "ports": [tcp(443), tcp(80)],
}


def pod_name(target: str, roster: Roster = SERVICES, platform: Platform = "k8s") -> str:
    if target in INFRA_PORTS:
        return target
    unit = next(u for u in deployed(platform, roster) if u.spec.id == target or u.name == target)
    return unit.name


def callers(target: str, roster: Roster = SERVICES) -> list[str]:
    """The Kubernetes workloads of ``roster`` that call ``target`` (a service id or an
    infrastructure name)."""
    return sorted({unit.name for unit in deployed("k8s", roster) if target in calls(unit.spec, roster)})


def network_policy(unit: Deployed) -> Doc:
    """What this workload may receive (from its callers) and open (to what it calls)."""
    spec = unit.spec
    ingress: list[Doc] = []
    enrolls = [ENROLL] if spec.kind == "registry" else []  # the enroll Job calls the registry only
    sources = [peer(name) for name in sorted([*callers(spec.id, unit.roster), *enrolls])]
    if spec.kind in FRONT_DOORS:
        sources.append(namespace_peer(INGRESS_NAMESPACE))
    if sources:
        ingress.append({"from": sources, "ports": [tcp(PORT)]})
    if spec.kind in FRONT_DOORS and spec.kind in A2A_KINDS:
        # A2A's gRPC binding, for callers outside (the fleet's own hops all speak JSON-RPC)
        ingress.append({"from": [namespace_peer(INGRESS_NAMESPACE)], "ports": [tcp(GRPC_PORT)]})
    by_port: dict[int, list[str]] = {}
    for target in calls(spec, unit.roster):
        by_port.setdefault(port_of(target), []).append(pod_name(target, unit.roster))
    egress: list[Doc] = [
        {"to": [peer(name) for name in sorted(set(names))], "ports": [tcp(port)]}
        for port, names in sorted(by_port.items())
    ]
    egress.append(copy.deepcopy(DNS_EGRESS))
    if internet(spec):
        egress.append(copy.deepcopy(INTERNET_EGRESS))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(unit.name, spec.kind.replace("_", "-")),
        "spec": {
            "podSelector": {"matchLabels": selector(unit.name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": egress,
        },
    }


def infra_policy(
    name: str,
    port: int,
    extra_ingress: list[Doc],
    egress: list[Doc],
    extra_sources: Sequence[str] = (),
    roster: Roster = SERVICES,
) -> Doc:
    sources = [peer(caller) for caller in sorted([*callers(name, roster), *extra_sources])]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(name, name),
        "spec": {
            "podSelector": {"matchLabels": selector(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": sources, "ports": [tcp(port)]}, *extra_ingress],
            "egress": egress,
        },
    }


def default_deny() -> Doc:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "default-deny", "labels": {"app.kubernetes.io/part-of": PART_OF}},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
    }
