"""Sustained runs per second with 2 workers and then 1, and how long a run takes to resume after its
worker is killed, on a real local stack.

* throughput: ``RUNS`` one-step runs (the statistician's ``outliers`` on inline records) sent at once
  over A2A; runs/s is their number over the time from the first send to the last completion. First
  with both workers of the stack, then with one (the other stopped).
* resume-from-crash latency: a run whose step takes two seconds; its worker is SIGKILLed once the step
  has started, and the latency is the time from the kill to the ``run.resumed`` event of the worker
  that takes over (and to the run's completion). It is bounded by the lease and JetStream's ack wait,
  which the stack here sets short (``FLEET_LEASE_TTL_S=3``, ``FLEET_ACK_WAIT_S=6``; the defaults are 15
  and 30 s).

Run: ``.venv/bin/python -m bench.throughput`` (starts and stops its own stack).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.helpers import new_data_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest, TaskState
from google.protobuf.json_format import ParseDict

from fleetctl.cli_common import operator_token_client
from fleetctl.layout import StackLayout
from fleetctl.testing.stack import running_stack

RUNS = 40
LEASE_TTL_S, ACK_WAIT_S = 3, 6
INLINE = {
    "steps": [
        {
            "id": "outliers",
            "skill": "outliers",
            "input": {
                "records": [{"name": f"r{i}", "x": v} for i, v in enumerate([1, 2, 1, 2, 40, 1])],
                "field": "x",
                "label": "name",
            },
        }
    ]
}
SLOW = {
    "steps": [{"id": "slow", "skill": "sql-query", "input": {"sql": "SELECT pg_sleep(2) IS NULL AS slept"}}]
}


def _message(plan: dict[str, Any]) -> Message:
    return Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex, parts=[new_data_part(plan)])


class Fleet:
    def __init__(self, layout: StackLayout, endpoints: dict[str, Any], http: httpx.AsyncClient) -> None:
        self.layout, self.endpoints, self.http = layout, endpoints, http
        self.tokens = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)

    async def context(self, tenant: str = "acme") -> ClientCallContext:
        token = await self.tokens.token("coordinator", tenant, ["agent:invoke"])
        return ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})

    async def run(self, plan: dict[str, Any], tenant: str = "acme") -> str:
        """Send one run and follow it to its end; return its id."""
        card = (await self.http.get(self.endpoints["coordinator"] + "/.well-known/agent-card.json")).json()
        client = ClientFactory(ClientConfig(streaming=True, httpx_client=self.http)).create(
            ParseDict(card, AgentCard(), ignore_unknown_fields=True)
        )
        state, task_id = TaskState.TASK_STATE_UNSPECIFIED, ""
        async for event in client.send_message(
            SendMessageRequest(message=_message(plan)), context=await self.context(tenant)
        ):
            kind = event.WhichOneof("payload")
            if kind == "task":
                task_id = event.task.id
            elif kind == "status_update":
                state = event.status_update.status.state
        await client.close()
        if state != TaskState.TASK_STATE_COMPLETED:
            raise RuntimeError(f"run {task_id} ended {TaskState.Name(state)}")
        return task_id

    async def newest_run(self, tenant: str) -> str:
        """The id of the tenant's newest run, once it exists."""
        ctx = await self.context(tenant)
        while True:
            listed = await self.http.get(
                self.endpoints["coordinator"] + "/v1/runs", headers=ctx.service_parameters
            )
            runs = listed.json()["runs"]
            if runs:
                return str(runs[0]["run_id"])
            await asyncio.sleep(0.05)

    async def first_event(
        self,
        run_id: str,
        type_: str,
        where: Callable[[dict[str, Any]], bool] = lambda event: True,
        tenant: str = "acme",
    ) -> dict[str, Any]:
        """The run's first event of ``type_`` (that ``where`` accepts), as soon as it is committed."""
        ctx = await self.context(tenant)
        url = f"{self.endpoints['coordinator']}/v1/runs/{run_id}/events"
        async with self.http.stream("GET", url, headers=ctx.service_parameters) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    event: dict[str, Any] = json.loads(line[6:])
                    if event["type"] == type_ and where(event):
                        return event
        raise RuntimeError(f"run {run_id} ended without {type_}")

    async def events(self, run_id: str, tenant: str = "acme") -> list[dict[str, Any]]:
        """Every event of a run that has ended."""
        ctx = await self.context(tenant)
        response = await self.http.get(
            f"{self.endpoints['coordinator']}/v1/runs/{run_id}/events", headers=ctx.service_parameters
        )
        return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


async def runs_per_second(fleet: Fleet) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(fleet.run(INLINE) for _ in range(RUNS)))
    return RUNS / (time.perf_counter() - started)


async def resume_latency(fleet: Fleet) -> dict[str, float]:
    running = asyncio.create_task(fleet.run(SLOW))
    ctx = await fleet.context()
    run_id = ""
    while not run_id:  # the newest run of the tenant is ours
        runs = (
            await fleet.http.get(fleet.endpoints["coordinator"] + "/v1/runs", headers=ctx.service_parameters)
        ).json()
        run_id = next((r["run_id"] for r in runs["runs"] if r["state"] == "working"), "")
        await asyncio.sleep(0.05)
    started = await fleet.first_event(run_id, "step.started")
    victim = fleet.endpoints["processes"][started["actor"].split(":")[0]]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    await running
    events = await fleet.events(run_id)
    resumed = next((e for e in events if e["type"] == "run.resumed"), None)
    if resumed is None:
        raise RuntimeError(
            f"run {run_id} was not resumed: {[(e['type'], e['actor']) for e in events]}, killed {victim}"
        )
    completed = next(e for e in events if e["type"] == "run.completed")

    def since_kill(event: dict[str, Any]) -> float:
        return round(dt.datetime.fromisoformat(event["ts"]).timestamp() - killed_at, 2)

    return {"to_resumed_s": since_kill(resumed), "to_completed_s": since_kill(completed)}


async def measure(layout: StackLayout, endpoints: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
        fleet = Fleet(layout, endpoints, http)
        await fleet.run(INLINE)  # warm up
        two = [await runs_per_second(fleet) for _ in range(3)]
        latency = await resume_latency(fleet)  # kills one worker: the rest runs on the other
        one = [await runs_per_second(fleet) for _ in range(3)]
    return {
        "benchmark": "throughput",
        "runs_per_round": RUNS,
        "runs_per_s_2_workers": round(sorted(two)[1], 1),
        "runs_per_s_1_worker": round(sorted(one)[1], 1),
        "scaling_2_vs_1": round(sorted(two)[1] / sorted(one)[1], 2),
        "resume_latency": latency,
        "lease_ttl_s": LEASE_TTL_S,
        "ack_wait_s": ACK_WAIT_S,
    }


def main() -> dict[str, Any]:
    with (
        TemporaryDirectory(prefix="fleet-bench-") as tmp,
        running_stack(
            Path(tmp) / "fleet", FLEET_LEASE_TTL_S=str(LEASE_TTL_S), FLEET_ACK_WAIT_S=str(ACK_WAIT_S)
        ) as (layout, endpoints),
    ):
        result = asyncio.run(measure(layout, endpoints))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
