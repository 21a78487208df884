"""The vector store under long-term memory, confined to one tenant in every call.

Every method takes the tenant first and adds ``tenant == <it>`` to whatever it reads, counts or
deletes: no method reads across tenants, so a caller's mistake cannot either (the one exception,
:meth:`VectorStore.tenants`, lists the tenants that have memory, for the retention sweep). The tenant
field carries Qdrant's tenant index (``is_tenant``), which keeps each tenant's points together.

Two backends with one behaviour:

- :class:`EdgeStore`, the default: Qdrant's embedded engine (``qdrant-edge-py``) in the memory
  server's process, one shard in its state directory (one process per shard: the memory server is
  the store's single writer);
- :class:`QdrantServerStore`: a Qdrant server or cluster through ``qdrant-client`` (production).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fleet.errors import ErrorCode, FleetError

TIERS = ("episodic", "semantic", "procedural")
COLLECTION = "fleet_memory"
_INDEXED_KEYWORDS = ("tier", "status", "run_id", "support_runs", "agent", "source_kind", "content_hash")
_INDEXED_FLOATS = ("created_at",)


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry as stored: its id, tier, text, vector (on write) and payload (provenance etc.)."""

    id: str
    tier: str
    text: str
    payload: dict[str, Any] = field(default_factory=dict)
    vector: list[float] | None = None
    score: float | None = None  # on search: the similarity to the query


@dataclass(frozen=True, slots=True)
class Where:
    """Which entries of a tenant: every field given must match (None: any)."""

    ids: Sequence[str] | None = None
    tiers: Sequence[str] | None = None
    status: str | None = None
    run_id: str | None = None
    support_run: str | None = None  # the run is among the entry's supporting runs
    agent: str | None = None
    source_kind: str | None = None
    content_hash: str | None = None
    created_before: float | None = None


class VectorStore(Protocol):
    """What memory needs of a vector store. ``tenant`` is never optional."""

    async def open(self, dim: int) -> None: ...

    async def close(self) -> None: ...

    async def upsert(self, tenant: str, entries: Sequence[Entry]) -> None: ...

    async def search(
        self, tenant: str, vector: Sequence[float], *, limit: int, where: Where | None = None
    ) -> list[Entry]: ...

    async def get(self, tenant: str, ids: Sequence[str]) -> list[Entry]: ...

    async def scroll(
        self, tenant: str, *, where: Where | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Entry], str | None]: ...

    async def count(self, tenant: str, where: Where | None = None) -> int: ...

    async def set_payload(self, tenant: str, entry_id: str, payload: dict[str, Any]) -> None: ...

    async def delete(self, tenant: str, where: Where) -> list[str]: ...

    async def tenants(self) -> list[str]: ...


def _require_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not tenant:
        raise FleetError(ErrorCode.FORBIDDEN, "memory is always read and written for one tenant")
    return tenant


def point_id(entry_id: str) -> str:
    """Qdrant takes UUIDs (or integers) as point ids."""
    try:
        return str(uuid.UUID(entry_id))
    except ValueError:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"{entry_id!r} is not a memory id") from None


def _payload(tenant: str, entry: Entry) -> dict[str, Any]:
    return {**entry.payload, "tenant": tenant, "tier": entry.tier, "text": entry.text}


def _entry(point_id: Any, payload: dict[str, Any] | None, score: float | None = None) -> Entry:
    payload = dict(payload or {})
    payload.pop("tenant", None)
    return Entry(
        id=str(point_id),
        tier=str(payload.pop("tier", "")),
        text=str(payload.pop("text", "")),
        payload=payload,
        score=score,
    )


