"""The registry's records in NATS KV, so that any process can read or watch them."""

from __future__ import annotations

from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel

from fleet.natsconn import key_value
from registry._records import (
    AgentHistory,
    AgentRecord,
    CardVersion,
    IdentityRecord,
    McpServerRecord,
    ProducerRecord,
)

RECORDS_BUCKET = "fleet-registry"
NONCES_BUCKET = "fleet-nonces"
NONCE_TTL_S = 900.0

M = TypeVar("M", bound=BaseModel)


class RegistryStore:
    """Typed access to the registry bucket (``identity.<id>``, ``agent.<id>``, ``mcp.<id>``) and to
    the single-use nonce bucket (assertion and enrollment ``jti``s)."""

    def __init__(self, js: JetStreamContext, records: KeyValue, nonces: KeyValue) -> None:
        self._js = js
        self._records = records
        self._nonces = nonces

    @classmethod
    async def open(cls, client: NATS) -> RegistryStore:
        records = await key_value(client, RECORDS_BUCKET, history=5)
        nonces = await key_value(client, NONCES_BUCKET, history=1, ttl_s=NONCE_TTL_S)
        return cls(client.jetstream(), records, nonces)

    async def _get(self, key: str, model: type[M]) -> M | None:
        try:
            entry = await self._records.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        return model.model_validate_json(entry.value)

    async def _put(self, key: str, record: BaseModel) -> None:
        await self._records.put(key, record.model_dump_json().encode())

    async def _list(self, prefix: str, model: type[M]) -> list[M]:
        """Current records under ``prefix``: the stream's subject index, then one get per key.

        (A KV watch or ``keys()`` can report "no more entries" before the first one arrives.)
        """
        stream = f"KV_{RECORDS_BUCKET}"
        subject_prefix = f"$KV.{RECORDS_BUCKET}."
        info = await self._js.stream_info(stream, subjects_filter=f"{subject_prefix}{prefix}.>")
        keys = sorted(s.removeprefix(subject_prefix) for s in (info.state.subjects or {}))
        found = [await self._get(key, model) for key in keys]
        return [record for record in found if record is not None]

    async def identity(self, identity_id: str) -> IdentityRecord | None:
        return await self._get(f"identity.{identity_id}", IdentityRecord)

    async def put_identity(self, record: IdentityRecord) -> None:
        await self._put(f"identity.{record.id}", record)

    async def identities(self) -> list[IdentityRecord]:
        return await self._list("identity", IdentityRecord)

    async def agent(self, agent_id: str) -> AgentRecord | None:
        return await self._get(f"agent.{agent_id}", AgentRecord)

    async def put_agent(self, record: AgentRecord) -> None:
        await self._put(f"agent.{record.id}", record)

    async def agents(self) -> list[AgentRecord]:
        return await self._list("agent", AgentRecord)

    async def agent_history(self, agent_id: str) -> AgentHistory:
        return await self._get(f"history.{agent_id}", AgentHistory) or AgentHistory(id=agent_id)

    async def note_card(self, agent_id: str, entry: CardVersion, keep: int = 50) -> None:
        history = await self.agent_history(agent_id)
        history.entries = [*history.entries, entry][-keep:]
        await self._put(f"history.{agent_id}", history)

    async def mcp_server(self, server_id: str) -> McpServerRecord | None:
        return await self._get(f"mcp.{server_id}", McpServerRecord)

    async def put_mcp_server(self, record: McpServerRecord) -> None:
        await self._put(f"mcp.{record.id}", record)

    async def mcp_servers(self) -> list[McpServerRecord]:
        return await self._list("mcp", McpServerRecord)

    async def producer(self, nkey: str) -> ProducerRecord | None:
        return await self._get(f"producer.{nkey}", ProducerRecord)

    async def put_producer(self, record: ProducerRecord) -> None:
        await self._put(f"producer.{record.nkey}", record)

    async def producers(self) -> list[ProducerRecord]:
        return await self._list("producer", ProducerRecord)

    async def use_nonce(self, namespace: str, nonce: str) -> bool:
        """Record a single-use value; False if it was seen before (within the nonce TTL)."""
        try:
            await self._nonces.create(f"{namespace}.{nonce}", b"1")
        except KeyWrongLastSequenceError:
            return False
        return True
