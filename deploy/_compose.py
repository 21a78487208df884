"""``deploy/compose.yaml``: the infrastructure images and every service of the local stack, in
production mode on one host."""

from __future__ import annotations

from deploy._topology import (
    ENROLL,
    IDENTITY_DIR,
    IMAGE,
    NATS_IMAGE,
    OPA_IMAGE,
    OPA_PORT,
    OPERATOR_KEY_DIR,
    POLICY_KINDS,
    PORT,
    POSTGRES_IMAGE,
    PUBLIC_KEYS_DIR,
    QDRANT_IMAGE,
    STATE_DIR,
    Deployed,
    Doc,
    deployed,
    enroll_command,
    environment,
    serve_command,
)
from deploy.local_stack import SERVICES

# ------------------------------------------------------------------------------- compose
COMPOSE_NETWORKS = {
    "fleet": "every service: NATS, the registry, A2A and MCP",
    "data": "Postgres and the services that own a database",
    "policy": "OPA and the services that evaluate policy",
    "memory": "Qdrant and the memory MCP server",
}
START_AFTER = {  # the tiers of ``fleet up``: a tier starts once the one before is healthy
    "registry": (),
    "mcp_server": ("registry",),
    "specialist": ("mcp_server",),
    "coordinator": ("specialist",),
    "worker": ("coordinator",),
    "console": ("coordinator",),
}
PUBLISHED = {"coordinator": 8700, "registry": 8701, "console": 8702}


def _healthcheck() -> Doc:
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{PORT}/healthz', timeout=3)"
    return {
        "test": ["CMD", "python", "-c", probe],
        "interval": "5s",
        "timeout": "5s",
        "retries": 3,
        "start_period": "120s",
    }


def _compose_depends(unit: Deployed) -> Doc:
    depends: Doc = {
        "keygen": {"condition": "service_completed_successfully"},
        "nats": {"condition": "service_healthy"},
    }
    if unit.spec.kind != "registry":  # its key is enrolled before it starts
        depends[ENROLL] = {"condition": "service_completed_successfully"}
    if unit.spec.database:
        depends["postgres"] = {"condition": "service_healthy"}
    if unit.spec.kind in POLICY_KINDS:
        depends["opa"] = {"condition": "service_started"}
    if unit.spec.id == "mcp-memory":
        depends["qdrant"] = {"condition": "service_started"}
    for kind in START_AFTER[unit.spec.kind]:
        for other in SERVICES:
            if other.kind == kind:
                depends[other.id] = {"condition": "service_healthy"}
    return depends


def _compose_service(unit: Deployed) -> Doc:
    spec = unit.spec
    networks = ["fleet"]
    if spec.database:
        networks.append("data")
    if spec.kind in POLICY_KINDS:
        networks.append("policy")
    if spec.id == "mcp-memory":
        networks.append("memory")
    command = serve_command(unit)
    service: Doc = {
        "image": IMAGE,
        "build": {"context": "..", "dockerfile": "deploy/Dockerfile"},
        "entrypoint": command[:1],
        "command": command[1:],
        "environment": environment(unit, "compose"),
        "volumes": [
            _secrets_subpath(f"identities/{spec.id}", IDENTITY_DIR),
            {"type": "volume", "source": f"state-{spec.id}", "target": STATE_DIR},
        ],
        "read_only": True,
        "tmpfs": ["/tmp"],
        "networks": networks,
        "depends_on": _compose_depends(unit),
        "healthcheck": _healthcheck(),
        "restart": "on-failure",
    }
    if spec.kind in PUBLISHED:
        service["ports"] = [f"127.0.0.1:{PUBLISHED[spec.kind]}:{PORT}"]
    if spec.id == "mcp-sandbox":
        # bubblewrap makes user, mount and pid namespaces: Docker's default seccomp and AppArmor
        # profiles forbid that. Better: a gVisor runtime (``runtime: runsc``), as in Kubernetes.
        service["security_opt"] = ["seccomp=unconfined", "apparmor=unconfined"]
    return service


def _secrets_subpath(subpath: str, target: str) -> Doc:
    return {
        "type": "volume",
        "source": "fleet-secrets",
        "target": target,
        "read_only": True,
        "volume": {"subpath": subpath},
    }


