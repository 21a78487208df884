"""Cards are checked again after registration, not trusted forever: every ``card_refresh_s`` the
registry fetches each agent's card and verifies it as at registration (schema, signature by a key
the agent holds now, interfaces on the registered host).

* It verifies: the record is refreshed (a new version, new skills) and the agent is ``healthy``; a
  changed card is recorded in the agent's history.
* It does not verify (unsigned, forged, signed by a revoked or retired key, swapped for another
  agent's, moved to another host), or it claims a skill the agent's identity may not offer (see
  :mod:`registry._skills`): the agent is ``quarantined`` and discovery stops offering it, at once;
  it stays so until the agent registers again (which verifies again).
* It cannot be fetched: after ``UNREACHABLE_AFTER`` failures in a row the agent is ``unreachable``,
  and not offered until it answers again (a health check).

Agents are checked concurrently (``MAX_CONCURRENT_CHECKS`` at a time), each fetch bounded in time
and bytes by ``fleet.limits.fetch`` (see :mod:`fleet.outbound`): an agent that answers slowly, or
not at all, delays no other agent's check. A fetch past its deadline counts as a failure to fetch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import Any

import httpx

from fleet.errors import ErrorCode, FleetError
from registry._cards import CARD_PATH, fetch_verified_card
from registry._records import AgentRecord, CardVersion
from registry._skills import SkillBinding
from registry._store import RegistryStore

log = logging.getLogger(__name__)

UNREACHABLE_AFTER = 3
MAX_CONCURRENT_CHECKS = 16  # cards fetched at once by one round of checks
# Could not be fetched (counts towards unreachable); any other failure quarantines the agent.
UNFETCHED = frozenset({ErrorCode.DEPENDENCY_UNAVAILABLE, ErrorCode.FETCH_TIMEOUT})


def card_digest(card: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(card, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


async def registered(store: RegistryStore, record: AgentRecord) -> AgentRecord:
    """The record of an agent that has just registered (its card verified): healthy, noted."""
    now = time.time()
    digest = card_digest(record.card)
    fresh = record.model_copy(update={"status": "healthy", "checked_at": now, "card_sha256": digest})
    await store.put_agent(fresh)
    await store.note_card(
        record.id, CardVersion(at=now, change="registered", version=record.version, card_sha256=digest)
    )
    return fresh


async def refresh(
    store: RegistryStore, http: httpx.AsyncClient, skills: SkillBinding, agent_id: str
) -> AgentRecord | None:
    """Check one agent's card again (see the module's doc); its record as it stands after. With no
    policy to ask about its skills, the record stays as it was (the next check asks again)."""
    record = await store.agent(agent_id)
    if record is None or record.status == "quarantined":
        return record
    now = time.time()
    identity = await store.identity(agent_id)
    try:
        if identity is None:
            raise FleetError(ErrorCode.CARD_INVALID, "the agent's identity is no longer enrolled")
        fetched = await fetch_verified_card(http, identity, record.card_url.removesuffix(CARD_PATH))
        await skills.check(identity, fetched)
    except FleetError as exc:
        if exc.code == ErrorCode.POLICY_UNAVAILABLE:
            log.warning("agent %s: card not checked, no skills policy: %s", agent_id, exc.message)
            return record
        return await _failed(store, record, exc, now)
    digest = card_digest(fetched.card)
    changes = {"registered_at": record.registered_at, "status": "healthy", "status_reason": "",
               "checked_at": now, "failures": 0, "card_sha256": digest}  # fmt: skip
    fresh = fetched.model_copy(update=changes)
    await store.put_agent(fresh)
    if digest != record.card_sha256:
        await store.note_card(
            agent_id, CardVersion(at=now, change="updated", version=fresh.version, card_sha256=digest)
        )
        log.info("agent %s: card changed (version %s)", agent_id, fresh.version)
    elif record.status == "unreachable":
        await store.note_card(
            agent_id, CardVersion(at=now, change="answered", version=fresh.version, card_sha256=digest)
        )
        log.info("agent %s answers again", agent_id)
    return fresh


async def _failed(store: RegistryStore, record: AgentRecord, exc: FleetError, now: float) -> AgentRecord:
    if exc.code in UNFETCHED:
        failures = record.failures + 1
        status = "unreachable" if failures >= UNREACHABLE_AFTER else record.status
        updated = record.model_copy(
            update={"failures": failures, "status": status, "status_reason": exc.message, "checked_at": now}
        )
        if status == "unreachable" and record.status != "unreachable":
            await store.note_card(record.id, CardVersion(at=now, change="unreachable", detail=exc.message))
            log.warning("agent %s unreachable (%d failed checks): not offered", record.id, failures)
    else:  # fetched, and it does not verify
        updated = record.model_copy(
            update={"status": "quarantined", "status_reason": exc.message, "checked_at": now}
        )
        await store.note_card(record.id, CardVersion(at=now, change="refused", detail=exc.message))
        log.warning("agent %s quarantined: its card no longer verifies: %s", record.id, exc.message)
    await store.put_agent(updated)
    return updated


async def refresh_all(
    store: RegistryStore,
    http: httpx.AsyncClient,
    skills: SkillBinding,
    concurrency: int = MAX_CONCURRENT_CHECKS,
) -> None:
    """Check every agent's card, ``concurrency`` at a time: each fetch ends by its deadline (see
    fleet.outbound), and a slow agent holds up only its own check."""
    try:
        agents = await store.agents()
    except Exception:  # the broker is away: the next round tries again
        log.exception("could not list the agents to check their cards")
        return
    slots = asyncio.Semaphore(concurrency)

    async def check(agent_id: str) -> None:
        async with slots:
            try:
                await refresh(store, http, skills, agent_id)
            except Exception:  # one agent's trouble must not stop the others' checks
                log.exception("checking the card of %s failed", agent_id)

    async with asyncio.TaskGroup() as group:
        for agent in agents:
            group.create_task(check(agent.id))


async def refresh_forever(
    store: RegistryStore, http: httpx.AsyncClient, skills: SkillBinding, interval_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await refresh_all(store, http, skills)
