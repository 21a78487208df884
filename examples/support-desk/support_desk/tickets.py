"""mcp-tickets: the desk's ticket system and knowledge base, as an MCP server of the fleet.

Every tool is one declaration on the tool-server kit: its scopes, its annotations (a keyed write is
safe to repeat: the same ``operation_id`` makes the effect once), the gate, the audit trail. The
tickets are kept in a JSON-lines file per tenant (``SUPPORT_DESK_DATA``, default ``.support-desk``),
standing in for the ticket system a real desk would call.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

from fleet.errors import ErrorCode, FleetError
from fleet.settings import ServiceSettings
from mcp_servers.kit import KEYED_WRITE, READ_ONLY, ToolCall, ToolServer

server = ToolServer("tickets", instructions="The support desk's tickets and knowledge base.")

ARTICLES = (
    (
        "password",
        "Reset a password",
        "Open Settings > Security > Reset password; the link is valid for 1 hour.",
    ),
    ("invoice", "Download an invoice", "Invoices are under Billing > History; each has a PDF link."),
    (
        "checkout",
        "Checkout errors",
        "Checkout outages are posted on the status page; retry after it is green.",
    ),
    ("refund", "Refunds", "Refunds go back to the original card within 5 to 10 working days."),
)
WORDS = re.compile(r"[a-z]+")


class Tickets:
    """The tickets of every tenant: one JSON-lines file each, appended under a lock."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = asyncio.Lock()

    def _file(self, tenant: str) -> Path:
        return self.folder / f"{tenant}.jsonl"

    def read(self, tenant: str) -> list[dict[str, Any]]:
        path = self._file(tenant)
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    async def once(
        self, tenant: str, operation_id: str, record: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """The record kept for ``operation_id``, written now if it is new: (record, created)."""
        async with self._lock:
            for kept in self.read(tenant):
                if kept["operation_id"] == operation_id:
                    return kept, False
            self.folder.mkdir(parents=True, exist_ok=True)
            entry = {**record, "operation_id": operation_id}
            with self._file(tenant).open("a") as out:
                out.write(json.dumps(entry) + "\n")
            return entry, True


tickets = Tickets(Path(".support-desk"))


@server.tool(scopes=["tickets:read"], annotations=READ_ONLY)
async def search_kb(call: ToolCall, query: str, limit: int = 3) -> dict[str, Any]:
    """The knowledge base's articles that best match ``query``."""
    words = set(WORDS.findall(query.lower()))
    ranked = sorted(ARTICLES, key=lambda a: -len(words & set(WORDS.findall(f"{a[0]} {a[1]} {a[2]}".lower()))))
    hits = [a for a in ranked if words & set(WORDS.findall(f"{a[0]} {a[1]} {a[2]}".lower()))][: max(1, limit)]
    return {"articles": [{"key": key, "title": title, "body": body} for key, title, body in hits]}


@server.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
async def open_ticket(call: ToolCall, operation_id: str, title: str, priority: str) -> dict[str, Any]:
    """Open a ticket, once per operation id (a repeat answers the ticket it opened)."""
    if priority not in ("high", "normal"):
        raise FleetError(ErrorCode.INVALID_REQUEST, "priority is high or normal")
    number = len([t for t in tickets.read(call.tenant) if t["kind"] == "ticket"]) + 1
    kept, created = await tickets.once(
        call.tenant,
        operation_id,
        {"kind": "ticket", "ticket": f"T-{number}", "title": title[:200], "priority": priority},
    )
    return {"ticket": kept["ticket"], "priority": kept["priority"], "created": created}


@server.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
async def add_note(call: ToolCall, operation_id: str, ticket: str, text: str) -> dict[str, Any]:
    """Add a note to a ticket, once per operation id."""
    _, created = await tickets.once(
        call.tenant, operation_id, {"kind": "note", "ticket": ticket, "text": text[:4000]}
    )
    return {"ticket": ticket, "noted": True, "created": created}


@server.tool(scopes=["tickets:write"], annotations=KEYED_WRITE)
async def close_ticket(call: ToolCall, operation_id: str, ticket: str) -> dict[str, Any]:
    """Close a ticket (the desk's policy keeps this for people with tickets:admin)."""
    _, created = await tickets.once(call.tenant, operation_id, {"kind": "closed", "ticket": ticket})
    return {"ticket": ticket, "closed": True, "created": created}


@server.tool(scopes=["tickets:read"], annotations=READ_ONLY)
async def ticket_log(call: ToolCall) -> dict[str, Any]:
    """Everything the caller's tenant's tickets went through, in order."""
    return {"entries": tickets.read(call.tenant)}


async def main(settings: ServiceSettings) -> None:
    tickets.folder = Path(os.environ.get("SUPPORT_DESK_DATA", ".support-desk"))
    await server.serve(settings)
