"""``deploy/compose.yaml``: the infrastructure images and every service of the local stack, in
production mode on one host."""

from __future__ import annotations

from deploy._bus import (
    NATS_AUTH_DIR,
    NATS_AUTH_INCLUDE,
    NATS_CLIENT_PORT,
    NATS_CONFIG_DIR,
    NATS_MONITOR_PORT,
)
from deploy._topology import (
    BOOTSTRAP,
    BUS_ADMIN_DIR,
    ENROLL,
    GRPC_PORT,
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
    TLS_CA_DIR,
    Deployed,
    Doc,
    Roster,
    bootstrap_command,
    deployed,
    enroll_command,
    environment,
    serve_command,
)
from deploy.local_stack import PG_MAX_CONNECTIONS, SERVICES

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
PUBLISHED_GRPC = {"coordinator": 8710}  # A2A's gRPC binding of the services callers reach


def _healthcheck() -> Doc:
    # HTTPS, verified against the deployment's CA (every certificate also names 127.0.0.1).
    probe = (
        "import ssl, urllib.request; urllib.request.urlopen("
        f"'https://127.0.0.1:{PORT}/healthz', timeout=3,"
        f" context=ssl.create_default_context(cafile='{TLS_CA_DIR}/ca.pem'))"
    )
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
        # The streams and buckets exist before anyone binds to them (services may not create them).
        BOOTSTRAP: {"condition": "service_completed_successfully"},
    }
    if unit.spec.kind != "registry":  # its key is enrolled before it starts
        depends[ENROLL] = {"condition": "service_completed_successfully"}
    if unit.spec.database:
        depends["postgres"] = {"condition": "service_healthy"}
    if unit.spec.kind in POLICY_KINDS:
        depends["opa"] = {"condition": "service_started"}
    if "qdrant" in unit.spec.calls:
        depends["qdrant"] = {"condition": "service_started"}
    for kind in START_AFTER[unit.spec.kind]:
        for other in unit.roster:
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
    if "qdrant" in spec.calls:
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
            _secrets_subpath("tls-ca", TLS_CA_DIR),
            {"type": "volume", "source": f"state-{spec.id}", "target": STATE_DIR},
        ],
        "read_only": True,
        # Docker mounts a tmpfs noexec: the sandbox server runs bubblewrap and its launcher from its
        # runtime folder under /tmp (seen failing to start in a container), so its /tmp allows exec.
        "tmpfs": ["/tmp:exec" if spec.makes_namespaces else "/tmp"],
        "networks": networks,
        "depends_on": _compose_depends(unit),
        "healthcheck": _healthcheck(),
        "restart": "on-failure",
    }
    if spec.kind in PUBLISHED:
        service["ports"] = [f"127.0.0.1:{PUBLISHED[spec.kind]}:{PORT}"]
        if spec.kind in PUBLISHED_GRPC:
            service["ports"].append(f"127.0.0.1:{PUBLISHED_GRPC[spec.kind]}:{GRPC_PORT}")
    if spec.makes_namespaces:
        # bubblewrap makes user, mount and pid namespaces: Docker's default seccomp and AppArmor
        # profiles forbid that. Better: a gVisor runtime (``runtime: runsc``), as in Kubernetes.
        # and Docker masks paths of /proc, under which the kernel refuses bubblewrap a proc of its own
        # ("Can't mount proc": seen in a container): systempaths=unconfined leaves /proc unmasked.
        service["security_opt"] = ["seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"]
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
        "environment": {"SSL_CERT_FILE": f"{TLS_CA_DIR}/ca.pem"},  # the registry's HTTPS
        "volumes": [
            _secrets_subpath("operator", OPERATOR_KEY_DIR),
            _secrets_subpath("public", PUBLIC_KEYS_DIR),
            _secrets_subpath("tls-ca", TLS_CA_DIR),
        ],
        "read_only": True,
        "networks": ["fleet"],
        "depends_on": {
            "keygen": {"condition": "service_completed_successfully"},
            "registry": {"condition": "service_healthy"},
        },
        "restart": "no",
    }


def _compose_bootstrap() -> Doc:
    """The one-shot that creates the bus's streams and buckets as its admin once NATS is healthy:
    the only container but ``keygen`` that sees the admin's seed. The registry starts after it."""
    command = bootstrap_command("compose")
    return {
        "image": IMAGE,
        "build": {"context": "..", "dockerfile": "deploy/Dockerfile"},
        "entrypoint": command[:3],
        "command": command[3:],
        "volumes": [_secrets_subpath("bus-admin", BUS_ADMIN_DIR), _secrets_subpath("tls-ca", TLS_CA_DIR)],
        "read_only": True,
        "networks": ["fleet"],
        "depends_on": {
            "keygen": {"condition": "service_completed_successfully"},
            "nats": {"condition": "service_healthy"},
        },
        "restart": "no",
    }


def nats_config() -> str:
    """The compose NATS server's configuration (one server); accounts, the callout and TLS come
    from the auth include that ``deploy.keygen`` writes (the secrets volume's ``nats/``)."""
    return (
        "# The fleet's NATS (compose: one server, streams with one replica). Clients only over TLS,\n"
        "# authenticated by the registry (auth callout): see the include, from the secrets volume.\n"
        "server_name: nats\n"
        f"listen: 0.0.0.0:{NATS_CLIENT_PORT}\n"
        f"http: 127.0.0.1:{NATS_MONITOR_PORT}\n"  # the health check's, in the container only
        "jetstream {\n"
        "  store_dir: /data/jetstream\n"
        "}\n"
        f'include "{NATS_AUTH_INCLUDE}"\n'
    )


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
        BOOTSTRAP: _compose_bootstrap(),
        "nats": {
            "image": NATS_IMAGE,
            "command": ["--config", f"{NATS_CONFIG_DIR}/nats.conf"],
            "configs": [{"source": "nats-config", "target": f"{NATS_CONFIG_DIR}/nats.conf"}],
            "volumes": [
                {"type": "volume", "source": "nats-data", "target": "/data"},
                # the auth include (public keys only), the server's certificate and key
                _secrets_subpath("nats", NATS_AUTH_DIR),
            ],
            "networks": ["fleet"],
            "depends_on": {"keygen": {"condition": "service_completed_successfully"}},
            "healthcheck": {
                "test": [
                    "CMD",
                    "wget",
                    "-q",
                    "-O-",
                    f"http://127.0.0.1:{NATS_MONITOR_PORT}/healthz?js-enabled-only=true",
                ],
                "interval": "5s",
                "timeout": "3s",
                "retries": 5,
            },
            "restart": "unless-stopped",
        },
        "postgres": {
            "image": POSTGRES_IMAGE,
            "command": ["postgres", "-c", f"max_connections={PG_MAX_CONNECTIONS}"],
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


def compose(roster: Roster = SERVICES) -> Doc:
    units = deployed("compose", roster)
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
        "configs": {"nats-config": {"content": nats_config()}},
    }
