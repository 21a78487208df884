"""The registry's records in NATS KV, so that any process can read or watch them; each one signed
by the registry and verified when read back (:mod:`registry._seal`)."""

from __future__ import annotations

import logging
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from fleet.natsconn import key_value
from registry._records import (
    AgentHistory,
    AgentRecord,
    CardVersion,
    IdentityRecord,
    McpServerRecord,
    ProducerRecord,
)
from registry._seal import RecordSeal

log = logging.getLogger(__name__)

RECORDS_BUCKET = "fleet-registry"
NONCES_BUCKET = "fleet-nonces"
NONCE_TTL_S = 900.0

M = TypeVar("M", bound=BaseModel)


class RegistryStore:
    """Typed access to the registry bucket (``identity.<id>``, ``agent.<id>``, ``mcp.<id>``) and to
    the single-use nonce bucket (assertion and enrollment ``jti``s). A record that the registry
    did not sign (see ``seal``) reads as absent."""

    def __init__(self, js: JetStreamContext, records: KeyValue, nonces: KeyValue, seal: RecordSeal) -> None:
        self._js = js
        self._records = records
        self._nonces = nonces
        self.seal = seal

    @classmethod
    async def open(cls, client: NATS, seal: RecordSeal) -> RegistryStore:
        records = await key_value(client, RECORDS_BUCKET, history=5)
        nonces = await key_value(client, NONCES_BUCKET, history=1, ttl_s=NONCE_TTL_S)
        return cls(client.jetstream(), records, nonces, seal)

    async def _get(self, key: str, model: type[M]) -> M | None:
        try:
            entry = await self._records.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None:
            return None
        record = self.seal.open(key, entry.value)
        if record is None:
            return None
        try:
            return model.model_validate(record)
        except ValidationError:
            log.warning("ignoring the registry record %s: it does not read as a %s", key, model.__name__)
            return None

    async def _put(self, key: str, record: BaseModel) -> None:
        await self._records.put(key, self.seal.seal(key, record.model_dump(mode="json")))

    async def reseal(self) -> int:
        """Sign every record that verifies again with the current key (before one of the
        registry's keys is revoked: what it signed would read as absent after); how many."""
        resealed = 0
        for key in await self._keys(""):
            try:
                entry = await self._records.get(key)
            except (KeyNotFoundError, KeyDeletedError):
                continue
            if entry.value is None or self.seal.signer is None:
                continue
            if self.seal.signer_of(entry.value) == self.seal.signer.key.kid:
                continue
            record = self.seal.open(key, entry.value)
            if record is None:
                continue
            try:  # unless it was written meanwhile (by this key, then)
                await self._records.update(key, self.seal.seal(key, record), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            resealed += 1
        return resealed

    async def _keys(self, prefix: str) -> list[str]:
        stream = f"KV_{RECORDS_BUCKET}"
        subject_prefix = f"$KV.{RECORDS_BUCKET}."
        pattern = f"{subject_prefix}{prefix}.>" if prefix else f"{subject_prefix}>"
        info = await self._js.stream_info(stream, subjects_filter=pattern)
        return sorted(s.removeprefix(subject_prefix) for s in (info.state.subjects or {}))

    async def _list(self, prefix: str, model: type[M]) -> list[M]:
        """Current records under ``prefix``: the stream's subject index, then one get per key.

        (A KV watch or ``keys()`` can report "no more entries" before the first one arrives.)
        """
        found = [await self._get(key, model) for key in await self._keys(prefix)]
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
