"""The SQL analyst specialist."""

from __future__ import annotations

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


SKILLS = [
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
        version="0.1.0",
        skills=SKILLS,
    )
