"""Approval grants: a person's (or policy's) approval of one gated tool call, as a capability.

A tool whose policy says a call needs an approval does nothing without a grant: it answers
``{"status": "pending_approval", "approval_request": {...}}``, where the request names the server,
the tool and the exact arguments it was called with (:class:`ApprovalRequest`). When a person
approves the step (a signal the coordinator verified), the coordinator asks the registry's token
service for an **approval grant** with the approver's own token as evidence: a JWT signed by the
registry (``typ: approval-grant+jwt``, ``token_use: approval_grant``), addressed to the tool's server
and bound to the tenant, the run, the operation that asked, the tool, the SHA-256 of the canonical
JSON of the arguments (:func:`args_sha256`, the grant itself left out), the approver (the verified
subject of that token, never an argument) and the decision that let them answer; it lives
``APPROVAL_GRANT_TTL_S`` and is good once. The approved call carries it (``approval_grant``); the
tool verifies it (:mod:`mcp_servers._base`), uses it up in its own database in the transaction of
the effect, and records the approver from it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

APPROVAL_GRANT_TYPE = "urn:fleet:params:oauth:token-type:approval-grant"
APPROVAL_GRANT_TYP = "approval-grant+jwt"
APPROVAL_GRANT = "approval_grant"  # its token_use, and the tool argument that carries it
APPROVAL_GRANT_TTL_S = 600  # minutes: it is asked for when the person answers, used when the run resumes
POLICY_APPROVER = "policy"  # the approver of a grant that policy gave, on facts the fleet computed

# A grant's binding: the token request's field, and what it must look like.
BINDING_FIELDS = {
    "run_id": re.compile(r"[A-Za-z0-9_-]{1,128}"),
    "approval_op": re.compile(r"[A-Za-z0-9._:@/~-]{1,200}"),
    "approval_tool": re.compile(r"[A-Za-z0-9_.-]{1,100}"),
    "approval_sha256": re.compile(r"[0-9a-f]{64}"),
    "approval_decision": re.compile(r"[A-Za-z0-9._:-]{1,200}"),
}


def canonical_json(value: Any) -> bytes:
    """The canonical JSON of ``value``: sorted keys, no spaces, UTF-8, and a whole number written
    as one whatever its type (JSON has one kind of number, and A2A carries every number as a
    double: ``25000`` and ``25000.0`` are the same argument). What the hash is over."""
    return json.dumps(_whole(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _whole(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _whole(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole(item) for item in value]
    return value


def args_sha256(arguments: dict[str, Any]) -> str:
    """The SHA-256 (hex) of a tool call's arguments, its approval grant left out."""
    return hashlib.sha256(
        canonical_json({k: v for k, v in arguments.items() if k != APPROVAL_GRANT})
    ).hexdigest()


@dataclass(frozen=True, slots=True)
class ApprovalBinding:
    """What one approval grant is good for."""

    run_id: str
    op_id: str  # the coordinator's operation whose call asked for the approval
    server: str  # the tool's MCP server (the grant's audience)
    tool: str
    args_sha256: str
    decision_id: str  # the decision that let the approver answer (or that approved, for policy)

    def form(self) -> dict[str, str]:
        """The token request's fields for it (``audience`` aside)."""
        return {
            "run_id": self.run_id,
            "approval_op": self.op_id,
            "approval_tool": self.tool,
            "approval_sha256": self.args_sha256,
            "approval_decision": self.decision_id,
        }

    def claim(self, approver: str, by: str) -> dict[str, str]:
        """The grant's ``approval`` claim; ``by``: ``person`` or ``policy``."""
        return {
            "op_id": self.op_id,
            "server": self.server,
            "tool": self.tool,
            "args_sha256": self.args_sha256,
            "decision_id": self.decision_id,
            "approver": approver,
            "by": by,
        }


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """What a tool says it needs approved: the server, the tool and the exact arguments."""

    server: str
    tool: str
    arguments: dict[str, Any]

    @property
    def args_sha256(self) -> str:
        return args_sha256(self.arguments)

    def to_json(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "tool": self.tool,
            "arguments": self.arguments,
            "args_sha256": self.args_sha256,
        }

    @classmethod
    def of(cls, value: Any) -> ApprovalRequest | None:
        """The request a step's pending answer carries (``approval_request``), or None. Its hash
        is computed here from the arguments a person is shown, never taken from the answer."""
        if not isinstance(value, dict):
            return None
        server, tool, arguments = value.get("server"), value.get("tool"), value.get("arguments")
        if not isinstance(server, str) or not isinstance(tool, str) or not isinstance(arguments, dict):
            return None
        if APPROVAL_GRANT in arguments:
            return None
        return cls(server, tool, arguments)
