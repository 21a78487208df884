"""``fleet demo``: a night of invoice reconciliation for two tenants, on the whole platform.

1. As an outside agent would, it fetches the coordinator's A2A card, verifies its signature and gets a
   token from the token endpoint the card names.
2. As the billing system would, it publishes the night's settled invoices of ``acme`` and ``globex`` on
   NATS (``fleet.events.<tenant>.billing.billing.invoice_settled``: source ``billing``, logical subject
   ``fleet.events.billing.invoice_settled``), then each tenant's ``day_closed`` event. The
   trigger policy gathers each tenant's events into one batch run.
3. It follows both runs: the SQL analyst reconciles the invoices with the payments in the tenant's
   data (through the SQL MCP server, confined to the tenant by its database login), the code runner
   scores anomalies in the sandbox, the publisher publishes the report through the outbox (once), and
   the researcher keeps the findings in memory (through the memory gate, personal data redacted).
4. A report whose anomaly score is over the policy's threshold waits for a person. With
   ``--auto-approve`` the demo approves it as the operator; otherwise it says how to approve, and the
   run, holding no process, resumes when you do.
5. It asks the coordinator over A2A what the night found, and prints the answer from memory.

It exits non-zero with a clear message if anything fails.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
from a2a.client import (
    A2ACardResolver,
    A2AClientError,
    ClientCallContext,
    ClientConfig,
    ClientFactory,
)
from a2a.helpers import get_data_parts, get_text_parts, new_data_part, new_text_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest, TaskState
from a2a.utils.errors import A2AError
from a2a.utils.signing import SignatureVerificationError, create_signature_verifier

from fleet import transport
from fleet.errors import ErrorCode, FleetError
from fleet.keys import ALGORITHM
from fleet.natsconn import stream_replicas
from fleet.tokens import TokenClient
from fleet.vocabulary import ENDING, EventType
from fleetctl.cli_common import operator_token_client, running_endpoints, stack_running
from fleetctl.detached import up_detached
from fleetctl.layout import StackLayout

RULE = "invoice-reconciliation"  # the batch trigger of policy/bundles/fleet/data.json
SETTLED = "fleet.events.billing.invoice_settled"
CLOSED = "fleet.events.billing.day_closed"
TENANTS = ("acme", "globex")
# The night's settled invoices, as the billing system reports them (the payments they are reconciled
# against are in each tenant's data: mcp_servers/sql/_schema.py DEMO_PAYMENTS).
NIGHT: dict[str, list[dict[str, Any]]] = {
    "acme": [
        {"invoice": "INV-A-1001", "customer": "Northwind", "amount": 1180.00},
        {
            "invoice": "INV-A-1002",
            "customer": "Contoso",
            "amount": 995.00,
            "contact": "billing@contoso.example, +1 415 555 0134",
        },
        {
            "invoice": "INV-A-1003",
            "customer": "Fabrikam",
            "amount": 14250.00,
            "contact": "ravi.patel@fabrikam.example, +44 20 7946 0958",
        },
        {"invoice": "INV-A-1004", "customer": "Tailspin", "amount": 1060.00},
        {"invoice": "INV-A-1005", "customer": "Northwind", "amount": 1210.00},
    ],
    "globex": [
        {"invoice": "INV-G-2001", "customer": "Initech", "amount": 460.00},
        {"invoice": "INV-G-2002", "customer": "Hooli", "amount": 520.00},
        {"invoice": "INV-G-2003", "customer": "Vandelay", "amount": 505.00},
    ],
}
ENDED = ENDING  # a rejected run ends too (this once named run.expired, which no run records)
QUESTION = "What did the invoice reconciliation find?"


def run(
    layout: StackLayout, *, keep_running: bool, auto_approve: bool = False, timeout_s: float | None = None
) -> int:
    started_here = False
    if not stack_running(layout):
        print(f"demo: starting the stack in {layout.home} ...", flush=True)
        if up_detached(layout) != 0:
            return 1
        started_here = True
    else:
        print(f"demo: using the stack already running in {layout.home}")
    try:
        return asyncio.run(_demo(layout, auto_approve, timeout_s))
    except FleetError as exc:
        print(f"demo: FAILED [{exc.code}] {exc.message}", file=sys.stderr)
        return 1
    except TimeoutError:
        print(f"demo: FAILED: the runs did not end within {timeout_s:g} s", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndemo: stopped; the runs go on (a waiting run holds no process)", file=sys.stderr)
        return 130
    finally:
        if started_here and not keep_running:
            from fleetctl.operator_cli import down

            down(layout)


@dataclass
class Night:
    """One tenant's reconciliation run, as the demo follows it."""

    tenant: str
    run_id: str = ""
    state: str = ""
    result: dict[str, Any] = field(default_factory=dict)