class _TenantStore:
    """What both backends share: the conditions a :class:`Where` stands for, and the calls made of
    other calls (get, delete, set_payload). Subclasses supply the primitives."""

    def _conditions(self, tenant: str, where: Where | None) -> list[tuple[str, str, Any]]:
        """(kind, field, value), kind one of match, any, ids, before; the tenant's always first."""
        conditions: list[tuple[str, str, Any]] = [("match", "tenant", _require_tenant(tenant))]
        where = where or Where()
        if where.ids is not None:
            conditions.append(("ids", "", [point_id(i) for i in where.ids]))
        if where.tiers is not None:
            conditions.append(("any", "tier", list(where.tiers)))
        for key in ("status", "run_id", "support_run", "agent", "source_kind", "content_hash"):
            value = getattr(where, key)
            if value is not None:
                conditions.append(("match", "support_runs" if key == "support_run" else key, value))
        if where.created_before is not None:
            conditions.append(("before", "created_at", where.created_before))
        return conditions

    async def scroll(
        self, tenant: str, *, where: Where | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Entry], str | None]:
        raise NotImplementedError

    async def _delete_ids(self, ids: list[str]) -> None:
        raise NotImplementedError

    async def _set_fields(self, entry_id: str, fields: dict[str, Any]) -> None:
        raise NotImplementedError

    async def get(self, tenant: str, ids: Sequence[str]) -> list[Entry]:
        if not ids:
            return []
        entries, _ = await self.scroll(tenant, where=Where(ids=ids), limit=len(ids))
        return entries

    async def delete(self, tenant: str, where: Where) -> list[str]:
        _require_tenant(tenant)
        ids: list[str] = []
        after: str | None = None
        while True:
            page, after = await self.scroll(tenant, where=where, limit=1000, after=after)
            ids.extend(entry.id for entry in page)
            if after is None:
                break
        if ids:
            await self._delete_ids([point_id(i) for i in ids])
        return ids

    async def set_payload(self, tenant: str, entry_id: str, payload: dict[str, Any]) -> None:
        _require_tenant(tenant)
        if not await self.get(tenant, [entry_id]):
            raise FleetError(ErrorCode.NOT_FOUND, f"no memory {entry_id} for this tenant")
        fields = {k: v for k, v in payload.items() if k not in ("tenant", "tier", "text")}
        await self._set_fields(point_id(entry_id), fields)


