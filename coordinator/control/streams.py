"""Caps on the event streams open at once in this process: per principal, per tenant and in all.

A stream (the run API's SSE, A2A ``SubscribeToTask``, a streaming or follow-up ``SendMessage``)
takes a :class:`StreamSlot` before it starts and gives it back when it ends, however it ends
(finished, the client gone, cancelled). The caps come from policy (``fleet.limits.streams``, data
``config.limits.streams``); a stream over a cap is refused with ``stream_limit`` (HTTP 429 with
``Retry-After``, or a JSON-RPC error whose data has the code) and the refusal is logged with the
principal. Also here: the keep-alive that an idle SSE stream sends so proxies keep it open.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from a2a.utils.errors import InternalError
from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from coordinator.record.notifier import RunNotifier
from fleet.a2a_support import a2a_error
from fleet.errors import ErrorCode, FleetError
from fleet.service import problem_response
from fleet.tokens import Claims
from policy import PolicyEngine
from policy.errors import PolicyError

STREAMS_DECISION = "fleet.limits.streams.decision"
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
KEEPALIVE_S = 15.0

log = logging.getLogger(__name__)


class StreamLimitReached(FleetError):
    """A new stream would pass one of the caps; the same request may succeed once a stream ends."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(ErrorCode.STREAM_LIMIT, message, retryable=True, retry_after_s=retry_after_s)
        self.retry_after_s: int = retry_after_s

    def response(self) -> JSONResponse:
        """The run API's answer: 429 with ``Retry-After``."""
        return problem_response(self, headers={"Retry-After": str(self.retry_after_s)})

    def a2a_error(self) -> InternalError:
        """The A2A answer: a JSON-RPC error whose data is the error's envelope."""
        error = a2a_error(self, InternalError)
        assert isinstance(error, InternalError)
        return error


class StreamSlot:
    """One open stream's place; :meth:`release` (or leaving the ``with`` block) gives it back once."""

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def __enter__(self) -> StreamSlot:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class StreamSlots:
    """Counts this process's open streams and refuses one over a cap that policy sets."""

    def __init__(self, engine: PolicyEngine) -> None:
        self._engine = engine
        self._by_principal: Counter[tuple[str, str]] = Counter()
        self._by_tenant: Counter[str] = Counter()
        self._open = 0

    @property
    def open(self) -> int:
        return self._open

    def open_for(self, tenant: str, principal: str | None = None) -> int:
        """Open streams of ``tenant`` (of one of its principals if given)."""
        return self._by_tenant[tenant] if principal is None else self._by_principal[(tenant, principal)]

    async def take(self, claims: Claims, what: str) -> StreamSlot:
        """A slot for a stream of ``claims``' principal; :class:`StreamLimitReached` if none is free."""
        caps = await self._caps(claims.tenant, claims.sub)
        principal = (claims.tenant, claims.sub)
        over = self._over(caps, principal)
        if over is not None:
            log.warning(
                "stream refused (%s): principal %s of tenant %s has %d open, tenant %d, process %d: %s",
                what,
                claims.sub,
                claims.tenant,
                self._by_principal[principal],
                self._by_tenant[claims.tenant],
                self._open,
                over,
            )
            raise StreamLimitReached(over, int(caps["retry_after_s"]))
        self._by_principal[principal] += 1
        self._by_tenant[claims.tenant] += 1
        self._open += 1
        return StreamSlot(lambda: self._give_back(principal))

    def _over(self, caps: dict[str, Any], principal: tuple[str, str]) -> str | None:
        if self._by_principal[principal] >= caps["per_principal"]:
            return f"at most {caps['per_principal']} streams may be open at once per principal"
        if self._by_tenant[principal[0]] >= caps["per_tenant"]:
            return f"at most {caps['per_tenant']} streams may be open at once per tenant"
        if self._open >= caps["per_process"]:
            return "this coordinator has as many streams open as it serves; try again or another replica"
        return None

    def _give_back(self, principal: tuple[str, str]) -> None:
        self._by_principal[principal] -= 1
        self._by_tenant[principal[0]] -= 1
        self._open -= 1
        if not self._by_principal[principal]:
            del self._by_principal[principal]
        if not self._by_tenant[principal[0]]:
            del self._by_tenant[principal[0]]

    async def _caps(self, tenant: str, principal: str) -> dict[str, Any]:
        decision = await self._engine.decide(
            STREAMS_DECISION, {"tenant": tenant, "principal": principal}, log_decision=False
        )
        if not decision.allow or not isinstance(decision.result, dict):
            raise PolicyError(f"the stream limits are invalid: {'; '.join(decision.reasons)}")
        return decision.result


async def a2a_slot(slots: StreamSlots, claims: Claims, what: str) -> StreamSlot:
    """A slot for an A2A stream; a refusal is the A2A error of :class:`StreamLimitReached`."""
    try:
        return await slots.take(claims, what)
    except StreamLimitReached as exc:
        raise exc.a2a_error() from exc


def a2a_keepalives(every_s: float) -> None:
    """Set the keep-alive of this process's A2A streams. The SDK sends them through sse-starlette's
    ``EventSourceResponse``, whose ping (an SSE comment) it does not let a server set; the class
    default is the only knob, so it is process-wide."""
    EventSourceResponse.DEFAULT_PING_INTERVAL = every_s  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Streams:
    """What serving event streams takes: the process's one notifier, its slots, the keep-alive."""

    notifier: RunNotifier
    slots: StreamSlots
    keepalive_s: float = KEEPALIVE_S


async def with_keepalives(source: AsyncGenerator[str], every_s: float) -> AsyncGenerator[str]:
    """``source``'s items, and :data:`KEEPALIVE` whenever it has been quiet for ``every_s``."""
    pending: asyncio.Future[str] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield KEEPALIVE
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # the consumer left while the source was busy: stop it first
            pending.cancel()
            await asyncio.wait({pending})
            if not pending.cancelled():
                pending.exception()  # retrieved: it ends with the stream
        await source.aclose()


class HeldStream(StreamingResponse):
    """A streaming response that gives its slot back when it ends, however it ends (done, the
    client gone, the server stopping), and closes its source then rather than at garbage
    collection."""

    def __init__(self, content: AsyncGenerator[str], slot: StreamSlot, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._source = content
        self._slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._slot.release()
            await self._source.aclose()


__all__ = [
    "KEEPALIVE",
    "STREAMS_DECISION",
    "HeldStream",
    "StreamLimitReached",
    "StreamSlot",
    "StreamSlots",
    "Streams",
    "a2a_keepalives",
    "a2a_slot",
    "with_keepalives",
]
