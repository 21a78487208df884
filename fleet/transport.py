"""Where a credential may travel: over HTTPS anywhere, over plain HTTP only to this machine.

Every HTTP client of the fleet's processes that sends a credential (a bearer token, an API key, a
cookie) is built with :func:`hooks` (``httpx``) or :func:`hooks2` (``httpx2``, the MCP SDK's client):
a request that carries an ``Authorization`` or ``Cookie`` header to an ``http://`` URL whose host is
not a loopback address is refused before a byte is sent, with ``insecure_transport``. URLs come from
settings, from the registry's records and from callers (push webhooks), so the check is made on the
request itself, after redirects and authentication added their headers, not on configuration.

A deployment whose network encrypts every hop itself (a service mesh with mutual TLS) may turn the
check off with ``FLEET_ALLOW_PLAIN_HTTP=true`` (``ServiceSettings.allow_plain_http``); the fleet's
manifests do not, they serve HTTPS.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

from fleet.errors import ErrorCode, FleetError

ALLOW_ENV = "FLEET_ALLOW_PLAIN_HTTP"
CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization")


def _allowed_by_env() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def plain_and_remote(url: str) -> bool:
    """Whether ``url`` is ``http://`` to a host other than this machine."""
    parts = urlsplit(url)
    return parts.scheme.lower() == "http" and not is_loopback(parts.hostname or "")


def check_url(url: str, what: str, *, allow_plain: bool | None = None) -> None:
    """Refuse ``url`` as a place to send ``what`` (a credential) unless it is HTTPS or loopback."""
    allowed = _allowed_by_env() if allow_plain is None else allow_plain
    if not allowed and plain_and_remote(url):
        raise FleetError(
            ErrorCode.INSECURE_TRANSPORT,
            f"refusing to send {what} over plain HTTP to {urlsplit(url).hostname}: use https://"
            f" (plain HTTP carries credentials only on loopback; {ALLOW_ENV}=true if the network"
            " encrypts every hop itself)",
        )


class _Request(Protocol):
    @property
    def url(self) -> Any: ...

    @property
    def headers(self) -> Mapping[str, str]: ...


def _guard(request: _Request) -> None:
    if any(name in request.headers for name in CREDENTIAL_HEADERS):
        check_url(str(request.url), "a credential")


async def _async_guard(request: Any) -> None:
    _guard(request)


def hooks() -> dict[str, list[Callable[[Any], Awaitable[None]]]]:
    """``event_hooks`` for an ``httpx.AsyncClient`` that may carry credentials."""
    return {"request": [_async_guard]}


def sync_hooks() -> dict[str, list[Callable[[Any], None]]]:
    """``event_hooks`` for an ``httpx.Client`` (synchronous) that may carry credentials."""
    return {"request": [_guard]}


hooks2 = hooks  # httpx2's hooks have the same shape
