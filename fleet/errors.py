"""One root error type with a stable code; each package subclasses it.

An error crosses a process boundary as data, never as text: the envelope of :meth:`FleetError.to_dict`
(``code``, ``message``, ``retryable``, ``retry_after_s``, ``details``, and the ``cause`` it wraps,
itself an envelope), read back with :meth:`FleetError.from_dict`. Each wire carries the envelope in its
own convention: an HTTP answer is RFC 9457 problem details (:meth:`FleetError.problem`, read with
:meth:`FleetError.from_response`), a JSON-RPC error (A2A) has it as its ``data``
(:func:`fleet.a2a_support.error_of_a2a`), an MCP tool's error answer as its structured content
(:mod:`fleet.mcp_errors`). No code is ever written into a message or parsed out of one.

The table :data:`HTTP_STATUS` is the single place where error codes meet HTTP status codes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    """Stable, documented error codes. Never rename one; add new ones."""

    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    NO_SPECIALIST = "no_specialist_for_skill"
    SPECIALIST_UNAVAILABLE = "specialist_unavailable"
    SPECIALIST_FAILED = "specialist_failed"
    TOOL_FAILED = "tool_failed"
    OUTCOME_UNKNOWN = "outcome_unknown"
    NEEDS_HUMAN = "needs_human"
    POLICY_DENIED = "policy_denied"
    POLICY_UNAVAILABLE = "policy_unavailable"
    CARD_INVALID = "card_invalid"
    DEPENDENCY_UNAVAILABLE = "dependency_unavailable"
    STACK_FAILED = "stack_failed"
    INTERNAL = "internal"
    PUSH_URL_REFUSED = "push_url_refused"
    APPROVAL_EXPIRED = "approval_expired"
    CANCELED = "canceled"
    APPROVAL_REJECTED = "approval_rejected"
    TOO_LARGE = "too_large"
    UNSCANNABLE = "unscannable"
    BUDGET_EXHAUSTED = "budget_exhausted"
    BAD_ANSWER = "specialist_bad_answer"
    LLM_UNAVAILABLE = "llm_unavailable"
    # The model's endpoint answered 429 (rate limited) more often than policy lets the loop wait out.
    LLM_RATE_LIMITED = "llm_rate_limited"
    # The model's endpoint refused a request as longer than its context window.
    LLM_CONTEXT_EXCEEDED = "llm_context_exceeded"
    # An agent loop that repeats itself (the same call, the same output, too many calls in a turn):
    # stopped by policy rather than let run on.
    NON_CONVERGING = "non_converging"
    STACK_NOT_RUNNING = "stack_not_running"
    INSECURE_TRANSPORT = "insecure_transport"
    TENANT_KEY_REFUSED = "tenant_key_refused"
    INTEGRITY_FAILED = "integrity_failed"
    SKILL_NOT_ALLOWED = "skill_not_allowed"  # a card claims a skill its identity may not offer
    CONTEXT_REFUSED = "context_refused"  # an A2A context id another principal or tenant made
    # A gated tool call and its approval grant (see fleet.approvals): none was sent; one that is not
    # the registry's (forged, malformed); one past its life; one for another tenant, run, tool or
    # arguments; one used before.
    APPROVAL_REQUIRED = "approval_required"
    APPROVAL_INVALID = "approval_invalid"
    APPROVAL_GRANT_EXPIRED = "approval_grant_expired"
    APPROVAL_MISMATCH = "approval_mismatch"
    APPROVAL_REPLAYED = "approval_replayed"
    # The sandbox: a call's processes together passed its cgroup memory limit (the kernel's OOM
    # killer ended some of them).
    SANDBOX_OOM = "sandbox_oom"
    # A fetch of a URL from outside (a card, a webhook, a partner's token endpoint; see
    # fleet.outbound): a target policy or the address check refuses; an answer over the byte cap;
    # no complete answer by the deadline.
    FETCH_REFUSED = "fetch_refused"
    FETCH_TOO_LARGE = "fetch_too_large"
    FETCH_TIMEOUT = "fetch_timeout"
    # The SQL tool: a statement that calls a function or reads a relation outside what a tenant's
    # query may reach; a result (or one row of it) larger than the byte cap.
    SQL_REFUSED = "sql_refused"
    RESULT_TOO_LARGE = "result_too_large"
    STREAM_LIMIT = "stream_limit"  # too many event streams open at once (principal, tenant, process)
    # A tenant's own share of a shared path is used up (scans queued, runs in flight) or it asks
    # more often than policy allows (tokens, events): retry after ``retry_after_s``.
    QUOTA_EXCEEDED = "quota_exceeded"
    RATE_LIMITED = "rate_limited"
    BODY_TOO_LARGE = "body_too_large"  # a request body over the service's cap (fleet.bodylimit)
    MANIFEST_INVALID = "manifest_invalid"  # a fleet manifest (fleet.toml) that cannot be run
    POLICY_QUERY_INVALID = "policy_query_invalid"  # a Rego query that does not parse (fleet policy eval)


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.POLICY_DENIED: 403,
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.MANIFEST_INVALID: 400,
    ErrorCode.POLICY_QUERY_INVALID: 400,
    ErrorCode.CARD_INVALID: 400,
    ErrorCode.PUSH_URL_REFUSED: 400,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.UNSCANNABLE: 422,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.NO_SPECIALIST: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.SPECIALIST_UNAVAILABLE: 502,
    ErrorCode.SPECIALIST_FAILED: 502,
    ErrorCode.TOOL_FAILED: 502,
    ErrorCode.OUTCOME_UNKNOWN: 502,
    ErrorCode.NEEDS_HUMAN: 409,
    ErrorCode.CANCELED: 409,
    ErrorCode.APPROVAL_REJECTED: 409,
    ErrorCode.BUDGET_EXHAUSTED: 429,
    ErrorCode.BAD_ANSWER: 502,
    ErrorCode.LLM_UNAVAILABLE: 503,
    ErrorCode.LLM_RATE_LIMITED: 429,
    ErrorCode.LLM_CONTEXT_EXCEEDED: 413,
    ErrorCode.NON_CONVERGING: 422,
    ErrorCode.DEPENDENCY_UNAVAILABLE: 503,
    ErrorCode.POLICY_UNAVAILABLE: 503,
    ErrorCode.STACK_FAILED: 500,
    ErrorCode.STACK_NOT_RUNNING: 503,
    ErrorCode.INSECURE_TRANSPORT: 400,
    ErrorCode.TENANT_KEY_REFUSED: 403,
    ErrorCode.SKILL_NOT_ALLOWED: 403,
    ErrorCode.INTEGRITY_FAILED: 500,
    ErrorCode.CONTEXT_REFUSED: 403,
    ErrorCode.APPROVAL_REQUIRED: 403,
    ErrorCode.APPROVAL_INVALID: 403,
    ErrorCode.APPROVAL_GRANT_EXPIRED: 403,
    ErrorCode.APPROVAL_MISMATCH: 403,
    ErrorCode.APPROVAL_REPLAYED: 409,
    ErrorCode.SANDBOX_OOM: 422,
    ErrorCode.FETCH_REFUSED: 400,
    ErrorCode.FETCH_TOO_LARGE: 502,
    ErrorCode.FETCH_TIMEOUT: 504,
    ErrorCode.SQL_REFUSED: 403,
    ErrorCode.RESULT_TOO_LARGE: 413,
    ErrorCode.STREAM_LIMIT: 429,
    ErrorCode.QUOTA_EXCEEDED: 429,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.INTERNAL: 500,
}


# RFC 9457: an HTTP error answer's media type, and the ``type`` URI of each code (``urn:`` + code).
PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:agent-fleet:error:"
# What an envelope read from elsewhere may hold: a message this long, causes this deep.
MAX_MESSAGE_CHARS = 4000
MAX_CAUSE_DEPTH = 4
MAX_DETAILS_CHARS = 4096


class FleetError(Exception):
    """Root of every error the platform raises on purpose.

    ``code`` is stable and safe to show a caller; ``message`` must never carry secrets or another
    tenant's data; ``retryable`` tells a caller whether the same request may succeed later, and
    ``retry_after_s`` (if known) when (an HTTP answer's ``Retry-After``). ``details`` are facts a
    program may act on (JSON values); ``cause`` is the error of the layer below that this one wraps
    (a tool's refusal inside an agent's failure inside a run's), kept as data down the chain.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        retryable: bool = False,
        retry_after_s: int | None = None,
        details: Mapping[str, Any] | None = None,
        cause: FleetError | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.details: dict[str, Any] = dict(details or {})
        self.cause = cause

    def chain(self) -> list[FleetError]:
        """This error, then its cause, then the cause's cause, ..."""
        out: list[FleetError] = []
        error: FleetError | None = self
        while error is not None and len(out) <= MAX_CAUSE_DEPTH:
            out.append(error)
            error = error.cause
        return out

    @property
    def http_status(self) -> int:
        """The HTTP status this error is answered with on an HTTP API (500 for a code without one)."""
        return HTTP_STATUS.get(self.code, 500)

    def to_dict(self) -> dict[str, Any]:
        """The error as data (the envelope): ``code``, ``message``, ``retryable``, and
        ``retry_after_s``, ``details`` and ``cause`` (an envelope) when there are any."""
        out: dict[str, Any] = {
            "code": str(self.code),
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.retry_after_s is not None:
            out["retry_after_s"] = self.retry_after_s
        if self.details:
            out["details"] = self.details
        if self.cause is not None:
            out["cause"] = self.cause.to_dict()
        return out

    @classmethod
    def from_dict(
        cls, data: object, *, fallback: ErrorCode = ErrorCode.INTERNAL, _depth: int = 0
    ) -> FleetError:
        """The error an envelope (from another process) describes. A code this version does not
        know becomes ``fallback``, the code as sent kept in ``details["code"]``; a message is cut at
        ``MAX_MESSAGE_CHARS`` and causes below ``MAX_CAUSE_DEPTH`` are dropped. Something that is no
        envelope at all is ``fallback`` saying so.

        It is always a plain :class:`FleetError`, never a subclass that changes what its catcher
        does: another process's word that a dependency is unavailable is not the fleet's own control
        plane failing over (:class:`DependencyUnavailable`), which only a client of that control
        plane may conclude (see ``registry.client``)."""
        if not isinstance(data, Mapping):
            return FleetError(fallback, "the error was not described")
        given = data.get("details")
        details = dict(given) if isinstance(given, Mapping) else {}
        if len(json.dumps(details, default=str)) > MAX_DETAILS_CHARS:
            details = {"cut": "the details sent were longer than this reader keeps"}
        sent = data.get("code")
        try:
            code = ErrorCode(str(sent))
        except ValueError:
            code = fallback
            details["code"] = str(sent)[:100]
        retry_after = data.get("retry_after_s")
        cause = data.get("cause")
        kwargs: dict[str, Any] = {
            "retryable": data.get("retryable") is True,
            "retry_after_s": retry_after if isinstance(retry_after, int) and retry_after >= 0 else None,
            "details": details,
            "cause": (
                cls.from_dict(cause, fallback=fallback, _depth=_depth + 1)
                if isinstance(cause, Mapping) and _depth < MAX_CAUSE_DEPTH
                else None
            ),
        }
        return FleetError(code, str(data.get("message") or code)[:MAX_MESSAGE_CHARS], **kwargs)

    def problem(self) -> dict[str, Any]:
        """The error as an HTTP answer's body: RFC 9457 problem details (``type``, ``title``,
        ``status``, ``detail``) with the envelope as the extension member ``error``."""
        return {
            "type": PROBLEM_TYPE_PREFIX + str(self.code),
            "title": str(self.code),
            "status": self.http_status,
            "detail": self.message,
            "error": self.to_dict(),
        }

    @classmethod
    def from_problem(cls, status: int, body: object, text: str = "") -> FleetError:
        """The error an HTTP answer with ``status`` and the parsed JSON ``body`` describes (``text``:
        the raw body, for the message of an answer that is not the fleet's, such as a proxy's). The
        envelope when there is one; else a code from the status alone: a gateway's 502-504 is a
        dependency that may come back (retryable), 401 and 403 refusals, 404 not found, 429 too often."""
        error = body.get("error") if isinstance(body, Mapping) else None
        if isinstance(error, Mapping) and "code" in error:
            return cls.from_dict(error)
        code = _CODE_OF_STATUS.get(status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.INVALID_REQUEST)
        retryable = code in (ErrorCode.DEPENDENCY_UNAVAILABLE, ErrorCode.RATE_LIMITED)
        message = f"HTTP {status}" + (f": {text[:200]}" if text else "")
        return cls.from_dict({"code": str(code), "message": message, "retryable": retryable})

    def within(self, context: str) -> FleetError:
        """This error (as a plain :class:`FleetError`) with ``context``, what was being done, before
        its message; the same code, retryability, details and cause."""
        return FleetError(
            self.code,
            f"{context}: {self.message}",
            retryable=self.retryable,
            retry_after_s=self.retry_after_s,
            details=self.details,
            cause=self.cause,
        )

    @classmethod
    def from_response(cls, response: Any) -> FleetError:
        """The error an HTTP answer describes (an ``httpx`` response, or anything with
        ``status_code``, ``json()`` and ``text``): :meth:`from_problem` of its status and body."""
        try:
            body = response.json()
        except ValueError:
            body = None
        return cls.from_problem(response.status_code, body, response.text)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!s}: {self.message})"


class DependencyUnavailable(FleetError):
    """The platform's own control plane (the registry, its token service, the broker behind them)
    cannot answer right now: a node failing over, a service restarting. A run that meets it is not
    failed: its worker stops the slice and the run is retried from its checkpoint."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.DEPENDENCY_UNAVAILABLE, message, retryable=True)


class AuthError(FleetError):
    """A token is missing, malformed, expired, or not meant for this service."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAUTHENTICATED, message)


_CODE_OF_STATUS: dict[int, ErrorCode] = {
    401: ErrorCode.UNAUTHENTICATED,
    403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND,
    409: ErrorCode.CONFLICT,
    413: ErrorCode.BODY_TOO_LARGE,
    429: ErrorCode.RATE_LIMITED,
    502: ErrorCode.DEPENDENCY_UNAVAILABLE,
    503: ErrorCode.DEPENDENCY_UNAVAILABLE,
    504: ErrorCode.DEPENDENCY_UNAVAILABLE,
}
