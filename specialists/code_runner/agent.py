"""The code runner specialist: computes in the sandbox MCP server (untrusted Python in bubblewrap, a
workspace per run, no network). Its scoring code runs there, not here: a specialist never runs code
it was sent, or code that reads data it was sent, in its own process."""

from __future__ import annotations

import json
from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, SkillError, serve_specialist

SANDBOX_SERVER = "mcp-sandbox"
SANDBOX_SCOPE = "sandbox:run"
MAX_RECORDS = 2000
DEFAULT_REPORT_OVER = 2.0  # anomalies scored above this are listed in the report

# Runs in the sandbox. Reads records.json, writes anomalies.json and report.md, prints a summary.
# An invoice's score is the larger of two: how far its amount is from what the tenant usually bills
# (the modified z-score of Iglewicz and Hoaglin, median and MAD), and how far its payments are
# from its amount (10 for every 100% missing or paid twice), capped at 10.
SCORING_CODE = r"""
import json, statistics

spec = json.load(open("records.json"))
records, usual, over = spec["records"], spec["usual"], spec["report_over"]
amounts = usual + [r["amount"] for r in records]
median = statistics.median(amounts)
mad = statistics.median(abs(a - median) for a in amounts) or 1.0
scored = []
for r in records:
    z = 0.6745 * (r["amount"] - median) / mad
    gap = min(10.0, 10.0 * abs(r["difference"]) / r["amount"])
    reasons = []
    if abs(z) > over:
        reasons.append(f"amount {r['amount']:.2f} is far from the usual {median:.2f} (z {z:.1f})")
    if r["payments"] == 0:
        reasons.append("no payment received")
    elif r["payments"] > 1:
        reasons.append(f"paid {int(r['payments'])} times ({r['paid']:.2f} for {r['amount']:.2f})")
    elif r["difference"]:
        reasons.append(f"paid {r['paid']:.2f} of {r['amount']:.2f}")
    scored.append({**r, "score": round(min(10.0, max(abs(z), gap)), 2), "reasons": reasons})
anomalies = sorted((s for s in scored if s["score"] > over), key=lambda s: -s["score"])
json.dump(anomalies, open("anomalies.json", "w"), indent=1)
lines = ["# Invoice reconciliation", "", f"{len(records)} invoices, {len(anomalies)} anomalies.", ""]
lines += [f"- {a['invoice']} ({a['customer']}): score {a['score']}: {'; '.join(a['reasons'])}" for a in anomalies]
open("report.md", "w").write("\n".join(lines) + "\n")
print(json.dumps({"scored": len(scored), "anomalies": anomalies, "median": median,
                  "max_score": max((s["score"] for s in scored), default=0.0)}))
"""