# --------------------------------------------------------------------------------- qdrant edge
class EdgeStore(_TenantStore):
    """Qdrant's embedded engine, in this process. Its calls take microseconds to a few milliseconds
    and run on the event loop; building the HNSW index (:meth:`optimize`) runs in a thread."""

    def __init__(self, path: Path, *, hnsw_m: int = 16, ef_construct: int = 100) -> None:
        self.path = path
        self.hnsw_m = hnsw_m
        self.ef_construct = ef_construct
        self._shard: Any = None
        self._optimizing: asyncio.Task[bool] | None = None

    async def open(self, dim: int) -> None:
        import qdrant_edge as q

        config = q.EdgeConfig(
            vectors=q.EdgeVectorParams(size=dim, distance=q.Distance.Cosine),
            hnsw_config=q.HnswIndexConfig(
                m=self.hnsw_m, ef_construct=self.ef_construct, full_scan_threshold=10_000
            ),
        )
        config_file = self.path / "edge_config.json"
        if config_file.exists():
            size = json.loads(config_file.read_text()).get("vectors", {}).get("", {}).get("size")
            if size is not None and size != dim:
                raise FleetError(
                    ErrorCode.INVALID_REQUEST,
                    f"the memory store at {self.path} holds {size}-dimensional vectors; the embedding"
                    f" model makes {dim}: re-embed into a new store, or use the model it was built with",
                )
            shard = q.EdgeShard.load(str(self.path))
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            shard = q.EdgeShard.create(str(self.path), config)
        schema = shard.info().payload_schema or {}
        if "tenant" not in schema:
            shard.update(q.UpdateOperation.create_field_index("tenant", q.KeywordIndexParams(is_tenant=True)))
        for name in _INDEXED_KEYWORDS:
            if name not in schema:
                shard.update(q.UpdateOperation.create_field_index(name, q.PayloadSchemaType.Keyword))
        for name in _INDEXED_FLOATS:
            if name not in schema:
                shard.update(q.UpdateOperation.create_field_index(name, q.PayloadSchemaType.Float))
        self._shard = shard

    async def close(self) -> None:
        if self._optimizing is not None:
            with contextlib.suppress(Exception):
                await self._optimizing
        if self._shard is not None:
            self._shard.flush()
            self._shard.close()
            self._shard = None

    @property
    def shard(self) -> Any:
        if self._shard is None:
            raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "the memory store is not open", retryable=True)
        return self._shard

    def _filter(self, tenant: str, where: Where | None) -> Any:
        import qdrant_edge as q

        must: list[Any] = []
        for kind, key, value in self._conditions(tenant, where):
            if kind == "ids":
                must.append(q.HasIdCondition(point_ids=set(value)))
            elif kind == "any":
                must.append(q.FieldCondition(key=key, match=q.MatchAny(any=value)))
            elif kind == "before":
                must.append(q.FieldCondition(key=key, range=q.RangeFloat(lt=value)))
            else:
                must.append(q.FieldCondition(key=key, match=q.MatchValue(value=value)))
        return q.Filter(must=must)

    async def upsert(self, tenant: str, entries: Sequence[Entry]) -> None:
        import qdrant_edge as q

        _require_tenant(tenant)
        points = []
        for entry in entries:
            if entry.vector is None:
                raise FleetError(ErrorCode.INTERNAL, "an entry reaches the store without its vector")
            points.append(q.Point(point_id(entry.id), list(entry.vector), _payload(tenant, entry)))
        if points:
            self.shard.update(q.UpdateOperation.upsert_points(points))

    async def search(
        self, tenant: str, vector: Sequence[float], *, limit: int, where: Where | None = None
    ) -> list[Entry]:
        import qdrant_edge as q

        _require_tenant(tenant)
        where_filter = self._filter(tenant, where)  # refuses a call without a tenant before anything
        hits = self.shard.query(
            q.QueryRequest(
                limit=limit,
                query=q.Query.Nearest(list(vector)),
                filter=where_filter,
                with_payload=True,
            )
        )
        return [_entry(hit.id, hit.payload, float(hit.score)) for hit in hits]

    async def scroll(
        self, tenant: str, *, where: Where | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Entry], str | None]:
        import qdrant_edge as q

        _require_tenant(tenant)
        records, next_id = self.shard.scroll(
            q.ScrollRequest(
                offset=point_id(after) if after else None,
                limit=limit,
                filter=self._filter(tenant, where),
                with_payload=True,
            )
        )
        return [_entry(r.id, r.payload) for r in records], (str(next_id) if next_id is not None else None)

    async def count(self, tenant: str, where: Where | None = None) -> int:
        import qdrant_edge as q

        _require_tenant(tenant)
        return int(self.shard.count(q.CountRequest(exact=True, filter=self._filter(tenant, where))))

    async def _delete_ids(self, ids: list[str]) -> None:
        import qdrant_edge as q

        self.shard.update(q.UpdateOperation.delete_points(list[Any](ids)))

    async def _set_fields(self, entry_id: str, fields: dict[str, Any]) -> None:
        import qdrant_edge as q

        self.shard.update(q.UpdateOperation.set_payload([entry_id], fields))

    async def tenants(self) -> list[str]:
        import qdrant_edge as q

        response = self.shard.facet(q.FacetRequest(key="tenant", limit=1_000_000, exact=True))
        return sorted(str(hit.value) for hit in response.hits)

    def unindexed(self) -> int:
        info = self.shard.info()
        return int(info.points_count) - int(info.indexed_vectors_count or 0)

    async def optimize(self) -> bool:
        """Build the vector index over what was written since the last build (in a thread; one at a
        time). Searches and writes carry on meanwhile."""
        if self._optimizing is None or self._optimizing.done():
            self._optimizing = asyncio.create_task(asyncio.to_thread(self.shard.optimize))
        return await asyncio.shield(self._optimizing)