async def _demo(layout: StackLayout, auto_approve: bool, timeout_s: float | None) -> int:
    endpoints = running_endpoints(layout)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(10.0, read=None), event_hooks=transport.hooks()
    ) as http:
        card = await _verified_card(http, endpoints["registry"], endpoints["coordinator"])
        print(f"demo: coordinator card '{card.name}' v{card.version}: signature verified")
        flow = card.security_schemes["fleet_oauth"].oauth2_security_scheme.flows.client_credentials
        if flow.token_url != endpoints["registry"] + "/oauth/token":
            # Never hand our credentials to a token endpoint we do not already trust.
            raise FleetError(
                ErrorCode.CARD_INVALID, f"the card names an unknown token endpoint {flow.token_url}"
            )
        tokens = operator_token_client(layout, flow.token_url, http)
        api = RunApi(http, endpoints["coordinator"], tokens)
        night_of = await _next_night(api)
        since = dt.datetime.now(dt.UTC)
        print(f"demo: the billing system reports the night of {night_of:%Y-%m-%d} on NATS:")
        await _publish_night(endpoints, night_of)
        nights = [Night(tenant) for tenant in TENANTS]
        async with asyncio.timeout(timeout_s):
            for night in nights:
                night.run_id = await api.batch_run(night.tenant, since)
                print(f"demo: {night.tenant:<7}| batch run {night.run_id}")
            await asyncio.gather(*(_follow(api, night, auto_approve) for night in nights))
        for night in nights:
            _print_night(night)
        failed = [n.tenant for n in nights if n.state != EventType.RUN_COMPLETED]
        if failed:
            print(f"demo: FAILED: the runs of {', '.join(failed)} did not complete", file=sys.stderr)
            return 1
        await _ask_over_a2a(http, card, tokens, "acme")
    print("\ndemo: OK")
    return 0


class RunApi:
    """The coordinator's run API, as the operator of the data dir (a token per tenant, reaching
    every run of the tenant: the night's runs are started by a trigger, not by the operator)."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, tokens: TokenClient) -> None:
        self._http = http
        self._base = base_url
        self._tokens = tokens

    async def headers(self, tenant: str, *scopes: str) -> dict[str, str]:
        token = await self._tokens.token("coordinator", tenant, ["agent:invoke", "runs:admin", *scopes])
        return {"Authorization": f"Bearer {token}"}

    async def runs(self, tenant: str) -> list[dict[str, Any]]:
        response = await self._http.get(f"{self._base}/v1/runs", headers=await self.headers(tenant))
        response.raise_for_status()
        return list(response.json()["runs"])

    async def batch_run(self, tenant: str, since: dt.datetime) -> str:
        """The id of the tenant's reconciliation run made since ``since`` (by the night's first event)."""
        while True:
            for found in await self.runs(tenant):
                if (
                    found["owner"] == f"batch:{RULE}"
                    and dt.datetime.fromisoformat(found["created_at"]) >= since
                ):
                    return str(found["run_id"])
            await asyncio.sleep(0.2)

    async def events(self, tenant: str, run_id: str) -> AsyncIterator[dict[str, Any]]:
        """The run's events from its first, live, until it ends (reconnecting from the last seen)."""
        last = 0
        while True:
            headers = {**await self.headers(tenant), "Last-Event-ID": str(last)}
            url = f"{self._base}/v1/runs/{run_id}/events"
            async with self._http.stream("GET", url, headers=headers) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line.removeprefix("data: "))
                        last = int(event["seq"])
                        yield event
                        if event["type"] in ENDED:
                            return

    async def approve(self, tenant: str, run_id: str, awaited: str, note: str) -> None:
        """Approve what the run waits for (``awaited``), once: the signal's id is that of the wait."""
        response = await self._http.post(
            f"{self._base}/v1/runs/{run_id}/signals",
            headers=await self.headers(tenant, "runs:approve"),
            json={"action": "approve", "note": note, "awaited": awaited, "id": f"demo-{run_id}-{awaited}"},
        )
        if response.status_code != 200:
            raise FleetError(ErrorCode.INTERNAL, f"the approval was refused: {response.text[:300]}")