SCORED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["scored", "anomalies", "max_score", "report_artifact", "summary", "findings"],
    "properties": {
        "scored": {"type": "integer", "minimum": 0},
        "max_score": {"type": "number", "minimum": 0},
        "report_artifact": {"type": "string", "pattern": "^artifact:sha256:[0-9a-f]{64}$"},
        "summary": {"type": "string"},
        "findings": {"type": "array", "items": {"type": "string"}},
        "anomalies": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["invoice", "score", "reasons"],
                "properties": {
                    "invoice": {"type": "string"},
                    "score": {"type": "number"},
                    "reasons": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}


def _spec(payload: dict[str, Any]) -> dict[str, Any]:
    records, usual = payload.get("records"), payload.get("usual", [])
    over = payload.get("report_over", DEFAULT_REPORT_OVER)
    if not isinstance(records, list) or not 0 < len(records) <= MAX_RECORDS:
        raise SkillError(ErrorCode.INVALID_REQUEST, f"input.records must be a list of 1 to {MAX_RECORDS}")
    if not isinstance(usual, list) or isinstance(over, bool) or not isinstance(over, int | float):
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.usual must be a list, report_over a number")
    need = ("invoice", "customer", "amount", "paid", "payments", "difference")
    for record in records:
        if not isinstance(record, dict) or any(key not in record for key in need):
            raise SkillError(ErrorCode.INVALID_REQUEST, f"every record needs {', '.join(need)}")
    return {"records": records, "usual": usual, "report_over": float(over)}


async def _run(ctx: SkillContext, code: str, timeout_s: float = 20.0) -> dict[str, Any]:
    result = await ctx.tools.call(
        SANDBOX_SERVER,
        "run_python",
        {"code": code, "timeout_s": timeout_s},
        tenant=ctx.tenant,
        scopes=[SANDBOX_SCOPE],
    )
    if result.get("exit_code") != 0:
        why = result.get("limit") or (result.get("stderr") or "")[-500:]
        raise SkillError(ErrorCode.TOOL_FAILED, f"the sandboxed code failed: {why}")
    return result


async def score_anomalies(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Scores reconciled invoices in the sandbox; the report is kept there as an artifact."""
    spec = _spec(payload)
    await ctx.progress(f"scoring {len(spec['records'])} invoices in the sandbox")
    # The data goes in as a file written by a literal: json.dumps output is a valid Python string.
    setup = f"open('records.json', 'w').write({json.dumps(json.dumps(spec))})\n"
    result = await _run(ctx, setup + SCORING_CODE)
    try:
        scored = json.loads(result["stdout"])
    except (KeyError, ValueError) as exc:
        raise SkillError(ErrorCode.TOOL_FAILED, "the scoring code printed no summary") from exc
    report = next((f["artifact"] for f in result.get("files", []) if f.get("path") == "report.md"), None)
    if report is None:
        raise SkillError(ErrorCode.TOOL_FAILED, "the scoring code wrote no report.md")
    anomalies = scored["anomalies"]
    summary = f"{scored['scored']} invoices reconciled, {len(anomalies)} anomalies"
    if anomalies:
        summary += f" (highest score {scored['max_score']})"
    await ctx.progress(summary)
    return {
        "scored": int(scored["scored"]),
        "anomalies": anomalies,
        "max_score": float(scored["max_score"]),
        "report_artifact": report,
        "summary": summary,
        "findings": [_finding(a) for a in anomalies],
    }


def _finding(anomaly: dict[str, Any]) -> str:
    """One anomaly as a sentence for the episodic memory (the memory gate redacts what it must)."""
    said = "; ".join(anomaly.get("reasons", [])) or "unusual"
    contact = f" Billing contact: {anomaly['contact']}." if anomaly.get("contact") else ""
    return f"Invoice {anomaly['invoice']} of {anomaly.get('customer', '?')} scored {anomaly['score']}: {said}.{contact}"


async def run_python(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    code = payload.get("code")
    if not isinstance(code, str) or not code.strip():
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.code must be Python source")
    await ctx.progress("running the code in the sandbox")
    result = await _run(ctx, code, float(payload.get("timeout_s", 10.0)))
    return {
        "stdout": result.get("stdout", ""),
        "files": [{"path": f["path"], "artifact": f["artifact"]} for f in result.get("files", [])],
    }


SKILLS = [
    Skill(
        "score-anomalies",
        "Score anomalies",
        "Scores reconciled invoices (amount against the usual, payments against the amount) in the"
        ' sandbox and writes a report. Input: {"records": [...], "usual": [amounts], "report_over": N}.',
        score_anomalies,
        tags=("python", "sandbox", "anomalies"),
        idempotent=True,  # the sandbox has no effect outside the run's own workspace, rewritten the same
        output_schema=SCORED_SCHEMA,
    ),
    Skill(
        "run-python",
        "Run Python",
        'Runs Python code in the sandbox (no network). Input: {"code": SOURCE}.',
        run_python,
        tags=("python", "sandbox"),
        output_schema={
            "type": "object",
            "required": ["stdout", "files"],
            "properties": {"stdout": {"type": "string"}, "files": {"type": "array"}},
        },
        instructions="Write Python that answers the task, run it with the sandbox's run_python tool"
        ' (print the answer as JSON), then answer {"stdout": ..., "files": []} with what it printed.',
    ),
]


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(
        settings,
        name="Code runner",
        description="Runs computations as Python in the sandbox MCP server: anomaly scoring, ad-hoc code.",
        version="1.0.0",
        skills=SKILLS,
    )
