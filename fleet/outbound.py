"""Requests to URLs that callers, partners or cards name: one guarded HTTP client.

Agent cards (the registry), push webhooks (the coordinator) and a partner's token endpoint (the
workers) are fetched with a client made by :func:`guarded_client`. Every request it sends:

* is allowed by policy first: ``fleet.limits.fetch.decision`` with the purpose, scheme, host and
  port (and the purpose's facts, e.g. the agent whose card it is); refused: ``fetch_refused``;
* resolves the host once; every address must be public (not private, loopback, link-local,
  multicast or reserved) unless the stack is local (``FLEET_LOCAL_STACK``), the decision says
  ``private_ok``, or the host (or ``host:port``) is on the client's own allow-list; then connects
  to that checked address, with the name in the ``Host`` header and the TLS SNI (certificates are
  verified for the name), so a DNS answer that changes after the check reaches nothing;
* follows no redirect, asks for an uncompressed body, reads at most the decision's ``max_bytes``
  (``fetch_too_large``) and ends within its ``deadline_s``, connect to last byte (``fetch_timeout``).

Errors are generic: an upstream's status or body never appears in a refusal. A host that cannot
be resolved or connected to raises ``httpx.ConnectError``, as an unreachable one always did.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from fleet.errors import ErrorCode, FleetError

log = logging.getLogger(__name__)

DECISION_PATH = "fleet.limits.fetch.decision"
FACTS = "fleet_fetch_facts"  # request extension: facts of the purpose for the policy input

Resolver = Callable[[str, int], Awaitable[list[str]]]


class _Decision(Protocol):
    @property
    def allow(self) -> bool: ...

    @property
    def reasons(self) -> tuple[str, ...]: ...

    @property
    def result(self) -> Any: ...


class DecisionSource(Protocol):
    """A policy engine (``policy.engine.PolicyEngine`` has this shape)."""

    async def decide(
        self, path: str, input_document: dict[str, Any], *, log_decision: bool = True
    ) -> _Decision: ...


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Rules:
    """What policy allows one request."""

    private_ok: bool
    max_bytes: int
    deadline_s: float


def facts(**values: Any) -> dict[str, Any]:
    """Request ``extensions`` carrying facts for the policy input (e.g. ``agent={...}``)."""
    return {FACTS: values}


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to now (an IP literal: itself)."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def is_public(address: str) -> bool:
    """Whether ``address`` is a global unicast address (IPv4-mapped IPv6: its IPv4 address)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def refused(message: str) -> FleetError:
    return FleetError(ErrorCode.FETCH_REFUSED, message)


