"""``fleet memory ...``: look into, approve and prune a tenant's long-term memory as the operator.

Every command but ``audit`` goes through the memory MCP server (``mcp-memory``, the store's single
writer) with a short-lived operator token for one tenant, so the operator passes the same gate, scopes
and audit trail as any agent:

- ``search QUERY``: the entries nearest to QUERY (``--tier``, ``--limit``);
- ``show ID...``: entries by id, held ones too, with their provenance;
- ``forget (--id ID... | --run RUN | --all)``: delete, audited (``--reason``);
- ``approve ID``: a person approves a held procedural rule;
- ``audit``: the memory server's audit events (``fleet.audit.memory.>``), read from NATS.

Exit codes: 0 done, 1 refused or failed (the reason on stderr), 3 no stack runs on the data dir,
5 ``show``: an id that is not the tenant's, 6 the operator's token was refused (see
:mod:`fleetctl.cli_common`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import httpx

from fleet import mcp_client, transport
from fleet.errors import ErrorCode, FleetError
from fleet.eventlog import read_records
from fleet.mcp_errors import error_of
from fleet.natsconn import connect, stream_replicas
from fleetctl.cli_common import report_error
from fleetctl.layout import StackLayout

EXIT_OK, EXIT_FAILED = 0, 1
SERVER = "mcp-memory"
SCOPES = {
    "recall": ("memory:read",),
    "show": ("memory:read",),
    "forget": ("memory:forget",),
    "approve_memory": ("memory:approve",),
}


async def call(layout: StackLayout, tenant: str, tool: str, arguments: dict[str, Any]) -> tuple[int, Any]:
    """Call ``tool`` of the memory server for ``tenant``: (exit code, structured result or None)."""
    from fleetctl.cli_common import operator_token_client, running_endpoints

    try:
        endpoints = running_endpoints(layout)
        url = endpoints["mcp_servers"][SERVER]
        async with httpx.AsyncClient(timeout=30, event_hooks=transport.hooks()) as http:
            tokens = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
            token = await tokens.token(SERVER, tenant, list(SCOPES[tool]))
    except FleetError as exc:  # no stack (3), or the token refused (6): the one table's codes
        return report_error(exc, as_json=False), None
    except KeyError:
        print(f"fleet: the stack on {layout.home} runs no memory server", file=sys.stderr)
        return EXIT_FAILED, None
    result = await mcp_client.call_tool(url, tool, arguments, token=token, http_timeout=60)
    error = error_of(result)
    if error is not None:  # the memory server's refusal, its code read from the answer's envelope
        return report_error(error, as_json=False), None
    structured = result.structured_content or {}
    return EXIT_OK, structured.get("result", structured)


def _print_entries(entries: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(entries, indent=2))
        return
    for e in entries:
        score = f"{e['score']:.3f} " if e.get("score") is not None else ""
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(e["created_at"])) if e.get("created_at") else "-"
        print(f"{score}{e['id']}  {e['tier']:<10} {e['status']:<6} {when}  run={e.get('run_id') or '-'}")
        print(f"    {e['text']}")
        redacted = f" redacted={','.join(e['redacted'])}" if e.get("redacted") else ""
        approved = f" approved_by={e['approved_by']}" if e.get("approved_by") else ""
        support = f" runs={len(e.get('support_runs') or [])} principals={e.get('support_principals') or 0}"
        print(
            f"    by {e.get('agent') or '-'} from {e.get('source') or '-'} ({e.get('trust') or '-'})"
            f" decision={e.get('decision_id') or '-'}{redacted}{support}{approved}"
        )


async def search(
    layout: StackLayout, tenant: str, query: str, tiers: list[str], limit: int, *, as_json: bool
) -> int:
    code, hits = await call(
        layout, tenant, "recall", {"query": query, "tiers": tiers or None, "limit": limit}
    )
    if code == EXIT_OK:
        _print_entries(hits, as_json)
    return code


async def show(layout: StackLayout, tenant: str, ids: list[str], *, as_json: bool) -> int:
    code, entries = await call(layout, tenant, "show", {"ids": ids})
    if code != EXIT_OK:
        return code
    _print_entries(entries, as_json)
    missing = sorted(set(ids) - {e["id"] for e in entries})
    if missing:
        missed = FleetError(ErrorCode.NOT_FOUND, f"no memory {', '.join(missing)} for tenant {tenant}")
        return report_error(missed, as_json=as_json)  # 5, as every command's not found
    return EXIT_OK


async def forget(
    layout: StackLayout,
    tenant: str,
    *,
    ids: list[str],
    run_id: str,
    everything: bool,
    reason: str,
    as_json: bool,
) -> int:
    arguments = {"ids": ids or None, "run_id": run_id, "everything": everything, "reason": reason}
    code, deleted = await call(layout, tenant, "forget", arguments)
    if code == EXIT_OK:
        print(json.dumps({"deleted": deleted}) if as_json else f"forgot {len(deleted)} memories of {tenant}")
    return code


async def approve(layout: StackLayout, tenant: str, entry_id: str, *, as_json: bool) -> int:
    code, outcome = await call(layout, tenant, "approve_memory", {"id": entry_id})
    if code != EXIT_OK:
        return code
    if as_json:
        print(json.dumps(outcome))
    else:
        print(
            f"{entry_id}: {outcome['status']}"
            + (f" ({'; '.join(outcome['reasons'])})" if outcome.get("reasons") else "")
        )
    return EXIT_OK if outcome["status"] == "stored" else EXIT_FAILED


async def audit(layout: StackLayout, tenant: str | None, last: int, *, as_json: bool) -> int:
    from fleetctl.cli_common import operator_bus_credentials, running_endpoints

    try:
        endpoints = running_endpoints(layout)
    except FleetError as exc:
        return report_error(exc, as_json=False)
    client = await connect(
        str(endpoints["nats"]),
        "fleet-memory-audit",
        replicas=stream_replicas(endpoints),
        credentials=operator_bus_credentials(endpoints),
    )
    try:
        events = await read_records(client, "fleet.audit.memory.>")
    finally:
        await client.close()
    events = [e for e in events if tenant is None or e.get("tenant") == tenant]
    if last:
        events = events[-last:]
    for e in events:
        if as_json:
            print(json.dumps(e))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(e.get("time", 0))))
        detail = e.get("entry_id") or (f"{e.get('count')} ids" if "count" in e else "")
        why = f" ({'; '.join(e['reasons'])})" if e.get("reasons") else ""
        print(
            f"{when} {e.get('op'):<11} {e.get('tenant')}/{e.get('agent')} {e.get('tier') or ''}"
            f" {e.get('outcome')} {detail}{why}".rstrip()
        )
    return EXIT_OK
