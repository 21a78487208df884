"""One root error type with a stable code; each package subclasses it.

The table :data:`HTTP_STATUS` is the single place where error codes meet HTTP status codes.
"""

from __future__ import annotations

from enum import StrEnum


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


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.POLICY_DENIED: 403,
    ErrorCode.INVALID_REQUEST: 400,
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


class FleetError(Exception):
    """Root of every error the platform raises on purpose.

    ``code`` is stable and safe to show a caller; ``message`` must never carry secrets or another
    tenant's data; ``retryable`` tells a caller whether the same request may succeed later, and
    ``retry_after_s`` (if known) when (an HTTP answer's ``Retry-After``).
    """

    def __init__(
        self, code: ErrorCode, message: str, *, retryable: bool = False, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.retry_after_s = retry_after_s

    @property
    def http_status(self) -> int:
        """The HTTP status this error is answered with on an HTTP API (500 for a code without one)."""
        return HTTP_STATUS.get(self.code, 500)

    def to_dict(self) -> dict[str, object]:
        """The error as data: ``code``, ``message``, ``retryable`` and ``retry_after_s`` if any."""
        out: dict[str, object] = {
            "code": str(self.code),
            "message": self.message,
            "retryable": self.retryable,
        }
        if self.retry_after_s is not None:
            out["retry_after_s"] = self.retry_after_s
        return out

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
