"""The researcher specialist: works over the tenant's long-term memory through the memory MCP server.
What it keeps passes the server's gate (personal data redacted, secrets refused, policy asked); what it
recalls comes with its provenance."""

from __future__ import annotations

from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, SkillError, serve_specialist

MAX_FACTS = 64
TIERS = ("episodic", "semantic", "procedural")

REMEMBERED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["kept", "outcomes"],
    "properties": {
        "kept": {"type": "integer", "minimum": 0},
        "outcomes": {"type": "array", "items": {"type": "object", "required": ["status"]}},
    },
}
RECALLED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["query", "memories"],
    "properties": {"query": {"type": "string"}, "memories": {"type": "array", "items": {"type": "object"}}},
}


async def remember_findings(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Keeps each finding as a memory of this run in the tier asked for (the gate decides what is
    kept, and how). The findings are the caller's words (the skill's input, whatever step or event
    produced them): they are kept as the source ``user``, and the memory server gives them the
    trust the caller's identity earns, which for anyone but a person in their own name is
    ``untrusted``; a procedural rule among them is held until distinct principals support it or
    a person approves it."""
    facts = payload.get("facts")
    tier = payload.get("tier", "episodic")
    if not isinstance(facts, list) or len(facts) > MAX_FACTS or not all(isinstance(f, str) for f in facts):
        raise SkillError(
            ErrorCode.INVALID_REQUEST, f"input.facts must be a list of at most {MAX_FACTS} texts"
        )
    if tier not in TIERS:
        raise SkillError(ErrorCode.INVALID_REQUEST, f"input.tier must be one of {', '.join(TIERS)}")
    summary = payload.get("summary")
    texts = [*([summary] if isinstance(summary, str) and summary else []), *facts]
    outcomes = []
    for text in texts:
        outcome = await ctx.memory.remember(
            text, tier=tier, source="user", ref=ctx.run_id, tags=("findings",)
        )
        shown = ("id", "status", "trust", "redacted", "reasons", "duplicate", "decision_id")
        outcomes.append({k: outcome[k] for k in shown if k in outcome})
    kept = sum(1 for o in outcomes if o.get("status") in ("stored", "held"))
    await ctx.progress(f"{kept} of {len(texts)} findings kept in memory")
    return {"kept": kept, "outcomes": outcomes}


async def recall(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """The memories nearest in meaning to a question, with where each came from."""
    query = payload.get("query")
    if not isinstance(query, str) or not query.strip():
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.query must be a question")
    tiers = payload.get("tiers", [])
    if not isinstance(tiers, list) or not set(tiers) <= set(TIERS):
        raise SkillError(ErrorCode.INVALID_REQUEST, f"input.tiers takes {', '.join(TIERS)}")
    limit = payload.get("limit", 5)
    if isinstance(limit, float) and limit.is_integer():  # JSON numbers arrive as floats over A2A
        limit = int(limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= 50:
        raise SkillError(ErrorCode.INVALID_REQUEST, "input.limit must be 1 to 50")
    found = await ctx.memory.recall(query, tiers=tiers, limit=limit)
    await ctx.progress(f"{len(found)} memories found")
    return {"query": query, "memories": found}


SKILLS = [
    Skill(
        "remember-findings",
        "Remember findings",
        "Keeps findings in the tenant's long-term memory through the memory gate."
        ' Input: {"facts": [TEXT, ...], "summary": TEXT, "tier": "episodic"}.',
        remember_findings,
        tags=("memory",),
        idempotent=True,  # the same text in the same tier is kept once (the gate finds the duplicate)
        output_schema=REMEMBERED_SCHEMA,
    ),
    Skill(
        "recall",
        "Recall",
        'Finds what the tenant\'s memory holds about a question. Input: {"query": TEXT, "limit": N}.',
        recall,
        tags=("memory", "research"),
        idempotent=True,  # reads only
        output_schema=RECALLED_SCHEMA,
        instructions="Answer the question from the tenant's memory: call the memory server's recall"
        ' tool, then answer {"query": QUESTION, "memories": [the memories you used]}.',
    ),
]


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(
        settings,
        name="Researcher",
        description="Keeps and recalls a tenant's findings in governed long-term memory.",
        version="1.0.0",
        skills=SKILLS,
    )
