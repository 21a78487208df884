"""The coordinator service process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any

import httpx
from a2a.types import AgentSkill
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from coordinator.a2a_surface.card import (
    JWKS_PATH,
    ExtendedCardForCaller,
    extended_card,
    with_fleet_capabilities,
)
from coordinator.a2a_surface.executor import CoordinatorExecutor
from coordinator.a2a_surface.handler import CoordinatorRequestHandler
from coordinator.a2a_surface.push import PostgresPushConfigStore, PushDispatcher, PushSigner, PushUrlPolicy
from coordinator.a2a_surface.task_store import PostgresTaskStore, sweep_retention
from coordinator.control.metrics import coordinator_metrics
from coordinator.control.run_api import RUNS_PREFIX, run_routes
from coordinator.control.signals import SIGNAL_GRANT, SignalDesk, SignalIngest
from coordinator.control.streams import KEEPALIVE_S, Streams, StreamSlots, a2a_keepalives
from coordinator.control.triggers import TriggerIngest
from coordinator.engine.delegation import INVOKE_SCOPE, Delegator
from coordinator.engine.graph import checkpoint_pool
from coordinator.engine.workflows import load_workflows
from coordinator.planning.llm_planner import llm_planner
from coordinator.planning.plan import WORKFLOW_SKILL_PREFIX
from coordinator.record import work
from coordinator.record.access import RunAccess
from coordinator.record.checkpoints import CompactCheckpointer
from coordinator.record.notifier import RunNotifier
from coordinator.record.operations import Ledger
from coordinator.record.runs import PostgresRunStore
from fleet import mcp_client, pgpool, telemetry, transport
from fleet.a2a_grpc import GrpcBinding
from fleet.a2a_support import (
    A2A_PATHS,
    a2a_app,
    a2a_body_limit,
    build_card,
    sign_card,
)
from fleet.approvals import ApprovalBinding
from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.natsconn import service_credentials
from fleet.outbound import guarded_client
from fleet.service import Readiness, configure_logging, serve_app, start_in_background
from fleet.settings import ServiceSettings
from policy.live import enforcing, live_policy
from registry import RegistryClient

VERSION = "0.1.0"
# Postgres connections of the process (with the checkpoints' 4 and the LISTEN connection: 15, which
# deploy/local_stack.py DATABASE_CONNECTION_LIMITS counts): callers' requests and the run record,
# and the trigger ingest's own.
RUN_POOL_SIZE, INGEST_POOL_SIZE = 8, 2

SKILLS = [
    AgentSkill(
        id="orchestrate",
        name="Plan and delegate",
        description=(
            'Runs a plan over the fleet\'s specialists. Send a data part {"steps": [{"id", "skill", '
            '"input"}]} (an input value {"$from": "step.field"} takes an earlier step\'s result), or '
            "text that a routing rule in policy recognises."
        ),
        tags=["orchestration"],
        examples=["Find outliers in this month's invoices"],
    )
]


def workflow_skills(workflows: Mapping[str, str]) -> list[AgentSkill]:
    """A skill of the card per registered workflow (``workflow:NAME``), started by name."""
    return [
        AgentSkill(
            id=f"{WORKFLOW_SKILL_PREFIX}{name}",
            name=name,
            description=f'The workflow {name}. Send a data part {{"workflow": "{name}", "input": {{...}}}}.',
            tags=["workflow"],
        )
        for name in sorted(workflows)
    ]


class CoordinatorSettings(ServiceSettings):
    """The coordinator API's own settings (``FLEET_*``)."""

    push_allowed_hosts: str = ""  # comma-separated hosts (or host:port) that may be private/loopback
    push_max_attempts: int = 8
    event_retention_s: float | None = None  # unset: keep every event of every run
    retention_sweep_s: float = 300.0
    # Seconds between keep-alive comments on an idle event stream (run API SSE and A2A streams).
    stream_keepalive_s: float = KEEPALIVE_S

    @property
    def allowed_push_hosts(self) -> list[str]:
        return [host for host in self.push_allowed_hosts.split(",") if host.strip()]


def jwks_route(key: SigningKey) -> Route:
    """The coordinator's public keys: receivers of its push notifications verify them with these."""

    async def jwks(request: Request) -> JSONResponse:
        return JSONResponse({"keys": [key.public_jwk()]}, headers={"Cache-Control": "max-age=300"})

    return Route(JWKS_PATH, jwks)