def _compose_enroll() -> Doc:
    """The one-shot that enrolls every identity once the registry is up: the only container but
    ``keygen`` that sees the operator key. Services start after it completed."""
    command = enroll_command()
    return {
        "image": IMAGE,
        "build": {"context": "..", "dockerfile": "deploy/Dockerfile"},
        "entrypoint": command[:3],
        "command": command[3:],
        "volumes": [
            _secrets_subpath("operator", OPERATOR_KEY_DIR),
            _secrets_subpath("public", PUBLIC_KEYS_DIR),
        ],
        "read_only": True,
        "networks": ["fleet"],
        "depends_on": {
            "keygen": {"condition": "service_completed_successfully"},
            "registry": {"condition": "service_healthy"},
        },
        "restart": "no",
    }


def _compose_infra() -> Doc:
    pg_dir = "/run/fleet/postgres"
    return {
        "keygen": {
            "image": IMAGE,
            "build": {"context": "..", "dockerfile": "deploy/Dockerfile"},
            "entrypoint": ["python", "-m", "deploy.keygen"],
            "command": ["secrets", "/run/fleet/secrets"],
            "volumes": [{"type": "volume", "source": "fleet-secrets", "target": "/run/fleet/secrets"}],
            "network_mode": "none",
            "restart": "no",
        },
        ENROLL: _compose_enroll(),
        "nats": {
            "image": NATS_IMAGE,
            "command": ["--jetstream", "--store_dir", "/data", "--http_port", "8222"],
            "volumes": [{"type": "volume", "source": "nats-data", "target": "/data"}],
            "networks": ["fleet"],
            "healthcheck": {
                "test": ["CMD", "wget", "-q", "-O-", "http://127.0.0.1:8222/healthz?js-enabled-only=true"],
                "interval": "5s",
                "timeout": "3s",
                "retries": 5,
            },
            "restart": "unless-stopped",
        },
        "postgres": {
            "image": POSTGRES_IMAGE,
            "environment": {
                "POSTGRES_USER": "postgres",
                "POSTGRES_PASSWORD_FILE": f"{pg_dir}/postgres-password",
                "PG_FLEET_PASSWORD_FILE": f"{pg_dir}/fleet-password",
                "PG_FLEET_DATA_PASSWORD_FILE": f"{pg_dir}/fleet_data-password",
                "PGDATA": "/var/lib/postgresql/data/pgdata",
            },
            "volumes": [
                {"type": "volume", "source": "postgres-data", "target": "/var/lib/postgresql/data"},
                {
                    "type": "volume",
                    "source": "fleet-secrets",
                    "target": pg_dir,
                    "read_only": True,
                    "volume": {"subpath": "postgres"},
                },
                {
                    "type": "bind",
                    "source": "./k8s/postgres/init.sh",
                    "target": "/docker-entrypoint-initdb.d/10-fleet.sh",
                    "read_only": True,
                },
            ],
            "networks": ["data"],
            "depends_on": {"keygen": {"condition": "service_completed_successfully"}},
            "healthcheck": {
                "test": ["CMD", "pg_isready", "-U", "postgres", "-h", "127.0.0.1"],
                "interval": "5s",
                "timeout": "3s",
                "retries": 10,
            },
            "restart": "unless-stopped",
        },
        "qdrant": {
            "image": QDRANT_IMAGE,
            "volumes": [{"type": "volume", "source": "qdrant-data", "target": "/qdrant/storage"}],
            "networks": ["memory"],
            "restart": "unless-stopped",
        },
        "opa": {
            # Empty at start: each service's opa engine pushes the bundle it enforces (policy/opa_rest.py).
            "image": OPA_IMAGE,
            "command": ["run", "--server", f"--addr=0.0.0.0:{OPA_PORT}", "--log-level=error"],
            "networks": ["policy"],
            "restart": "unless-stopped",
        },
    }


def compose() -> Doc:
    units = deployed("compose")
    services = {**_compose_infra(), **{unit.name: _compose_service(unit) for unit in units}}
    volumes = [
        "fleet-secrets",
        "nats-data",
        "postgres-data",
        "qdrant-data",
        *(f"state-{u.name}" for u in units),
    ]
    return {
        "name": "agent-fleet",
        "services": services,
        "networks": {
            name: {"labels": {"agent-fleet.network": about}} for name, about in COMPOSE_NETWORKS.items()
        },
        "volumes": {name: {} for name in volumes},
    }