# ------------------------------------------------------------------------------ qdrant server
class QdrantServerStore(_TenantStore):
    """A Qdrant server or cluster, through ``qdrant-client`` (REST, or gRPC when ``prefer_grpc``)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        collection: str = COLLECTION,
        prefer_grpc: bool = False,
        client: Any = None,
    ) -> None:
        """``client``: an ``AsyncQdrantClient`` made elsewhere (used as given, e.g. local mode)."""
        self.url = url
        self.api_key = api_key
        self.collection = collection
        self.prefer_grpc = prefer_grpc
        self._client: Any = client

    async def open(self, dim: int) -> None:
        from qdrant_client import AsyncQdrantClient
        from qdrant_client import models as m

        if self._client is None:
            self._client = AsyncQdrantClient(url=self.url, api_key=self.api_key, prefer_grpc=self.prefer_grpc)
        client = self._client
        if not await client.collection_exists(self.collection):
            await client.create_collection(
                self.collection,
                vectors_config=m.VectorParams(size=dim, distance=m.Distance.COSINE),
            )
            await client.create_payload_index(
                self.collection,
                "tenant",
                m.KeywordIndexParams(type=m.KeywordIndexType.KEYWORD, is_tenant=True),
            )
            for name in _INDEXED_KEYWORDS:
                await client.create_payload_index(self.collection, name, m.PayloadSchemaType.KEYWORD)
            for name in _INDEXED_FLOATS:
                await client.create_payload_index(self.collection, name, m.PayloadSchemaType.FLOAT)
        else:
            info = await client.get_collection(self.collection)
            size = getattr(info.config.params.vectors, "size", None)
            if size is not None and size != dim:
                raise FleetError(
                    ErrorCode.INVALID_REQUEST,
                    f"collection {self.collection} holds {size}-dimensional vectors; the embedding"
                    f" model makes {dim}",
                )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def client(self) -> Any:
        if self._client is None:
            raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "the memory store is not open", retryable=True)
        return self._client

    def _filter(self, tenant: str, where: Where | None) -> Any:
        from qdrant_client import models as m

        must: list[Any] = []
        for kind, key, value in self._conditions(tenant, where):
            if kind == "ids":
                must.append(m.HasIdCondition(has_id=value))
            elif kind == "any":
                must.append(m.FieldCondition(key=key, match=m.MatchAny(any=value)))
            elif kind == "before":
                must.append(m.FieldCondition(key=key, range=m.Range(lt=value)))
            else:
                must.append(m.FieldCondition(key=key, match=m.MatchValue(value=value)))
        return m.Filter(must=must)

    async def upsert(self, tenant: str, entries: Sequence[Entry]) -> None:
        from qdrant_client import models as m

        _require_tenant(tenant)
        points = []
        for entry in entries:
            if entry.vector is None:
                raise FleetError(ErrorCode.INTERNAL, "an entry reaches the store without its vector")
            points.append(
                m.PointStruct(
                    id=point_id(entry.id), vector=list(entry.vector), payload=_payload(tenant, entry)
                )
            )
        if points:
            await self.client.upsert(self.collection, points=points, wait=True)

    async def search(
        self, tenant: str, vector: Sequence[float], *, limit: int, where: Where | None = None
    ) -> list[Entry]:
        _require_tenant(tenant)
        response = await self.client.query_points(
            self.collection,
            query=list(vector),
            query_filter=self._filter(tenant, where),
            limit=limit,
            with_payload=True,
        )
        return [_entry(p.id, p.payload, float(p.score)) for p in response.points]

    async def scroll(
        self, tenant: str, *, where: Where | None = None, limit: int = 100, after: str | None = None
    ) -> tuple[list[Entry], str | None]:
        _require_tenant(tenant)
        records, next_id = await self.client.scroll(
            self.collection,
            scroll_filter=self._filter(tenant, where),
            limit=limit,
            offset=point_id(after) if after else None,
            with_payload=True,
        )
        return [_entry(r.id, r.payload) for r in records], (str(next_id) if next_id is not None else None)

    async def count(self, tenant: str, where: Where | None = None) -> int:
        _require_tenant(tenant)
        result = await self.client.count(
            self.collection, count_filter=self._filter(tenant, where), exact=True
        )
        return int(result.count)

    async def _delete_ids(self, ids: list[str]) -> None:
        from qdrant_client import models as m

        await self.client.delete(
            self.collection, points_selector=m.PointIdsList(points=list[Any](ids)), wait=True
        )

    async def _set_fields(self, entry_id: str, fields: dict[str, Any]) -> None:
        await self.client.set_payload(self.collection, payload=fields, points=[entry_id], wait=True)

    async def tenants(self) -> list[str]:
        response = await self.client.facet(self.collection, key="tenant", limit=1_000_000, exact=True)
        return sorted(str(hit.value) for hit in response.hits)