@contextlib.asynccontextmanager
async def background(*jobs: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    """Run ``jobs`` for as long as the block lasts; cancel and await them on the way out."""
    tasks = [asyncio.create_task(job()) for job in jobs]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def agent_records(registry: RegistryClient) -> Callable[[], Awaitable[list[dict[str, Any]]]]:
    """The registry's agent records as JSON, asked when a debug bundle is made."""

    async def records() -> list[dict[str, Any]]:
        return [a.model_dump(mode="json") for a in await registry.agents()]

    return records


log = logging.getLogger(__name__)

SANDBOX_SERVER, SANDBOX_LIST = "mcp-sandbox", "sandbox:list"
WORKSPACE_TIMEOUT_S = 10.0


def workspace_listing(registry: RegistryClient) -> Callable[[str, str], Awaitable[dict[str, Any]]]:
    """A run's workspace as the sandbox lists it, asked when a debug bundle is made: with a token
    for that tenant and that run only, and the one scope that lists (the coordinator neither runs code
    nor reads what the files hold).
    Anything that keeps it from being listed is the listing's ``error``, never the bundle's."""

    async def listing(tenant: str, run_id: str) -> dict[str, Any]:
        try:
            server = await registry.mcp_server(SANDBOX_SERVER)
            token = await registry.tokens.token(SANDBOX_SERVER, tenant, [SANDBOX_LIST], run_id=run_id)
            async with asyncio.timeout(WORKSPACE_TIMEOUT_S):
                result = await mcp_client.call_tool(
                    server.url, "workspace_files", {}, token=token, http_timeout=WORKSPACE_TIMEOUT_S
                )
            return {"files": mcp_client.structured(result)}
        except FleetError as exc:
            return {"error": exc.to_dict()}
        except Exception as exc:  # the sandbox away or slow: the bundle says so and goes on
            log.warning("run %s: its workspace could not be listed (%s: %s)", run_id, type(exc).__name__, exc)
            why = f"the sandbox could not be asked: {type(exc).__name__}"
            return {"error": FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, why, retryable=True).to_dict()}

    return listing


