"""``fleet demo``: bring the stack up (or use the running one), then act exactly as an outside agent
would: get a token, discover the coordinator's card and verify its signature, send a request with the
a2a-sdk client, stream the progress, and print the result."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
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

from fleet.errors import ErrorCode, FleetError
from fleet.keys import ALGORITHM
from fleet.layout import StackLayout
from fleet.operator_cli import operator_token_client, running_endpoints, stack_running

REQUEST_TEXT = "Find outliers in this month's invoices"
DEMO_STEPS: list[dict[str, Any]] = [
    {"id": "totals", "skill": "invoice-totals"},
    {
        "id": "outliers",
        "skill": "outliers",
        "input": {"records": {"$from": "totals.records"}, "field": "largest", "label": "customer"},
    },
    {
        "id": "cases",
        "skill": "open-review-cases",
        "input": {"records": {"$from": "outliers.outliers"}, "label": "label", "reason": "outlying invoice"},
    },
]


def run(layout: StackLayout, *, tenant: str, keep_running: bool) -> int:
    from fleet.cli import up_detached

    started_here = False
    if not stack_running(layout):
        print(f"demo: starting the stack in {layout.home} ...", flush=True)
        if up_detached(layout) != 0:
            return 1
        started_here = True
    else:
        print(f"demo: using the stack already running in {layout.home}")
    try:
        return asyncio.run(_demo(layout, tenant))
    except FleetError as exc:
        print(f"demo: FAILED [{exc.code}] {exc.message}", file=sys.stderr)
        return 1
    finally:
        if started_here and not keep_running:
            from fleet.operator_cli import down

            down(layout)


async def _demo(layout: StackLayout, tenant: str) -> int:
    endpoints = running_endpoints(layout)
    timeout = httpx.Timeout(10.0, read=None)
    async with httpx.AsyncClient(timeout=timeout) as http:
        card = await _verified_card(http, endpoints["registry"], endpoints["coordinator"])
        print(f"demo: coordinator card '{card.name}' v{card.version}: signature verified")
        flow = card.security_schemes["fleet_oauth"].oauth2_security_scheme.flows.client_credentials
        if flow.token_url != endpoints["registry"] + "/oauth/token":
            # Never hand our credentials to a token endpoint we do not already trust.
            raise FleetError(
                ErrorCode.CARD_INVALID, f"the card names an unknown token endpoint {flow.token_url}"
            )
        tokens = operator_token_client(layout, flow.token_url, http)
        token = await tokens.token("coordinator", tenant, list(flow.scopes))
        print(f"demo: got a 5-minute token from the card's token endpoint for tenant '{tenant}'")
        client = ClientFactory(ClientConfig(streaming=True, httpx_client=http)).create(card)
        request = SendMessageRequest(
            message=Message(
                role=Role.ROLE_USER,
                message_id=uuid.uuid4().hex,
                parts=[new_text_part(REQUEST_TEXT), new_data_part({"steps": DEMO_STEPS})],
            )
        )
        context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token}"})
        print(f"demo: -> {REQUEST_TEXT!r} (3 steps: invoice-totals, outliers, open-review-cases)")
        try:
            return await _stream(client.send_message(request, context=context))
        except (A2AError, A2AClientError) as exc:
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"the coordinator refused: {exc}") from exc
        finally:
            await client.close()


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


async def _stream(stream: Any) -> int:
    started = time.monotonic()
    state = TaskState.TASK_STATE_UNSPECIFIED
    final_text = ""
    result: dict[str, Any] = {}
    async for event in stream:
        kind = event.WhichOneof("payload")
        elapsed = f"{time.monotonic() - started:6.2f}s"
        if kind == "task":
            state = event.task.status.state
            print(f"demo: {elapsed} run {event.task.id} accepted")
        elif kind == "status_update":
            state = event.status_update.status.state
            text = " ".join(get_text_parts(event.status_update.status.message.parts))
            final_text = text or final_text
            print(f"demo: {elapsed} [{TaskState.Name(state).removeprefix('TASK_STATE_').lower()}] {text}")
        elif kind == "artifact_update":
            for data in get_data_parts(event.artifact_update.artifact.parts):
                if isinstance(data, dict):
                    result.update(data)
    if state != TaskState.TASK_STATE_COMPLETED:
        print(f"demo: FAILED: the run ended {TaskState.Name(state)}: {final_text}", file=sys.stderr)
        return 1
    _print_result(result.get("steps", {}))
    return 0


def _print_result(steps: dict[str, Any]) -> None:
    totals = steps.get("totals", {}).get("records", [])
    print("\nInvoice totals (computed by sql-analyst through the SQL MCP server on Postgres):")
    print(f"  {'customer':<12} {'invoices':>8} {'total':>10} {'largest':>10} {'overdue':>7}")
    for row in totals:
        print(
            f"  {row['customer']:<12} {int(row['invoices']):>8} {row['total']:>10.2f} "
            f"{row['largest']:>10.2f} {int(row['overdue']):>7}"
        )
    outliers = steps.get("outliers", {})
    flagged = outliers.get("outliers", [])
    print(f"\nOutliers in 'largest invoice' (by stats, median {outliers.get('median', 0):.2f}):")
    for item in flagged:
        print(f"  {item['label']}: {item['value']:.2f} (modified z-score {item['score']})")
    if not flagged:
        print("  none")
    cases = steps.get("cases", {}).get("cases", [])
    print("\nReview cases (opened by case-desk through the cases MCP server, once per operation):")
    for case in cases:
        print(f"  case {int(case['case_id'])} for {case['subject']}")
    if not cases:
        print("  none")
    print("\ndemo: OK")
