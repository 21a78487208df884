"""Registry records as stored in NATS KV (JSON bodies with a schema version)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

RecordKind = Literal["operator", "registry", "coordinator", "worker", "specialist", "mcp_server"]


class IdentityRecord(BaseModel):
    """An enrolled identity: its public keys (by kid) and what it may ask the token service for."""

    schema_version: int = 1
    id: str
    kind: RecordKind
    keys: dict[str, dict[str, Any]] = Field(default_factory=dict)
    scopes: list[str] = Field(default_factory=list)
    tenants: list[str] = Field(default_factory=list)
    enrolled_at: float

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
    status: str = "registered"


class McpServerRecord(BaseModel):
    """A registered MCP server: the URL of its Streamable HTTP endpoint and its audience."""

    schema_version: int = 1
    id: str
    url: str
    audience: str
    tools: list[str] = Field(default_factory=list)
    registered_at: float
