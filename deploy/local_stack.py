"""The services that ``fleet up`` starts, in start order, each described by one record: what it is,
what it may ask the token service for, what it calls, what it needs, and the settings it is
deployed with. The local stack, the compose file and the Kubernetes manifests are all derived from
these records (:mod:`deploy._topology`), and so are a user's own services, read from their fleet
manifest (:mod:`deploy.manifest`).

Entries name the service's entry point as ``module:function`` so that the supervisor (and
``fleet serve``) can start it without importing it here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

ServiceKind = Literal["registry", "coordinator", "worker", "specialist", "mcp_server", "console"]
KINDS: tuple[ServiceKind, ...] = ("registry", "coordinator", "worker", "specialist", "mcp_server", "console")
INFRASTRUCTURE = ("nats", "postgres", "qdrant")  # what a service may call besides other services


@dataclass(frozen=True, slots=True)
class Resources:
    """What a service's container asks for and may use at most (Kubernetes quantities)."""

    cpu: str = "100m"
    memory: str = "256Mi"
    cpu_limit: str = "1"
    memory_limit: str = "512Mi"


# What each kind needs unless its record says otherwise.
KIND_RESOURCES: dict[str, Resources] = {
    "coordinator": Resources("250m", "512Mi", "2", "1Gi"),
    "worker": Resources("250m", "512Mi", "2", "1Gi"),
    "mcp_server": Resources(memory_limit="1Gi"),
    "console": Resources("50m", "128Mi", "500m", "256Mi"),
}


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One service process of the fleet, and every fact the deployments derive from it."""

    id: str
    kind: ServiceKind
    entry: str
    scopes: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ("*",)
    mcp_path: str = ""
    database: str = ""  # the Postgres database this service owns; no database access if empty
    # The skills its agent card may offer (its enrollment token names them; the registry refuses a
    # card claiming any other): those its module serves (tests/unit/test_skill_binding.py checks).
    skills: tuple[str, ...] = ()
    # What it opens connections to besides what its kind always calls (NATS, the registry, a
    # specialist's mcp-memory, ...; see deploy._topology.calls): other services by id, or "qdrant".
    calls: tuple[str, ...] = ()
    # Whether it may open connections outside the deployment (an LLM, outside agents, webhooks).
    internet: bool = False
    resources: Resources | None = None  # None: what its kind needs (KIND_RESOURCES)
    # Settings it is deployed with besides the fleet's own (compose and Kubernetes alike), and those
    # only the compose file sets (one host, demo data).
    env: tuple[tuple[str, str], ...] = ()
    compose_env: tuple[tuple[str, str], ...] = ()
    # It runs code nobody vetted in namespaces it makes itself (bubblewrap): compose lifts Docker's
    # seccomp and AppArmor profiles for it, Kubernetes runs it under gVisor.
    makes_namespaces: bool = False
    # Where it was declared: "" for the platform's own roster, else the manifest's path and line.
    origin: str = field(default="", compare=False)

    @property
    def needs(self) -> Resources:
        """The resources it runs with: its own, or its kind's."""
        return self.resources or KIND_RESOURCES.get(self.kind, Resources())


REGISTRY = ServiceSpec("registry", "registry", "registry.server:main", internet=True)
DEFAULT_WORKERS = 2  # ``FLEET_WORKERS`` starts another number


def worker(n: int) -> ServiceSpec:
    """Worker ``n`` (1-based): workers share the work queue, so any number of them may run."""
    return ServiceSpec(
        f"worker-{n}",
        "worker",
        "coordinator.engine.worker:main",
        scopes=("registry:read", "agent:invoke", "memory:consolidate"),  # a completed run's memory
        database="fleet",
        internet=True,  # outside agents' A2A endpoints
    )


STATE_DIR = "/var/lib/fleet"  # a deployed service's own state (a volume)
SANDBOX_PYTHON = "/usr/local/bin/python3.11"  # the image's, under /usr (the sandbox sees only /usr)
MEMORY = ("memory:read", "memory:write")  # what an agent may do with its tenant's long-term memory

