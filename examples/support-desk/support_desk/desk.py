"""desk: the support desk's specialist, on the specialist kit. It triages a customer's message into a
ticket, asks a person what an urgent ticket needs, and answers from the knowledge base."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import InputRequired, Skill, SkillContext, SkillError, serve_specialist

TICKETS = "mcp-tickets"
URGENT = ("down", "outage", "refund", "urgent", "broken", "charged twice")
CHOICES = ("refund", "workaround", "call back")
ANSWER_DELAY_S = 0.0  # SUPPORT_DESK_ANSWER_DELAY_S: how long an answer takes (the tests widen it)


def _message(payload: dict[str, Any]) -> str:
    message = payload.get("message")
    if not isinstance(message, str) or not message.strip():
        raise SkillError(ErrorCode.INVALID_REQUEST, "input needs the customer's message")
    return message


async def _tool(ctx: SkillContext, tool: str, arguments: dict[str, Any], scope: str) -> dict[str, Any]:
    return await ctx.tools.call(TICKETS, tool, arguments, tenant=ctx.tenant, scopes=[scope])


async def triage(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """A ticket at the priority the message calls for."""
    message = _message(payload)
    priority = "high" if any(word in message.lower() for word in URGENT) else "normal"
    await ctx.progress(f"priority {priority}")
    ticket = await _tool(
        ctx,
        "open_ticket",
        {"operation_id": ctx.idempotency_key("ticket"), "title": message[:80], "priority": priority},
        "tickets:write",
    )
    return {"priority": priority, "ticket": ticket["ticket"]}


async def escalate(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Ask a person what an urgent ticket needs; note their decision on the ticket."""
    ticket = str(payload.get("ticket", ""))
    decision = (ctx.answer or {}).get("decision")
    if decision not in CHOICES:
        raise InputRequired(
            f"Ticket {ticket} is urgent: {_message(payload)[:200]!r}. Refund, workaround or call back?",
            {"decision": {"type": "string", "enum": list(CHOICES)}},
        )
    await _tool(
        ctx,
        "add_note",
        {"operation_id": ctx.idempotency_key("decision"), "ticket": ticket, "text": f"decided: {decision}"},
        "tickets:write",
    )
    return {"ticket": ticket, "decision": decision}


async def answer(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """The knowledge base's answer to the message, noted on the ticket."""
    message, ticket = _message(payload), str(payload.get("ticket", ""))
    found = await _tool(ctx, "search_kb", {"query": message}, "tickets:read")
    articles = found["articles"]
    text = articles[0]["body"] if articles else "A person will get back to you within a working day."
    await ctx.progress(f"answering from {len(articles)} article(s)")
    await asyncio.sleep(ANSWER_DELAY_S)
    await _tool(
        ctx,
        "add_note",
        {"operation_id": ctx.idempotency_key("answer"), "ticket": ticket, "text": f"answered: {text}"},
        "tickets:write",
    )
    return {"ticket": ticket, "answer": text}


SKILLS = [
    Skill(
        "triage-ticket",
        "Triage",
        "Input: {message}. Opens a ticket at its priority.",
        triage,
        idempotent=True,
    ),
    Skill(
        "escalate",
        "Escalate",
        "Input: {ticket, message}. Asks a person what to do.",
        escalate,
        idempotent=True,
    ),
    Skill(
        "answer-from-kb",
        "Answer",
        "Input: {ticket, message}. Answers from the knowledge base.",
        answer,
        idempotent=True,
    ),
]


async def main(settings: ServiceSettings) -> None:
    global ANSWER_DELAY_S
    ANSWER_DELAY_S = float(os.environ.get("SUPPORT_DESK_ANSWER_DELAY_S", "0"))
    await serve_specialist(
        settings,
        name="Support desk",
        description="Triages customers' messages into tickets, escalates the urgent ones, answers from the knowledge base.",
        version="0.1.0",
        skills=SKILLS,
    )
