"""The fleet's operations extension to A2A: how a caller makes a request idempotent and asks, later,
what became of it.

- The caller puts an operation id in the message metadata under ``fleet.operation_id``. An agent that
  declares the extension runs an operation at most once: the same id again gets the recorded outcome
  (or joins the run in progress), never a second execution.
- ``GET {status_url}`` (the card's extension params; bearer auth as for the agent itself, scoped to
  the token's tenant) answers ``{"operation_id", "status", "result", "error"}`` where status is one of
  ``unknown`` (never received), ``running``, ``succeeded``, ``failed``, ``interrupted`` (the agent died
  while running it) or ``uncertain`` (a tool call's outcome could not be confirmed). ``?wait=S`` holds
  the answer up to S seconds while the operation runs.

An agent without the extension cannot answer; a caller that needs to know treats it as unable to say.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from a2a.types import AgentCard, AgentExtension

OPERATIONS_EXTENSION = "https://agent-fleet.dev/ext/operations/v1"
OPERATION_METADATA_KEY = "fleet.operation_id"
OPERATIONS_PATH = "/v1/operations"
MAX_WAIT_S = 30.0


def operations_extension(base_url: str) -> AgentExtension:
    extension = AgentExtension(
        uri=OPERATIONS_EXTENSION,
        description="Idempotent operations: send metadata fleet.operation_id; ask status_url for its outcome.",
        required=False,
    )
    extension.params.update({"status_url": f"{base_url}{OPERATIONS_PATH}/{{operation_id}}"})
    return extension


def status_url(card: AgentCard) -> str | None:
    """The operation status URL template of an agent that declares the extension, else None."""
    for extension in card.capabilities.extensions:
        if extension.uri == OPERATIONS_EXTENSION:
            url = extension.params.fields.get("status_url")
            if url is not None and url.string_value:
                return url.string_value
    return None


def args_hash(args: Mapping[str, Any]) -> str:
    """The hash that binds an operation id to its exact arguments (canonical JSON, SHA-256)."""
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()
