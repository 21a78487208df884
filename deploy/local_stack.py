"""The services that ``fleet up`` starts, in start order, with what each may ask the token service for.

Entries name the service's entry point as ``module:function`` so that the supervisor (and
``fleet serve``) can start it without importing it here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ServiceKind = Literal["registry", "coordinator", "worker", "specialist", "mcp_server", "console"]


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """One service process of the local stack."""

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


REGISTRY = ServiceSpec("registry", "registry", "registry.server:main")
DEFAULT_WORKERS = 2  # ``FLEET_WORKERS`` starts another number


def worker(n: int) -> ServiceSpec:
    """Worker ``n`` (1-based): workers share the work queue, so any number of them may run."""
    return ServiceSpec(
        f"worker-{n}",
        "worker",
        "coordinator.engine.worker:main",
        scopes=("registry:read", "agent:invoke", "memory:consolidate"),  # a completed run's memory
        database="fleet",
    )


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
    ),
    ServiceSpec(
        "mcp-outbox",
        "mcp_server",
        "mcp_servers.outbox.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
        database="fleet_data",
    ),
    ServiceSpec(
        "mcp-memory",
        "mcp_server",
        "mcp_servers.memory.server:main",
        scopes=("registry:read", "registry:write"),
        mcp_path="/mcp",
    ),
    ServiceSpec(
        "sql-analyst",
        "specialist",
        "specialists.sql_analyst.agent:main",
        scopes=("registry:read", "registry:write", "sql:query", *MEMORY),
        skills=("reconcile-invoices", "invoice-totals", "sql-query"),
    ),
    ServiceSpec(
        "stats",
        "specialist",
        "specialists.stats.agent:main",
        scopes=("registry:read", "registry:write", *MEMORY),
        skills=("outliers",),
    ),
    ServiceSpec(
        "case-desk",
        "specialist",
        "specialists.case_desk.agent:main",
        scopes=("registry:read", "registry:write", "cases:write", *MEMORY),
        skills=("post-note", "open-review-cases", "issue-refund"),
    ),
    *(
        ServiceSpec(
            replica,
            "specialist",
            "specialists.code_runner.agent:main",
            scopes=("registry:read", "registry:write", "sandbox:run", *MEMORY),
            skills=("score-anomalies", "run-python"),
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
    ),
    ServiceSpec(
        "publisher",
        "specialist",
        "specialists.publisher.agent:main",
        scopes=("registry:read", "registry:write", "outbox:write", *MEMORY),
        skills=("publish-report",),
    ),
    ServiceSpec(
        "coordinator",
        "coordinator",
        "coordinator.server:main",
        scopes=("registry:read", "registry:write", "agent:invoke"),
        skills=("orchestrate",),
        database="fleet",
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