async def _next_night(api: RunApi) -> dt.datetime:
    """The night to reconcile: tonight on a fresh stack, the next one each time the demo runs again
    (a night's batch, once closed, takes no more invoices)."""
    done = 0
    for tenant in TENANTS:
        done = max(done, sum(1 for r in await api.runs(tenant) if r["owner"] == f"batch:{RULE}"))
    today = dt.datetime.now(dt.UTC).replace(hour=1, minute=0, second=0, microsecond=0)
    return today + dt.timedelta(days=done)


async def _publish_night(endpoints: dict[str, Any], night_of: dt.datetime) -> None:
    from fleet.events import publish_event
    from fleet.natsconn import connect
    from fleetctl.cli_common import operator_bus_credentials

    client = await connect(
        str(endpoints["nats"]),
        "fleet-demo",
        replicas=stream_replicas(endpoints),
        credentials=operator_bus_credentials(endpoints),
    )
    try:
        for tenant, invoices in NIGHT.items():
            for invoice in invoices:
                event_id = f"{tenant}-{invoice['invoice']}-{night_of:%Y%m%d}"
                await publish_event(
                    client,
                    SETTLED,
                    tenant=tenant,
                    source="billing",
                    type_="invoice.settled",
                    data=invoice,
                    event_id=event_id,
                    time=night_of,
                )
            print(f"demo: {tenant:<7}| {len(invoices)} invoices settled, then the day closes")
            await publish_event(
                client,
                CLOSED,
                tenant=tenant,
                source="billing",
                type_="day.closed",
                # How many invoices it sent: the close waits until the batch holds them all.
                data={"window_of": night_of.isoformat(), "count": len(invoices)},
                event_id=f"{tenant}-closed-{night_of:%Y%m%d}",
                time=night_of,
            )
    finally:
        await client.drain()


async def _follow(api: RunApi, night: Night, auto_approve: bool) -> None:
    started = time.monotonic()
    async for event in api.events(night.tenant, night.run_id):
        payload = event.get("payload") or {}
        text = _line(event["type"], payload)
        if text:
            print(f"demo: {night.tenant:<7}| {time.monotonic() - started:6.2f}s {text}", flush=True)
        if event["type"] == EventType.ARTIFACT and isinstance(payload.get("steps"), dict):
            night.result = payload["steps"]
        if event["type"] == EventType.RUN_WAITING and (payload.get("wait") or {}).get("type") == "approval":
            await _approval(api, night, payload, auto_approve)
        if event["type"] in ENDED:
            night.state = event["type"]


async def _approval(api: RunApi, night: Night, payload: dict[str, Any], auto_approve: bool) -> None:
    if auto_approve:
        note = "approved by fleet demo --auto-approve"
        await api.approve(night.tenant, night.run_id, str(payload["wait"]["awaited"]), note)
        print(f"demo: {night.tenant:<7}| approved as the operator (--auto-approve)")
        return
    print(
        f"demo: {night.tenant:<7}| waiting for you (no process waits). Approve with:\n"
        f"            fleet approve {night.run_id} --tenant {night.tenant} --note 'checked'\n"
        f"          or reject with: fleet reject {night.run_id} --tenant {night.tenant} --note why\n"
        f"          or in the console (Needs your input): fleet console --tenant {night.tenant}"
    )


def _line(type_: str, payload: dict[str, Any]) -> str:
    """What the demo shows of an event (the run's log keeps more)."""
    if type_ == EventType.STEP_STARTED and payload.get("agent"):
        return f"{payload['step']}: {payload['skill']} -> {payload['agent']}"
    if type_ in (
        EventType.STEP_PROGRESS,
        EventType.BATCH_CLOSED,
        EventType.STEP_FAILED,
        EventType.STEP_REROUTED,
        EventType.RUN_WAITING,
    ):
        return str(payload.get("text") or payload.get("message") or "")
    if type_ in ENDED:
        return type_.removeprefix("run.")
    return ""


