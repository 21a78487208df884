"""Registry records as stored in NATS KV (JSON bodies with a schema version)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

RecordKind = Literal["operator", "registry", "coordinator", "worker", "specialist", "mcp_server", "console"]


class IdentityRecord(BaseModel):
    """An enrolled identity: its public keys (by kid) and what it may ask the token service for.

    A key that was replaced (a rotation, or an enrollment with a new key) stays usable until its
    time in ``retiring`` (what was signed with it before the change still verifies); a revoked key
    is removed at once (and listed in ``fleet-revocations``, see :mod:`fleet.revocations`)."""

    schema_version: int = 3
    id: str
    kind: RecordKind
    keys: dict[str, dict[str, Any]] = Field(default_factory=dict)
    retiring: dict[str, float] = Field(default_factory=dict)  # kid -> unusable after (epoch seconds)
    scopes: list[str] = Field(default_factory=list)
    tenants: list[str] = Field(default_factory=list)
    # The skills its agent card may offer, as the operator's enrollment token named them (schema 2
    # had none: such an identity offers none until it enrolls again). Policy may grant more
    # (``fleet.registry.skills``); a card claiming another is refused (see registry._skills).
    skills: list[str] = Field(default_factory=list)
    enrolled_at: float
    # Run by another organisation (a partner's agent): what the fleet sends it passes the egress
    # policy, and its card says where to get a token for it (see coordinator.engine.delegation).
    external: bool = False

    def current_keys(self) -> dict[str, dict[str, Any]]:
        """The keys not being retired (those that may name a successor)."""
        return {kid: jwk for kid, jwk in self.keys.items() if kid not in self.retiring}

    def usable_keys(self, now: float) -> dict[str, dict[str, Any]]:
        """The keys that verify now: the current ones, and the retiring ones not yet expired."""
        return {kid: jwk for kid, jwk in self.keys.items() if self.retiring.get(kid, now + 1) > now}

    def with_key(self, jwk: dict[str, Any], now: float, grace_s: float) -> IdentityRecord:
        """This identity with ``jwk`` as its current key; the others retire after ``grace_s``."""
        keys = {kid: key for kid, key in self.usable_keys(now).items()}
        retiring = {
            kid: min(self.retiring.get(kid, now + grace_s), now + grace_s)
            for kid in keys
            if kid != jwk["kid"]
        }
        keys[jwk["kid"]] = jwk
        return self.model_copy(update={"keys": keys, "retiring": retiring})

    def without_key(self, kid: str) -> IdentityRecord:
        return self.model_copy(
            update={
                "keys": {k: v for k, v in self.keys.items() if k != kid},
                "retiring": {k: v for k, v in self.retiring.items() if k != kid},
            }
        )

    def allows_tenant(self, tenant: str) -> bool:
        return "*" in self.tenants or tenant in self.tenants

    def allows_scope(self, scope: str) -> bool:
        return "*" in self.scopes or scope in self.scopes


class SkillRecord(BaseModel):
    id: str
    name: str
    description: str = ""
    tags: list[str] = Field(default_factory=list)


class AgentRecord(BaseModel):
    """A registered A2A agent: where its card is, and the card as last fetched and verified."""

    schema_version: int = 1
    id: str
    kind: RecordKind
    card_url: str
    url: str
    version: str
    skills: list[SkillRecord]
    card: dict[str, Any]
    registered_at: float
    # healthy: its card verified when last checked; unreachable: its card could not be fetched for
    # a while (not offered by discovery until it answers again); quarantined: its card stopped
    # verifying (forged, unsigned, swapped or moved): not offered until the agent registers again.
    status: str = "registered"
    status_reason: str = ""
    checked_at: float = 0.0
    failures: int = 0  # fetches failed in a row
    card_sha256: str = ""
    external: bool = False  # its identity's (see IdentityRecord.external)

    @property
    def offered(self) -> bool:
        """Whether discovery may hand this agent out."""
        return self.status not in ("quarantined", "unreachable")


class CardVersion(BaseModel):
    """One entry of an agent's card history."""

    at: float
    change: str  # registered, updated, refused, unreachable, answered
    version: str = ""
    card_sha256: str = ""
    detail: str = ""


class AgentHistory(BaseModel):
    """What happened to an agent's card, newest last (bounded)."""

    schema_version: int = 1
    id: str
    entries: list[CardVersion] = Field(default_factory=list)


class McpToolRecord(BaseModel):
    """A tool as its server declares it: the scopes a token needs to call it, and whether a repeat
    of a call is harmless (its MCP annotations; a tool that says nothing is neither)."""

    name: str = Field(min_length=1, max_length=100)
    description: str = Field(default="", max_length=2000)
    scopes: list[str] = Field(default_factory=list, max_length=16)
    read_only: bool = False
    idempotent: bool = False


class McpServerRecord(BaseModel):
    """A registered MCP server: the URL of its Streamable HTTP endpoint, its audience, and its
    tools (schema 1 named the tools only; they read as tools that declare no scope)."""

    schema_version: int = 2
    id: str
    url: str
    audience: str
    tools: list[McpToolRecord] = Field(default_factory=list, max_length=200)
    registered_at: float

    @field_validator("tools", mode="before")
    @classmethod
    def _named_tools(cls, tools: Any) -> Any:
        if isinstance(tools, list):
            return [{"name": t} if isinstance(t, str) else t for t in tools]
        return tools

    @property
    def declared_scopes(self) -> set[str]:
        return {scope for tool in self.tools for scope in tool.scopes}

    def usable_by(self, allows_scope: Callable[[str], bool]) -> McpServerRecord:
        """The record with only the tools whose every scope ``allows_scope``."""
        tools = [t for t in self.tools if all(allows_scope(s) for s in t.scopes)]
        return self.model_copy(update={"tools": tools})


class ProducerRecord(BaseModel):
    """An event producer outside the fleet (a billing system, a webhook relay): the nkey it connects
    to the bus with, the one tenant it publishes for, the sources it may publish as, and until when
    (see :mod:`registry._callout`). The registry keeps the public key only; the seed is the
    producer's."""

    schema_version: int = 1
    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    nkey: str
    tenant: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    sources: list[str] = Field(min_length=1, max_length=32)
    issued_by: str
    issued_at: float
    expires_at: float
    revoked: bool = False

    @field_validator("sources")
    @classmethod
    def _source_tokens(cls, sources: list[str]) -> list[str]:
        for source in sources:
            if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", source):
                raise ValueError(f"a source is 1-64 letters, digits, - and _, not {source!r}")
        return sources