def build_app(settings: CoordinatorSettings) -> Starlette:
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0), event_hooks=transport.hooks())
    registry = RegistryClient(settings, http)
    engine = live_policy(settings)
    push_http = guarded_client(
        "webhook",
        engine,
        local=settings.local_stack,
        private_hosts=settings.allowed_push_hosts,
        event_hooks=transport.hooks(),
    )
    delegator = Delegator(registry, http, engine=engine)  # routing policy, before a run is accepted
    a2a_verifier = registry.federated_verifier()  # outside callers: over A2A only, on any binding
    grpc = GrpcBinding.bind(settings, a2a_verifier, INVOKE_SCOPE)
    card = build_card(
        name="Fleet coordinator",
        description="Plans work and delegates each step to a specialist agent of the fleet.",
        version=VERSION,
        base_url=settings.public_url,
        skills=[*SKILLS, *workflow_skills(settings.workflows)],
        token_url=registry.token_url,
        required_scope=INVOKE_SCOPE,
        grpc_url=grpc.url if grpc else None,
    )
    card = with_fleet_capabilities(card, settings.public_url, settings.service_id)
    extended = extended_card(card, settings.event_retention_s)
    card = sign_card(card, registry.key, jku=registry.own_keys_url)
    run_pool = pgpool.pool(settings.pg_dsn, max_size=RUN_POOL_SIZE, kwargs={"autocommit": True})
    runs = PostgresRunStore(run_pool)
    # Triggered runs are admitted on connections of their own: an event flood (a tenant's 10,000
    # events, 16 admitted at once) queues behind these, not in front of the callers' requests.
    ingest_pool = pgpool.pool(
        settings.pg_dsn, min_size=1, max_size=INGEST_POOL_SIZE, kwargs={"autocommit": True}
    )
    # The process's one LISTEN connection: every stream, cancel and the push dispatcher share it.
    notifier = RunNotifier(settings.pg_dsn)
    streams = Streams(notifier, StreamSlots(engine), settings.stream_keepalive_s)
    a2a_keepalives(settings.stream_keepalive_s)
    ledger = Ledger(run_pool)
    access = RunAccess(engine)
    tasks = PostgresTaskStore(run_pool, runs, access)
    policy = PushUrlPolicy(settings.allowed_push_hosts)
    push_configs = PostgresPushConfigStore(run_pool, policy, access)
    dispatcher = PushDispatcher(
        run_pool,
        tasks,
        runs,
        PushSigner(registry.key, settings.service_id, settings.public_url + JWKS_PATH),
        push_http,
        max_attempts=settings.push_max_attempts,
    )
    pool_for_checkpoints = checkpoint_pool(settings.pg_dsn, max_size=4)
    saver = CompactCheckpointer(pool_for_checkpoints)  # read here (debug bundles); workers write
    submitter = work.RunSubmitter(
        settings.nats_url,
        settings.service_id,
        replicas=settings.nats_replicas,
        credentials=service_credentials(settings),
    )

    async def approval_grant(binding: ApprovalBinding, tenant: str, token: str, kind: str) -> str:
        return await registry.tokens.approval_grant(binding, tenant, approver_token=token, approver_type=kind)

    desk = SignalDesk(run_pool, runs, engine, submitter.submit, approval_grant)
    executor = CoordinatorExecutor(
        delegator,
        engine,
        runs,
        tasks,
        submitter.submit,
        streams=streams,
        desk=desk,
        planner=llm_planner(settings, http, registry),  # None without an LLM: routing rules only
        workflows=frozenset(load_workflows(settings.workflows)),  # refused here if one does not compile
    )
    handler = CoordinatorRequestHandler(
        tasks=tasks,
        runs=runs,
        desk=desk,
        streams=streams,
        agent_executor=executor,
        agent_card=card,
        push_config_store=push_configs,
        extended_agent_card=extended,
        extended_card_modifier=ExtendedCardForCaller(registry.key, registry.own_keys_url),
    )
    readiness = Readiness(settings.service_id, "coordinator")
    jobs: list[Callable[[], Coroutine[Any, Any, None]]] = [lambda: dispatcher.run(notifier)]
    jobs.append(executor.resubmit_forever)
    jobs.append(lambda: TriggerIngest(submitter.client, PostgresRunStore(ingest_pool), engine).run())
    grants = registry.verifier(grant=SIGNAL_GRANT)
    jobs.append(lambda: SignalIngest(submitter.client, desk, grants).run())
    if settings.event_retention_s is not None:
        retention_s = settings.event_retention_s
        jobs.append(lambda: sweep_retention(tasks, retention_s, settings.retention_sweep_s))

    async def start() -> None:
        await registry.join_as_agent(settings.public_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            stack.push_async_callback(registry.aclose)
            await stack.enter_async_context(push_http)
            await stack.enter_async_context(run_pool)
            await stack.enter_async_context(ingest_pool)
            await stack.enter_async_context(pool_for_checkpoints)
            await stack.enter_async_context(notifier)
            await runs.setup()
            await ledger.setup()
            await tasks.setup()
            await push_configs.setup()
            await saver.setup()
            await desk.setup()
            await registry.ready_for_bus()
            await stack.enter_async_context(submitter)
            telemetry.on_scrape(coordinator_metrics(runs, lambda: submitter.client))
            await stack.enter_async_context(enforcing(engine, submitter.client))
            stack.push_async_callback(handler.aclose)  # runs before the pool and client close
            await stack.enter_async_context(background(*jobs))
            await stack.enter_async_context(start_in_background(readiness, start))
            yield

    return a2a_app(
        card=card,
        handler=handler,
        readiness=readiness,
        verifier=registry.verifier(),
        rpc_verifier=a2a_verifier,
        required_scope=INVOKE_SCOPE,
        lifespan=lifespan,
        extra_routes=[
            jwks_route(registry.key),
            *run_routes(
                runs,
                ledger,
                submitter.submit,
                streams,
                saver,
                engine,
                desk,
                agent_records(registry),
                start=executor.start_from_api,
                workspace_of=workspace_listing(registry),
            ),
        ],
        protected_prefixes=(*A2A_PATHS, RUNS_PREFIX),
        grpc=grpc,
    )


async def main(settings: ServiceSettings) -> None:
    coordinator_settings = CoordinatorSettings.from_env(settings.service_id)
    configure_logging(coordinator_settings.service_id, coordinator_settings.log_level)
    await serve_app(
        build_app(coordinator_settings), coordinator_settings, [a2a_body_limit(coordinator_settings)]
    )
