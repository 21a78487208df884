"""The coordinator service process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentSkill
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette

from coordinator import work
from coordinator.delegation import INVOKE_SCOPE, Delegator
from coordinator.executor import CoordinatorExecutor
from coordinator.graph import checkpoint_pool
from coordinator.handler import CoordinatorRequestHandler
from coordinator.operations import Ledger
from coordinator.run_api import RUNS_PREFIX, run_routes
from coordinator.runs import PostgresRunStore
from fleet.a2a_support import (
    RPC_PATH,
    a2a_app,
    build_card,
    sign_card,
)
from fleet.service import Readiness, configure_logging, serve_app, start_in_background
from fleet.settings import ServiceSettings
from policy import RegorusEngine
from registry import RegistryClient

VERSION = "0.1.0"

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


def build_app(settings: ServiceSettings) -> Starlette:
    http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0))
    registry = RegistryClient(settings, http)
    engine = RegorusEngine.from_dir(settings.policy_dir)
    delegator = Delegator(registry, http)
    card = build_card(
        name="Fleet coordinator",
        description="Plans work and delegates each step to a specialist agent of the fleet.",
        version=VERSION,
        base_url=settings.public_url,
        skills=SKILLS,
        token_url=registry.token_url,
        required_scope=INVOKE_SCOPE,
    )
    card = sign_card(card, registry.key, jku=registry.own_keys_url)
    run_pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        settings.pg_dsn, max_size=10, open=False, kwargs={"autocommit": True}
    )
    runs = PostgresRunStore(run_pool)
    ledger = Ledger(run_pool)
    pool_for_checkpoints = checkpoint_pool(settings.pg_dsn, max_size=4)
    saver = AsyncPostgresSaver(pool_for_checkpoints)  # read here (debug bundles); workers write
    submitter = work.RunSubmitter(settings.nats_url, settings.service_id)
    handler = CoordinatorRequestHandler(
        agent_executor=CoordinatorExecutor(
            delegator, engine, runs, submitter.submit, listen_dsn=settings.pg_dsn
        ),
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )
    readiness = Readiness(settings.service_id, "coordinator")

    async def start() -> None:
        await registry.join_as_agent(settings.public_url)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(http)
            await stack.enter_async_context(run_pool)
            await stack.enter_async_context(pool_for_checkpoints)
            await runs.setup()
            await ledger.setup()
            await saver.setup()
            await stack.enter_async_context(submitter)
            stack.push_async_callback(handler.aclose)  # runs before the pool and client close
            await stack.enter_async_context(start_in_background(readiness, start))
            yield

    return a2a_app(
        card=card,
        handler=handler,
        readiness=readiness,
        verifier=registry.verifier(),
        required_scope=INVOKE_SCOPE,
        lifespan=lifespan,
        extra_routes=run_routes(runs, ledger, submitter.submit, settings.pg_dsn, saver, engine.revision),
        protected_prefixes=(RPC_PATH, RUNS_PREFIX),
    )


async def main(settings: ServiceSettings) -> None:
    configure_logging(settings.service_id, settings.log_level)
    await serve_app(build_app(settings), settings)
