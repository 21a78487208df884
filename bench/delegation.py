"""Delegation overhead per step: a step sent through the operations ledger vs a bare a2a-sdk round trip.

Both sides call the same running specialist (the statistician's ``outliers`` skill on inline records,
so no database work on its side) of a real local stack, interleaved in one run, with a token obtained
once (the platform caches tokens too):

* baseline: what any durable delegation must do at least: a durable intent (one row of the
  operation's id and arguments inserted and committed, on the same Postgres) and the a2a-sdk client
  alone: one streaming ``SendMessage`` and its events to the end;
* fleet: ``StepDispatcher.run``, what a worker does per step: the ledger's durable intent (fenced by
  the run's lease), the call with its operation id (which the specialist journals before and after
  the skill), and the durable result.

Checkpoints are not part of either side (the checkpoint benchmark measures them). Target (cost per
run): fleet <= 1.3x the baseline. The bare round trip alone is reported beside it (the earlier target
was 1.5x of that).

Run: ``.venv/bin/python -m bench.delegation`` (starts and stops its own stack).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.helpers import new_data_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest
from google.protobuf.json_format import ParseDict
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from coordinator.engine.delegation import INVOKE_SCOPE, Delegator
from coordinator.engine.dispatch import RunScope, StepDispatcher
from coordinator.record.operations import Ledger
from coordinator.record.runs import PlanStep, PostgresRunStore
from fleet.settings import ServiceSettings
from fleetctl.layout import StackLayout
from fleetctl.testing.stack import running_stack
from registry import RegistryClient

CALLS = 60
ROUNDS = 5
TARGET_RATIO = 1.3
TENANT = "bench"
AGENT = "stats"
PAYLOAD = {
    "records": [{"name": f"r{i}", "x": v} for i, v in enumerate([1, 2, 1, 2, 1, 40, 2, 1])],
    "field": "x",
    "label": "name",
}


async def _bare_call(client: Any, context: ClientCallContext) -> None:
    message = Message(
        role=Role.ROLE_USER,
        message_id=uuid.uuid4().hex,
        parts=[new_data_part({"skill": "outliers", "input": PAYLOAD})],
    )
    async for _ in client.send_message(SendMessageRequest(message=message), context=context):
        pass


async def measure(layout: StackLayout, endpoints: dict[str, Any], dsn: str) -> dict[str, Any]:
    # The benchmark acts as worker-1 (its key is in the data dir; the registry enrolled it).
    settings = ServiceSettings(
        service_id="worker-1",
        home=layout.home,
        key_file=layout.key_file("worker-1"),
        public_url="http://127.0.0.1:9",
        registry_url=endpoints["registry"],
        operator_jwk_file=layout.operator_jwk_file,
    )
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, max_size=4, open=False, kwargs={"autocommit": True}
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http, pool:
        registry = RegistryClient(settings, http)
        store, ledger = PostgresRunStore(pool), Ledger(pool)
        await store.setup()
        await ledger.setup()
        delegator = Delegator(registry, http)
        agent = await delegator.agent(AGENT)
        token = await registry.tokens.token(AGENT, TENANT, [INVOKE_SCOPE])
        context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
        client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(
            ParseDict(agent.card, AgentCard(), ignore_unknown_fields=True)
        )

        async def progress(text: str) -> None:
            return None

        async with pool.connection() as conn:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS bench_intents (op_id text PRIMARY KEY, args jsonb NOT NULL)"
            )

        async def bare_round(durable: bool) -> float:
            started = time.perf_counter()
            for _ in range(CALLS):
                if durable:  # the intent, committed before the send
                    async with pool.connection() as conn:
                        await conn.execute(
                            "INSERT INTO bench_intents VALUES (%s, %s)", (uuid.uuid4().hex, Jsonb(PAYLOAD))
                        )
                await _bare_call(client, context)
            return (time.perf_counter() - started) / CALLS

        async def fleet_round() -> float:
            run_id = f"bench-{uuid.uuid4().hex}"
            plan: list[PlanStep] = [
                {"id": f"s{i}", "skill": "outliers", "input": PAYLOAD, "after": []} for i in range(CALLS)
            ]
            await store.create_run(run_id, TENANT, "bench", {}, plan)
            lease = await store.acquire_lease(run_id, "bench", 300)
            assert lease is not None
            scope = RunScope(ledger, lease, "bench")
            started = time.perf_counter()
            for i in range(CALLS):
                dispatcher = StepDispatcher(
                    delegator,
                    scope,
                    step_id=f"s{i}",
                    skill="outliers",
                    payload=PAYLOAD,
                    tenant=TENANT,
                    progress=progress,
                )
                result = await dispatcher.run(agent)
                assert result["outliers"], result
            elapsed = (time.perf_counter() - started) / CALLS
            await store.release_lease(lease)
            return elapsed

        async def call_round(journaled: bool) -> float:
            """The delegator's call alone (no ledger), with or without an operation id (which makes
            the specialist journal the operation): where the time goes."""
            started = time.perf_counter()
            for _ in range(CALLS):
                op_id = f"op-{uuid.uuid4().hex}" if journaled else None
                await delegator.call(
                    agent, "outliers", PAYLOAD, tenant=TENANT, progress=progress, operation_id=op_id
                )
            return (time.perf_counter() - started) / CALLS

        await bare_round(durable=True)  # warm up every path
        await fleet_round()
        bares, intents, ours, plain_calls, journaled_calls = [], [], [], [], []
        for _ in range(ROUNDS):
            bares.append(await bare_round(durable=False))
            intents.append(await bare_round(durable=True))
            ours.append(await fleet_round())
            plain_calls.append(await call_round(journaled=False))
            journaled_calls.append(await call_round(journaled=True))
        await client.close()
    bare_ms, fleet_ms = statistics.median(bares) * 1000, statistics.median(ours) * 1000
    intent_ms = statistics.median(intents) * 1000
    plain_ms, journaled_ms = statistics.median(plain_calls) * 1000, statistics.median(journaled_calls) * 1000
    return {
        "benchmark": "delegation_overhead",
        "calls_per_round": CALLS,
        "rounds": ROUNDS,
        "baseline": "a bare a2a-sdk streaming round trip to the same specialist, after a durable intent",
        "baseline_ms_per_step": round(intent_ms, 3),
        "fleet_ms_per_step": round(fleet_ms, 3),
        "ratio": round(fleet_ms / intent_ms, 2),
        "target_ratio": TARGET_RATIO,
        "bare_round_trip_ms": round(bare_ms, 3),
        "ratio_to_bare_round_trip": round(fleet_ms / bare_ms, 2),
        "breakdown_ms": {
            "delegator_call_without_operation_id": round(plain_ms, 3),
            "delegator_call_with_operation_id": round(journaled_ms, 3),
            "ledger_intent_and_result": round(fleet_ms - journaled_ms, 3),
        },
    }


@contextmanager
def _stack() -> Iterator[tuple[StackLayout, dict[str, Any], str]]:
    with (
        TemporaryDirectory(prefix="fleet-bench-") as tmp,
        running_stack(Path(tmp) / "fleet") as (layout, endpoints),
    ):
        password = (layout.keys_dir / "postgres-password.secret").read_text().strip()
        yield (
            layout,
            endpoints,
            f"postgresql://postgres:{password}@127.0.0.1:{endpoints['postgres_port']}/fleet",
        )


def main() -> dict[str, Any]:
    with _stack() as (layout, endpoints, dsn):
        result = asyncio.run(measure(layout, endpoints, dsn))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
