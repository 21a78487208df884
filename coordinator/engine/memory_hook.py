"""At a run's end, its memory is consolidated: the worker asks the memory MCP server to turn the run's
episodic entries into semantic facts and procedural rules, each through the memory gate.

The call is made after the run is completed and before its work message is acked, so a worker that
dies in between leaves a redelivery that calls it again; consolidating a run twice changes nothing (a
candidate already stored gains no second support from the same run). It never fails the run: a fleet
without a memory server, or one that is down, only logs why the run's memory was not consolidated.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fleet import mcp_client
from fleet.errors import FleetError
from fleet.mcp_errors import error_of
from registry import McpServerRecord, RegistryClient

log = logging.getLogger(__name__)

MEMORY_SERVER = "mcp-memory"
SCOPE = "memory:consolidate"
SERVER_FRESH_S = 30.0  # the memory server's record is read again after this (or after a failed call)


class RunMemory:
    """Consolidates a finished run's memory through the memory server named ``server_id``."""

    def __init__(
        self, registry: RegistryClient, server_id: str = MEMORY_SERVER, timeout_s: float = 60.0
    ) -> None:
        self._registry = registry
        self.server_id = server_id
        self.timeout_s = timeout_s
        self._server: tuple[McpServerRecord, float] | None = None  # the record, and when it was read
        # one session kept with the server: a consolidation is one request, each with its own token
        self._http = mcp_client.http_client(auth=mcp_client.ContextBearer(), timeout=timeout_s)
        self._sessions = mcp_client.Sessions(self._http)

    async def aclose(self) -> None:
        """Close the session with the memory server and its HTTP client."""
        await self._sessions.aclose()
        await self._http.aclose()

    async def _server_record(self) -> McpServerRecord:
        """The memory server's record: read from the registry once per ``SERVER_FRESH_S``, not per
        run (its address changes only when it is deployed again)."""
        if self._server is not None and time.monotonic() - self._server[1] < SERVER_FRESH_S:
            return self._server[0]
        record = await self._registry.mcp_server(self.server_id)
        self._server = (record, time.monotonic())
        return record

    async def consolidate(self, tenant: str, run_id: str) -> dict[str, Any] | None:
        """What consolidation made of the run (counts by outcome), or None if it could not run."""
        try:
            server = await self._server_record()
            token = await self._registry.tokens.token(self.server_id, tenant, [SCOPE])
        except FleetError as exc:
            log.info("run %s: memory not consolidated (%s)", run_id, exc.message)
            return None
        except Exception as exc:  # the registry unreachable: never the run's failure
            log.warning("run %s: memory not consolidated (%s: %s)", run_id, type(exc).__name__, exc)
            return None
        try:
            with mcp_client.bearer(token), mcp_client.transit() as record:
                async with self._sessions.session(server.url, revision=str(server.registered_at)) as client:
                    result = await client.call_tool("consolidate", {"run_id": run_id})
        except Exception as exc:  # a memory server that is down must not touch the run
            self._server = None  # it may have moved: read its record again next time
            failed = record.error or exc  # what failed in transit, not the SDK's stand-in for it
            log.warning("run %s: memory not consolidated (%s: %s)", run_id, type(failed).__name__, failed)
            return None
        error = error_of(result)
        if error is not None:
            log.warning("run %s: memory not consolidated (%s): %s", run_id, error.code, error.message[:300])
            return None
        outcomes = (result.structured_content or {}).get("result", [])
        counts: dict[str, Any] = {}
        for outcome in outcomes:
            counts[outcome.get("status", "?")] = counts.get(outcome.get("status", "?"), 0) + 1
        log.info("run %s: memory consolidated %s", run_id, counts or "(nothing to consolidate)")
        return counts