def _print_night(night: Night) -> None:
    steps = night.result
    print(f"\n== {night.tenant}: {night.state.removeprefix('run.')}")
    records = (steps.get("reconcile") or {}).get("records", [])
    if records:
        print(f"  {'invoice':<11} {'customer':<10} {'amount':>10} {'paid':>10} {'payments':>8}")
        for r in records:
            print(
                f"  {r['invoice']:<11} {r['customer']:<10} {r['amount']:>10.2f} {r['paid']:>10.2f}"
                f" {int(r['payments']):>8}"
            )
    score = steps.get("score") or {}
    print(f"  anomalies (scored in the sandbox by code-runner): {score.get('summary', 'none')}")
    for anomaly in score.get("anomalies", []):
        print(f"    {anomaly['invoice']} score {anomaly['score']}: {'; '.join(anomaly['reasons'])}")
    published = steps.get("publish") or {}
    if published.get("status") == "published":
        approver = published.get("approved_by")
        how = f", approved by {approver}" if approver else ""
        if approver == "policy":  # no person: the score the run computed is under the threshold
            how = ", approved by policy (the score the run computed is under the threshold)"
        print(f"  report published once by the outbox, operation {published.get('operation_id')}{how}")
    kept = steps.get("remember") or {}
    if kept:
        redacted = sorted({kind for o in kept.get("outcomes", []) for kind in o.get("redacted", [])})
        what = f" (redacted: {', '.join(redacted)})" if redacted else ""
        print(f"  memory: {int(kept.get('kept', 0))} findings kept through the memory gate{what}")


async def _ask_over_a2a(http: httpx.AsyncClient, card: AgentCard, tokens: TokenClient, tenant: str) -> None:
    """Ask the coordinator, as an outside agent, what the night found: the researcher answers from
    the tenant's memory (what the gate let in, as it let it in)."""
    flow = card.security_schemes["fleet_oauth"].oauth2_security_scheme.flows.client_credentials
    token = await tokens.token("coordinator", tenant, list(flow.scopes))
    client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
    steps = [{"id": "recall", "skill": "recall", "input": {"query": QUESTION, "limit": 3}}]
    request = SendMessageRequest(
        message=Message(
            role=Role.ROLE_USER,
            message_id=uuid.uuid4().hex,
            parts=[new_text_part(QUESTION), new_data_part({"steps": steps})],
        )
    )
    context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
    print(f"\ndemo: -> coordinator over A2A, as {tenant}: {QUESTION!r}")
    result: dict[str, Any] = {}
    state = TaskState.TASK_STATE_UNSPECIFIED
    last = ""
    try:
        async for event in client.send_message(request, context=context):
            kind = event.WhichOneof("payload")
            if kind == "status_update":
                state = event.status_update.status.state
                last = " ".join(get_text_parts(event.status_update.status.message.parts)) or last
            elif kind == "artifact_update":
                for data in get_data_parts(event.artifact_update.artifact.parts):
                    if isinstance(data, dict):
                        result.update(data)
    except (A2AError, A2AClientError) as exc:
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"the coordinator refused: {exc}") from exc
    finally:
        await client.close()
    if state != TaskState.TASK_STATE_COMPLETED:
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"the question ended {TaskState.Name(state)}: {last}")
    memories = ((result.get("steps") or {}).get("recall") or {}).get("memories", [])
    print("demo: <- from the researcher, out of acme's memory (as the memory gate kept it):")
    for memory in memories:
        print(f"    [{memory.get('tier')}, run {str(memory.get('run_id'))[:8]}] {memory.get('text')}")
    if not memories:
        print("    nothing")


async def _verified_card(http: httpx.AsyncClient, registry_url: str, base_url: str) -> AgentCard:
    response = await http.get(f"{registry_url}/v1/agents/coordinator/jwks.json")
    response.raise_for_status()
    keys = {k["kid"]: k for k in response.json()["keys"]}

    def key_provider(kid: str | None, jku: str | None) -> jwt.PyJWK:
        if kid not in keys:
            raise jwt.InvalidKeyError("unknown signing key")
        return jwt.PyJWK(keys[kid], algorithm=ALGORITHM)

    verifier = create_signature_verifier(key_provider, [ALGORITHM])
    try:
        return await A2ACardResolver(http, base_url).get_agent_card(signature_verifier=verifier)
    except SignatureVerificationError as exc:
        raise FleetError(ErrorCode.CARD_INVALID, f"the coordinator's card does not verify: {exc}") from exc