class GuardedTransport(httpx.AsyncBaseTransport):
    """The transport of :func:`guarded_client` (see the module's doc)."""

    def __init__(
        self,
        purpose: str,
        policy: DecisionSource,
        *,
        local: bool,
        private_hosts: Iterable[str] = (),
        resolver: Resolver = system_resolver,
    ) -> None:
        self._purpose = purpose
        self._policy = policy
        self._local = local
        self._private_hosts = {h.strip().lower() for h in private_hosts if h.strip()}
        self._resolve = resolver
        # No connection is kept: one made to an address for one name is never reused for another.
        self._inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        given: Mapping[str, Any] = request.extensions.get(FACTS, {})
        try:
            return await self._guarded(request, given)
        except FleetError as exc:  # a refusal of this client's (or no policy): logged with whose fetch
            log.warning(
                "%s fetch from %s %s: %s (%s)", self._purpose, request.url.host, exc.code, exc.message, given
            )
            raise

    async def _guarded(self, request: httpx.Request, given: Mapping[str, Any]) -> httpx.Response:
        target = _target(request.url)
        rules = await self._rules(target, given)
        deadline = asyncio.timeout(rules.deadline_s)
        try:
            async with deadline:
                address = await self._address(request, target, rules)
                return await self._exchange(request, target, address, rules.max_bytes)
        except TimeoutError:
            if not deadline.expired():
                raise
        raise FleetError(
            ErrorCode.FETCH_TIMEOUT,
            f"{target.host} gave no complete answer within {rules.deadline_s:g}s",
            retryable=True,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def _rules(self, target: Target, given: Mapping[str, Any]) -> Rules:
        document = {"purpose": self._purpose, "scheme": target.scheme, "host": target.host,
                    "port": target.port, "local": self._local, **given}  # fmt: skip
        decision = await self._policy.decide(DECISION_PATH, document)
        if not decision.allow:
            reasons = "; ".join(decision.reasons) or "not allowed"
            raise refused(f"{self._purpose} fetch from {target.host} refused: {reasons}")
        result = decision.result
        try:
            return Rules(
                private_ok=result.get("private_ok") is True,
                max_bytes=int(result["max_bytes"]),
                deadline_s=float(result["deadline_s"]),
            )
        except (KeyError, TypeError, ValueError):
            raise FleetError(
                ErrorCode.POLICY_UNAVAILABLE,
                f"{DECISION_PATH} gave no max_bytes and deadline_s",
                retryable=True,
            ) from None

    async def _address(self, request: httpx.Request, target: Target, rules: Rules) -> str:
        """The address to connect to: resolved once, every answer checked."""
        try:
            addresses = await self._resolve(target.host, target.port)
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {target.host}", request=request) from exc
        if not addresses:
            raise httpx.ConnectError(f"cannot resolve {target.host}", request=request)
        listed = target.host in self._private_hosts or f"{target.host}:{target.port}" in self._private_hosts
        if not (self._local or rules.private_ok or listed) and not all(map(is_public, addresses)):
            log.info("%s fetch from %s: it resolves to %s", self._purpose, target.host, addresses)
            raise refused(
                f"{self._purpose} fetch from {target.host} refused: not a public address"
                " (private, loopback, link-local and other internal addresses are not fetched)"
            )
        return addresses[0]

    async def _exchange(
        self, request: httpx.Request, target: Target, address: str, max_bytes: int
    ) -> httpx.Response:
        headers = request.headers.copy()
        headers["Accept-Encoding"] = "identity"
        pinned = httpx.Request(
            request.method,
            request.url.copy_with(host=address),
            headers=headers,  # Host: still the name
            stream=request.stream,
            extensions={**request.extensions, "sni_hostname": target.host},
        )
        response = await self._inner.handle_async_request(pinned)
        try:
            body = await _capped(response, target, max_bytes)
        finally:
            await response.aclose()
        return httpx.Response(
            response.status_code, headers=response.headers, content=body, extensions=response.extensions
        )


async def _capped(response: httpx.Response, target: Target, max_bytes: int) -> bytes:
    if response.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
        raise refused(f"{target.host} sent a compressed body, which was not asked for")
    body = bytearray()
    assert isinstance(response.stream, httpx.AsyncByteStream)
    async for chunk in response.stream:
        body += chunk
        if len(body) > max_bytes:
            raise FleetError(
                ErrorCode.FETCH_TOO_LARGE, f"the answer of {target.host} exceeds {max_bytes} bytes"
            )
    return bytes(body)


def _target(url: httpx.URL) -> Target:
    if url.scheme not in ("http", "https") or not url.host:
        raise refused("only http and https URLs with a host are fetched")
    if url.userinfo:
        raise refused("a URL with credentials in it is not fetched")
    return Target(
        url.scheme, url.host.lower().rstrip("."), url.port or (443 if url.scheme == "https" else 80)
    )


def guarded_client(
    purpose: str,
    policy: DecisionSource,
    *,
    local: bool,
    private_hosts: Iterable[str] = (),
    resolver: Resolver = system_resolver,
    event_hooks: Mapping[str, list[Callable[..., Any]]] | None = None,
) -> httpx.AsyncClient:
    """An HTTP client for URLs from outside (see the module's doc). ``purpose`` names the use in
    the policy input (``card``, ``webhook``, ``token_endpoint``); ``local``: the stack runs on one
    machine (internal addresses are its own); ``private_hosts``: hosts (or ``host:port``) the
    operator allows on internal addresses; ``resolver``: DNS (tests answer for it)."""
    transport = GuardedTransport(purpose, policy, local=local, private_hosts=private_hosts, resolver=resolver)
    return httpx.AsyncClient(
        transport=transport,
        follow_redirects=False,
        trust_env=False,  # no proxy from the environment: the connection goes to the checked address
        event_hooks=dict(event_hooks or {}),
    )
