"""The infrastructure of the Kubernetes base: the 3-node NATS cluster, Postgres and Qdrant, the
namespace, the gVisor RuntimeClass and the default-deny policy."""

from __future__ import annotations

import copy

from deploy._bus import (
    NATS_AUTH_DIR,
    NATS_AUTH_INCLUDE,
    NATS_CLIENT_PORT,
    NATS_CLUSTER_INCLUDE,
    NATS_CONFIG_DIR,
    NATS_MONITOR_PORT,
    NATS_NODES,
    NATS_ROUTE_PORT,
)
from deploy._k8s import (
    DNS_EGRESS,
    default_deny,
    hardened,
    http_probe,
    infra_policy,
    labels,
    meta,
    namespace_peer,
    peer,
    pod_security,
    selector,
    service,
    tcp,
)
from deploy._topology import (
    BOOTSTRAP,
    KEDA_NAMESPACE,
    NAMESPACE,
    NATS_IMAGE,
    PART_OF,
    POSTGRES_IMAGE,
    QDRANT_IMAGE,
    Doc,
    Roster,
)
from deploy.local_stack import PG_MAX_CONNECTIONS, SERVICES

# ------------------------------------------------------------------------------- infrastructure
# A NATS pod that stops first goes into lame duck mode (its preStop hook): it stops taking clients,
# waits LAME_DUCK_GRACE_S, then closes its clients over LAME_DUCK_S so that they move to the other
# nodes a few at a time, and exits. It ignores the kubelet's SIGTERM meanwhile, so only
# terminationGracePeriodSeconds (longer than both together) bounds it. The server refuses a
# lame_duck_duration under 30 s.
LAME_DUCK_S = 30
LAME_DUCK_GRACE_S = 10
NATS_TERMINATION_GRACE_S = LAME_DUCK_GRACE_S + LAME_DUCK_S + 20
NATS_PID_DIR = "/var/run/nats"  # an emptyDir (the root file system is read-only)
NATS_PID_FILE = f"{NATS_PID_DIR}/nats.pid"


def nats_config() -> str:
    return (
        "# One node of the fleet's 3-node NATS cluster; every stream, KV bucket and object store is\n"
        "# created with 3 replicas (FLEET_NATS_REPLICAS=3), so any one node may go away.\n"
        "# Clients only over TLS, authenticated by the registry (auth callout), and routes with a\n"
        "# password: both from the includes, out of the Secret fleet-nats (deploy.keygen writes it).\n"
        "server_name: $POD_NAME\n"
        f"listen: 0.0.0.0:{NATS_CLIENT_PORT}\n"
        f"http: 0.0.0.0:{NATS_MONITOR_PORT}\n"
        f"pid_file: {NATS_PID_FILE}\n"
        f"lame_duck_grace_period: {LAME_DUCK_GRACE_S}s\n"
        f"lame_duck_duration: {LAME_DUCK_S}s\n"
        "jetstream {\n"
        "  store_dir: /data/jetstream\n"
        "  max_memory_store: 256MB\n"
        "  max_file_store: 8GB\n"
        "}\n"
        f'include "{NATS_CLUSTER_INCLUDE}"\n'
        f'include "{NATS_AUTH_INCLUDE}"\n'
    )


def nats_docs(roster: Roster = SERVICES) -> list[Doc]:
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("nats-config", "nats"),
        "data": {"nats.conf": nats_config()},
    }
    ports = [
        {"name": "client", "port": 4222, "targetPort": 4222},
        {"name": "cluster", "port": 6222, "targetPort": 6222},
        {"name": "monitor", "port": 8222, "targetPort": 8222},
    ]
    health = "/healthz?js-enabled-only=true"
    container: Doc = {
        "name": "nats",
        "image": NATS_IMAGE,
        "args": ["--config", f"{NATS_CONFIG_DIR}/nats.conf"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": p["name"], "containerPort": p["port"]} for p in ports],
        "volumeMounts": [
            {"name": "config", "mountPath": NATS_CONFIG_DIR, "readOnly": True},
            {"name": "auth", "mountPath": NATS_AUTH_DIR, "readOnly": True},
            {"name": "data", "mountPath": "/data"},
            {"name": "pid", "mountPath": NATS_PID_DIR},
        ],
        # Lame duck mode before the SIGTERM: the server (PID 1, from the image's entrypoint) found by
        # its pid_file, as the NATS Helm chart does.
        "lifecycle": {"preStop": {"exec": {"command": ["nats-server", f"-sl=ldm={NATS_PID_FILE}"]}}},
        "startupProbe": http_probe(health, "monitor", 5, 60),
        "readinessProbe": http_probe(health, "monitor", 10, 3),
        "livenessProbe": http_probe("/healthz?js-server-only=true", "monitor", 30, 3),
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "2", "memory": "1Gi"},
        },
        "securityContext": hardened(),
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta("nats", "nats"),
        "spec": {
            "serviceName": "nats",
            "replicas": NATS_NODES,
            "podManagementPolicy": "Parallel",  # the nodes form the cluster together
            "selector": {"matchLabels": selector("nats")},
            "template": {
                "metadata": {"labels": labels("nats", "nats")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security(1000),
                    "terminationGracePeriodSeconds": NATS_TERMINATION_GRACE_S,
                    # Never two nodes of the cluster on one Kubernetes node: losing a node then loses
                    # one NATS node at most (R3 survives it). A node short leaves a pod Pending.
                    "affinity": {
                        "podAntiAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [
                                {
                                    "topologyKey": "kubernetes.io/hostname",
                                    "labelSelector": {"matchLabels": selector("nats")},
                                }
                            ]
                        }
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "nats-config"}},
                        # the auth include, the routes' credentials, the TLS certificate and key
                        {"name": "auth", "secret": {"secretName": "fleet-nats", "defaultMode": 0o440}},
                        {"name": "pid", "emptyDir": {}},
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "10Gi"}},
                    },
                }
            ],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta("nats", "nats"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector("nats")}},
    }
    policy = infra_policy(
        "nats",
        NATS_CLIENT_PORT,
        [
            {"from": [peer("nats")], "ports": [tcp(NATS_ROUTE_PORT), tcp(NATS_MONITOR_PORT)]},
            # the scaler reads the consumer's lag
            {"from": [namespace_peer(KEDA_NAMESPACE)], "ports": [tcp(NATS_MONITOR_PORT)]},
        ],
        [{"to": [peer("nats")], "ports": [tcp(NATS_ROUTE_PORT)]}, copy.deepcopy(DNS_EGRESS)],
        extra_sources=[BOOTSTRAP],  # the bootstrap Job provisions the streams and buckets
        roster=roster,
    )
    return [config, service("nats", "nats", ports, headless=True), statefulset, budget, policy]


