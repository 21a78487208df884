"""What ``deploy.keygen`` (which writes the secrets) and ``deploy.render`` (which writes the
manifests) share about a deployment's bus and TLS: the NATS nodes and their names, where NATS
finds its configuration and its secrets, and the names each certificate is for. Data only."""

from __future__ import annotations

from pathlib import Path

from fleet.buskeys import BusKeys, ServerTls, stack_config

NAMESPACE = "fleet"  # the Kubernetes namespace (service names are also valid under it)
NATS_NODES = 3  # the Kubernetes NATS cluster (compose runs one server)
NATS_CLUSTER = "fleet-nats"
NATS_CLIENT_PORT = 4222
NATS_ROUTE_PORT = 6222
NATS_MONITOR_PORT = 8222
ROUTE_USER = "route"

# Inside the NATS container: its configuration (committed, rendered: a compose config, a ConfigMap)
# and, beside it, what the secrets hold (the auth include, the server's certificate and key, the
# routes' credentials). The configuration includes the auth file by a path relative to itself.
NATS_CONFIG_DIR = "/etc/nats/config"
NATS_AUTH_DIR = "/etc/nats/auth"
NATS_AUTH_INCLUDE = "../auth/auth.conf"
NATS_CLUSTER_INCLUDE = "../auth/cluster.conf"
NATS_CERT = "server.pem"
NATS_KEY = "server-key.pem"

LOOPBACK_NAMES = ("localhost", "127.0.0.1")  # a container's own health check, a debugging shell


def nats_pods() -> list[str]:
    """The Kubernetes NATS nodes' stable names (StatefulSet pods under the headless Service)."""
    return [f"nats-{n}.nats" for n in range(NATS_NODES)]


def nats_cert_names() -> list[str]:
    """What NATS's certificate is for: compose's ``nats``, Kubernetes' Service and its pods."""
    return [
        "nats",
        *nats_pods(),
        "*.nats",
        f"nats.{NAMESPACE}.svc",
        f"*.nats.{NAMESPACE}.svc",
        f"*.nats.{NAMESPACE}.svc.cluster.local",
        *LOOPBACK_NAMES,
    ]


def service_cert_names(name: str) -> list[str]:
    """What a service's HTTPS certificate is for: its compose and Kubernetes Service name."""
    return [name, f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.cluster.local", *LOOPBACK_NAMES]


def auth_conf(keys: BusKeys) -> str:
    """The NATS server's auth include: accounts, the registry's callout, the static users (public
    keys only, :func:`fleet.buskeys.server_config`) and TLS on the client port."""
    tls = ServerTls(Path(NATS_AUTH_DIR) / NATS_CERT, Path(NATS_AUTH_DIR) / NATS_KEY)
    return stack_config(keys, tls)


def cluster_conf(route_password: str) -> str:
    """The Kubernetes NATS nodes' ``cluster`` block: a route must authenticate (a process that
    reaches a route port must not join as a server and read every message); it holds the
    password, so it is a secret, included by the ConfigMap's configuration."""
    routes = "\n".join(
        f"    nats://{ROUTE_USER}:{route_password}@{pod}:{NATS_ROUTE_PORT}" for pod in nats_pods()
    )
    return (
        "cluster {\n"
        f"  name: {NATS_CLUSTER}\n"
        f"  listen: 0.0.0.0:{NATS_ROUTE_PORT}\n"
        f'  authorization {{ user: {ROUTE_USER}, password: "{route_password}", timeout: 2 }}\n'
        "  routes [\n"
        f"{routes}\n"
        "  ]\n"
        "}\n"
    )