SERVICES: tuple[ServiceSpec, ...] = (
    REGISTRY,
    ServiceSpec(
        "mcp-sql",
        "mcp_server",
        "mcp_servers.sql.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
        database="fleet_data",
        compose_env=(("FLEET_SEED_DEMO", "true"),),  # one host, the demo's data
        env=(("FLEET_SEED_DEMO", "false"),),
    ),
    ServiceSpec(
        "mcp-cases",
        "mcp_server",
        "mcp_servers.cases.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
        database="fleet_data",
    ),
    ServiceSpec(
        "mcp-sandbox",
        "mcp_server",
        "mcp_servers.sandbox.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
        resources=Resources("500m", "512Mi", "4", "3Gi"),  # up to 4 runs at once, 512 MiB each
        env=(
            ("FLEET_SANDBOX_PYTHON", SANDBOX_PYTHON),
            # a container cannot make cgroups (nothing delegated): the container's own memory and
            # pids limits bound its calls together; seccomp and --disable-userns stay required
            ("FLEET_SANDBOX_REQUIRED_LAYERS", "seccomp,userns"),
        ),
        makes_namespaces=True,
    ),
    ServiceSpec(
        "mcp-outbox",
        "mcp_server",
        "mcp_servers.outbox.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
        database="fleet_data",
        internet=True,  # webhooks and ticket systems
    ),
    ServiceSpec(
        "mcp-memory",
        "mcp_server",
        "mcp_servers.memory.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
        calls=("qdrant",),
        internet=True,  # an embeddings or memory-model endpoint, when configured
        # the embedding model and the PII analyzer live in process
        resources=Resources("250m", "1Gi", "2", "2Gi"),
        env=(
            ("FLEET_MEMORY_STORE", "qdrant"),
            ("FLEET_MEMORY_QDRANT_URL", "http://qdrant:6333"),
            ("FLEET_MEMORY_QDRANT_COLLECTION", "fleet_memory"),
            ("XDG_CACHE_HOME", f"{STATE_DIR}/cache"),  # the embedding model's derived int8 variant
        ),
    ),
    ServiceSpec(
        "sql-analyst",
        "specialist",
        "specialists.sql_analyst.agent:main",
        scopes=("registry:read", "registry:write", "sql:query", *MEMORY),
        skills=("reconcile-invoices", "invoice-totals", "sql-query"),
        calls=("mcp-sql",),
        internet=True,  # an LLM endpoint, when configured
    ),
    ServiceSpec(
        "stats",
        "specialist",
        "specialists.stats.agent:main",
        scopes=("registry:read", "registry:write", *MEMORY),
        skills=("outliers",),
        internet=True,
    ),
    ServiceSpec(
        "case-desk",
        "specialist",
        "specialists.case_desk.agent:main",
        scopes=("registry:read", "registry:write", "cases:write", *MEMORY),
        skills=("post-note", "open-review-cases", "issue-refund"),
        calls=("mcp-cases",),
        internet=True,
    ),
    *(
        ServiceSpec(
            replica,
            "specialist",
            "specialists.code_runner.agent:main",
            scopes=("registry:read", "registry:write", "sandbox:run", "sandbox:list", *MEMORY),
            skills=("score-anomalies", "run-python"),
            calls=("mcp-sandbox",),
            internet=True,
        )
        # Two replicas: the coordinator moves a step whose agent went away to the other one.
        for replica in ("code-runner", "code-runner-2")
    ),
    ServiceSpec(
        "researcher",
        "specialist",
        "specialists.researcher.agent:main",
        scopes=("registry:read", "registry:write", *MEMORY),
        skills=("remember-findings", "recall"),
        internet=True,
    ),
    ServiceSpec(
        "publisher",
        "specialist",
        "specialists.publisher.agent:main",
        scopes=("registry:read", "registry:write", "outbox:write", *MEMORY),
        skills=("publish-report",),
        calls=("mcp-outbox",),
        internet=True,
    ),
    ServiceSpec(
        "coordinator",
        "coordinator",
        "coordinator.server:main",
        # sandbox:list: a run's workspace listing, for its debug bundle (a token bound to that run)
        scopes=("registry:read", "registry:write", "agent:invoke", "sandbox:list"),
        skills=("orchestrate",),
        database="fleet",
        internet=True,  # push webhooks, outside agents' cards
    ),
    *(worker(n) for n in range(1, DEFAULT_WORKERS + 1)),
    # The operator console: it acts only in a signed-in person's name, within their sign-in's scopes.
    ServiceSpec(
        "console",
        "console",
        "fleetctl.console:main",
        scopes=("agent:invoke", "runs:approve", "runs:resolve", "registry:read", "runs:admin"),
    ),
)

# Databases of the embedded Postgres: each is owned by a login role of the same name, which only its
# service gets. The SQL server's role may create roles (it creates its own read-only tool role).
DATABASES: dict[str, bool] = {"fleet": False, "fleet_data": True}

# Postgres connections: the embedded server allows PG_MAX_CONNECTIONS, 3 of them kept for the
# superuser. Each database has a CONNECTION LIMIT (all its roles together), and so does its owner
# role, so that no service, and no caller's load on one, takes the connections the others need. The
# sums leave room for the superuser and for operators (docs/limits.md has the arithmetic). Roles that
# services create carry their own limits (mcp_servers._pg, mcp-sql's tenant roles).
PG_MAX_CONNECTIONS = 200
DATABASE_CONNECTION_LIMITS: dict[str, int] = {
    "fleet": 80,  # the coordinator (8 + 2 ingest + 4 + 1 LISTEN) and the workers (12 each at concurrency 4)
    "fleet_data": 100,  # mcp-sql tenant pools (16 x 4), mcp-cases and mcp-outbox (10 each), owners
}
OWNER_CONNECTION_LIMITS: dict[str, int] = {"fleet": 80, "fleet_data": 10}

# The operator (``fleet token``, ``fleet status``, the demo acting as an outside agent) is enrolled
# from its public key when the registry starts; it may ask for any scope and any tenant.
OPERATOR_ID = "operator"
OPERATOR_SCOPES: tuple[str, ...] = ("*",)


def stack_services(workers: int = DEFAULT_WORKERS) -> tuple[ServiceSpec, ...]:
    """The services of a stack with ``workers`` worker processes."""
    if workers < 1:
        raise ValueError("a stack needs at least one worker")
    others = tuple(spec for spec in SERVICES if spec.kind != "worker")
    return (*others, *(worker(n) for n in range(1, workers + 1)))


def service(service_id: str) -> ServiceSpec:
    for spec in SERVICES:
        if spec.id == service_id:
            return spec
    match = _WORKER_ID.fullmatch(service_id)
    if match:
        return worker(int(match.group(1)))
    raise KeyError(service_id)


_WORKER_ID = re.compile(r"worker-([1-9][0-9]{0,2})")