def postgres_docs(roster: Roster = SERVICES) -> list[Doc]:
    secrets_dir = "/run/secrets/postgres"
    container: Doc = {
        "name": "postgres",
        "image": POSTGRES_IMAGE,
        "args": ["postgres", "-c", f"max_connections={PG_MAX_CONNECTIONS}"],
        "env": [
            {"name": "POSTGRES_USER", "value": "postgres"},
            {"name": "POSTGRES_PASSWORD_FILE", "value": f"{secrets_dir}/postgres-password"},
            {"name": "PG_FLEET_PASSWORD_FILE", "value": f"{secrets_dir}/fleet-password"},
            {"name": "PG_FLEET_DATA_PASSWORD_FILE", "value": f"{secrets_dir}/fleet_data-password"},
            {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
        ],
        "ports": [{"name": "postgres", "containerPort": 5432}],
        "volumeMounts": [
            {"name": "data", "mountPath": "/var/lib/postgresql/data"},
            {"name": "passwords", "mountPath": secrets_dir, "readOnly": True},
            {"name": "init", "mountPath": "/docker-entrypoint-initdb.d", "readOnly": True},
            {"name": "run", "mountPath": "/var/run/postgresql"},
        ],
        "readinessProbe": {
            "exec": {"command": ["pg_isready", "-U", "postgres", "-h", "127.0.0.1"]},
            "periodSeconds": 10,
        },
        "livenessProbe": {
            "exec": {"command": ["pg_isready", "-U", "postgres", "-h", "127.0.0.1"]},
            "periodSeconds": 30,
        },
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "2", "memory": "2Gi"},
        },
        "securityContext": hardened(read_only_root=False),
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta("postgres", "postgres"),
        "spec": {
            "serviceName": "postgres",
            "replicas": 1,
            "selector": {"matchLabels": selector("postgres")},
            "template": {
                "metadata": {"labels": labels("postgres", "postgres")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security(999),
                    "containers": [container],
                    "volumes": [
                        {
                            "name": "passwords",
                            "secret": {"secretName": "fleet-postgres", "defaultMode": 0o440},
                        },
                        {"name": "init", "configMap": {"name": "postgres-init", "defaultMode": 0o555}},
                        {"name": "run", "emptyDir": {}},
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "20Gi"}},
                    },
                }
            ],
        },
    }
    ports = [{"name": "postgres", "port": 5432, "targetPort": "postgres"}]
    policy = infra_policy("postgres", 5432, [], [], roster=roster)
    return [service("postgres", "postgres", ports), statefulset, policy]


def qdrant_docs(roster: Roster = SERVICES) -> list[Doc]:
    container: Doc = {
        "name": "qdrant",
        "image": QDRANT_IMAGE,
        "ports": [{"name": "http", "containerPort": 6333}, {"name": "grpc", "containerPort": 6334}],
        "volumeMounts": [
            {"name": "data", "mountPath": "/qdrant/storage"},
            {"name": "snapshots", "mountPath": "/qdrant/snapshots"},
        ],
        "readinessProbe": http_probe("/readyz", "http", 10, 3),
        "livenessProbe": http_probe("/livez", "http", 30, 3),
        "resources": {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "2", "memory": "4Gi"},
        },
        "securityContext": hardened(read_only_root=False),
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta("qdrant", "qdrant"),
        "spec": {
            "serviceName": "qdrant",
            "replicas": 1,
            "selector": {"matchLabels": selector("qdrant")},
            "template": {
                "metadata": {"labels": labels("qdrant", "qdrant")},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": pod_security(1000),
                    "containers": [container],
                    "volumes": [{"name": "snapshots", "emptyDir": {}}],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "10Gi"}},
                    },
                }
            ],
        },
    }
    ports = [{"name": "http", "port": 6333, "targetPort": "http"}]
    return [
        service("qdrant", "qdrant", ports),
        statefulset,
        infra_policy("qdrant", 6333, [], [], roster=roster),
    ]


def cluster_docs() -> list[Doc]:
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": NAMESPACE,
            "labels": {
                "app.kubernetes.io/part-of": PART_OF,
                "pod-security.kubernetes.io/enforce": "restricted",
                "pod-security.kubernetes.io/warn": "restricted",
            },
        },
    }
    runtime_class = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": "gvisor", "labels": {"app.kubernetes.io/part-of": PART_OF}},
        "handler": "runsc",
    }
    return [namespace, runtime_class, default_deny()]
