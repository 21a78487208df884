"""The SQL analyst specialist."""

from __future__ import annotations

import re
from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, SkillError, serve_specialist

SQL_SERVER = "mcp-sql"
SQL_SCOPE = "sql:query"

INVOICE_TOTALS_SQL = """
SELECT customer,
       count(*)     AS invoices,
       sum(amount)  AS total,
       max(amount)  AS largest,
       count(*) FILTER (WHERE status = 'overdue') AS overdue
FROM tenant_data.invoices
GROUP BY customer
ORDER BY total DESC
"""


def _records(result: dict[str, Any]) -> list[dict[str, Any]]:
    columns = result.get("columns", [])
    return [dict(zip(columns, row, strict=True)) for row in result.get("rows", [])]


async def _query(ctx: SkillContext, sql: str) -> dict[str, Any]:
    result = await ctx.tools.call(SQL_SERVER, "query", {"sql": sql}, tenant=ctx.tenant, scopes=[SQL_SCOPE])
    return {
        "columns": result.get("columns", []),
        "records": _records(result),
        "row_count": result.get("row_count", 0),
        "truncated": result.get("truncated", False),
    }


async def invoice_totals(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    await ctx.progress("querying invoice totals per customer")
    result = await _query(ctx, INVOICE_TOTALS_SQL)
    await ctx.progress(f"{result['row_count']} customers found")
    return result


async def sql_query(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    sql = payload.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.sql must be a non-empty SELECT statement")
    await ctx.progress("running the query")
    return await _query(ctx, sql)


MAX_INVOICES = 500
_INVOICE_NUMBER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$")

RECONCILED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["records", "count", "usual"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "usual": {"type": "array", "items": {"type": "number"}},
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["invoice", "customer", "amount", "paid", "payments", "difference"],
                "properties": {
                    "invoice": {"type": "string"},
                    "customer": {"type": "string"},
                    "amount": {"type": "number"},
                    "paid": {"type": "number"},
                    "payments": {"type": "integer"},
                    "difference": {"type": "number"},
                },
            },
        },
    },
}


def _settled(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The settled invoices to reconcile, validated (their numbers go into SQL as literals)."""
    invoices = payload.get("invoices")
    if not isinstance(invoices, list) or not 0 < len(invoices) <= MAX_INVOICES:
        raise SkillError(ErrorCode.INVALID_REQUEST, f"input.invoices must be a list of 1 to {MAX_INVOICES}")
    found: list[dict[str, Any]] = []
    for item in invoices:
        number = item.get("invoice") if isinstance(item, dict) else None
        amount = item.get("amount") if isinstance(item, dict) else None
        if not isinstance(number, str) or not _INVOICE_NUMBER.match(number):
            raise SkillError(
                ErrorCode.INVALID_REQUEST, f"an invoice number must match {_INVOICE_NUMBER.pattern}"
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
            raise SkillError(ErrorCode.INVALID_REQUEST, f"invoice {number} needs a positive amount")
        found.append(
            {
                "invoice": number,
                "customer": str(item.get("customer", "")),
                "amount": float(amount),
                "contact": str(item.get("contact", "")),  # passed on as it came; memory redacts it
            }
        )
    return found


async def reconcile_invoices(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Each settled invoice beside what the bank received for it, and what the tenant usually bills."""
    invoices = _settled(payload)
    numbers = ", ".join(f"'{i['invoice']}'" for i in invoices)  # validated above: no quote can occur
    await ctx.progress(f"reconciling {len(invoices)} invoices against the payments received")
    paid = await _query(
        ctx,
        "SELECT invoice_number, count(*) AS payments, sum(amount) AS paid FROM tenant_data.payments"
        f" WHERE invoice_number IN ({numbers}) GROUP BY invoice_number",
    )
    usual = await _query(ctx, "SELECT amount FROM tenant_data.invoices ORDER BY issued_on DESC LIMIT 1000")
    by_number = {r["invoice_number"]: r for r in paid["records"]}
    history = [float(r["amount"]) for r in usual["records"]]
    records = []
    for invoice in invoices:
        row = by_number.get(invoice["invoice"], {})
        received = float(row.get("paid") or 0.0)
        records.append(
            {
                **invoice,
                "paid": received,
                "payments": int(row.get("payments") or 0),
                "difference": round(invoice["amount"] - received, 2),
            }
        )
    mismatched = sum(1 for r in records if r["difference"] != 0)
    await ctx.progress(f"{mismatched} of {len(records)} invoices do not match their payments")
    return {"records": records, "count": len(records), "usual": history}


SKILLS = [
    Skill(
        "reconcile-invoices",
        "Reconcile invoices",
        "Puts each settled invoice beside the payments received for it and the tenant's usual amounts."
        ' Input: {"invoices": [{"invoice": NUMBER, "customer": NAME, "amount": N}, ...]}.',
        reconcile_invoices,
        tags=("sql", "invoices", "reconciliation"),
        idempotent=True,  # no effects: read-only SQL through a read-only tool
        output_schema=RECONCILED_SCHEMA,
    ),
    Skill(
        "invoice-totals",
        "Invoice totals",
        "Totals, counts and the largest invoice per customer for the caller's tenant.",
        invoice_totals,
        tags=("sql", "invoices"),
        idempotent=True,  # no effects: read-only SQL through a read-only tool
    ),
    Skill(
        "sql-query",
        "Read-only SQL",
        'Runs one read-only SELECT over the tenant\'s data. Input: {"sql": "SELECT ..."}.',
        sql_query,
        tags=("sql",),
        idempotent=True,  # no effects: read-only SQL through a read-only tool
    ),
]


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(
        settings,
        name="SQL analyst",
        description="Answers questions about a tenant's business data through the SQL MCP server.",
        version="0.2.0",
        skills=SKILLS,
    )
