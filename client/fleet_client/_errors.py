"""The fleet's errors as the client reads them: the envelope's code, message and retryability."""

from __future__ import annotations

from typing import Any

import httpx


class FleetClientError(Exception):
    """An error the fleet answered (or the client met): a stable ``code``, a ``message``, whether a
    retry may help (``retryable``, after ``retry_after_s`` if given) and the envelope's ``details``."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        retry_after_s: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.details = details or {}

    @classmethod
    def from_envelope(cls, envelope: Any, fallback: str, message: str) -> FleetClientError:
        """The error an envelope (``{"code", "message", "retryable", ...}``) describes, or
        ``fallback`` with ``message`` when there is none."""
        if not isinstance(envelope, dict) or not isinstance(envelope.get("code"), str):
            return cls(fallback, message)
        after = envelope.get("retry_after_s")
        details = envelope.get("details")
        return cls(
            envelope["code"],
            str(envelope.get("message") or message),
            retryable=bool(envelope.get("retryable")),
            retry_after_s=float(after) if isinstance(after, int | float) else None,
            details=details if isinstance(details, dict) else None,
        )

    @classmethod
    def from_response(cls, response: httpx.Response) -> FleetClientError:
        """The error of an HTTP answer: the fleet's problem details (their ``code`` and the rest of
        the envelope), or the status alone."""
        status = response.status_code
        fallback = _CODE_OF_STATUS.get(
            status, "dependency_unavailable" if status >= 500 else "invalid_request"
        )
        try:
            body = response.json()
        except ValueError:
            body = None
        envelope = body.get("error") if isinstance(body, dict) else None
        return cls.from_envelope(envelope, fallback, f"HTTP {status} from {response.request.url}")


_CODE_OF_STATUS = {401: "unauthenticated", 403: "forbidden", 404: "not_found", 429: "rate_limited"}
