"""What other services use to talk to the registry: enroll their key, get tokens, register
themselves, discover agents and MCP servers."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from nats.aio.client import Client as NATS

from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.issuer_certs import IssuerTrust
from fleet.keys import SigningKey
from fleet.natsconn import Credentials, connect
from fleet.retry import retrying
from fleet.revocations import Revocations
from fleet.settings import ServiceSettings
from fleet.tenant_keys import TenantKey
from fleet.tokens import (
    FAILOVER_PATIENCE_S,
    FAILOVER_RETRY_S,
    BearerVerifier,
    ExternalTokenVerifier,
    FederatedVerifier,
    JwksCache,
    TokenClient,
    TokenVerifier,
)
from registry._records import AgentRecord, McpServerRecord

log = logging.getLogger(__name__)

T = TypeVar("T")


def _raise_for(response: httpx.Response, what: str) -> None:
    """The registry's error answer as the error it describes (its problem details' envelope). The
    registry failing over (its own ``dependency_unavailable`` on a 502-504, or an answer that is not
    the registry's from a proxy in front of it that cannot reach it) is :class:`DependencyUnavailable`,
    which a caller waits out; anything else keeps its code and is not waited for."""
    if response.status_code < 400:
        return
    error = FleetError.from_response(response).within(what)
    if response.status_code in (502, 503, 504) and error.code == ErrorCode.DEPENDENCY_UNAVAILABLE:
        raise DependencyUnavailable(error.message)
    raise error


class RegistryClient:
    """A service's identity towards the registry, and its discovery client."""

    def __init__(self, settings: ServiceSettings, http: httpx.AsyncClient) -> None:
        self._settings = settings
        self._http = http
        self._url = settings.registry_url.rstrip("/")
        self.key = SigningKey.load_or_create(settings.key_file)
        self._outside_tokens: dict[str, TokenClient] = {}  # by token URL (see tokens_at)
        self.tokens = TokenClient(
            token_url=self.token_url,
            client_id=settings.service_id,
            key=self.key,
            http=http,
        )
        # The registry's keys are trusted only with the operator's certificate (fleet.issuer_certs).
        self.trust = IssuerTrust.from_file(settings.operator_jwk_file, settings.issuer)
        self.jwks = JwksCache(self._url + "/.well-known/jwks.json", http, parse=self.trust.parse)
        # Revoked keys, followed live from NATS once the service joins (see fleet.revocations):
        # until then this service's verifiers refuse every token.
        self.revocations = Revocations(self.trust)
        self.revocations.on_revoke(lambda revoked: self.jwks.forget(revoked.kid))
        self._nats: NATS | None = None
        self._enrolled = False
        self._enrolling = asyncio.Lock()

    def tokens_at(self, token_url: str, http: httpx.AsyncClient) -> TokenClient:
        """Tokens from another token endpoint (an outside agent's, named by its card), for which this
        identity authenticates with its own key (``private_key_jwt``; one client per endpoint,
        which follows this identity's key rotations). ``http``: a guarded client
        (:func:`fleet.outbound.guarded_client`, purpose ``token_endpoint``): the URL is a card's."""
        client = self._outside_tokens.get(token_url)
        if client is None:
            client = TokenClient(
                token_url=token_url,
                client_id=self._settings.service_id,
                key=self.key,
                http=http,
                control_plane=False,
            )
            self._outside_tokens[token_url] = client
        return client

    @property
    def url(self) -> str:
        return self._url

    @property
    def token_url(self) -> str:
        return self._url + "/oauth/token"

    def verifier(self, audience: str | None = None, *, grant: str | None = None) -> TokenVerifier:
        """A verifier for tokens addressed to this service (or to ``audience``); ``grant``: for
        that kind of grant only (e.g. ``signal_grant``), no access token."""
        return TokenVerifier(
            self.jwks.get,
            issuer=self._settings.issuer,
            audience=audience or self._settings.service_id,
            revocations=self.revocations,
            grant=grant,
        )

    def federated_verifier(self) -> BearerVerifier:
        """:meth:`verifier`, that also takes the tokens of the configured outside issuers
        (``external_issuers``), each mapped to its tenant."""
        external = [
            ExternalTokenVerifier(issuer, self._http, revocations=self.revocations)
            for issuer in self._settings.external_issuers
        ]
        return FederatedVerifier(self.verifier(), external) if external else self.verifier()

    async def follow_revocations(self) -> None:
        """Read the revoked keys and follow new revocations (every service does, when it joins)."""
        if self._nats is None:
            self._nats = await connect(
                self._settings.nats_url,
                f"{self._settings.service_id}-revocations",
                replicas=self._settings.nats_replicas,
                credentials=Credentials(
                    self._settings.service_id, key=self.key, tls_ca=self._settings.tls_ca_file
                ),
            )
        if not self.revocations.synced:
            await self.revocations.follow(self._nats)

    async def aclose(self) -> None:
        await self.revocations.stop()
        if self._nats is not None:
            await self._nats.drain()
            self._nats = None

    async def enroll(self) -> None:
        """Enroll this identity's key with the one-time enrollment token of the settings. Without
        one the key must be enrolled already (a deployment enrolls every identity once, with
        ``python -m deploy.keygen enroll``): :meth:`check_enrolled` makes a start fail at once
        if it is not."""
        if not self._settings.enrollment_token:
            await self.check_enrolled()
            return
        response = await self._http.post(
            self._url + "/v1/enroll",
            json={
                "id": self._settings.service_id,
                "public_jwk": self.key.public_jwk(),
                "enrollment_token": self._settings.enrollment_token,
            },
        )
        _raise_for(response, "enrollment refused")

    async def check_enrolled(self) -> None:
        """Prove that the registry knows this identity with the key it holds: get a token with it.
        An unknown (or retired, or revoked) key is :attr:`ErrorCode.UNAUTHENTICATED`, which a
        start-up does not retry."""
        try:
            await self.tokens.token("registry", "default", ["registry:read"])
        except FleetError as exc:
            if exc.code != ErrorCode.FORBIDDEN or exc.details.get("oauth_error") != "invalid_client":
                raise
            service_id = self._settings.service_id
            raise FleetError(
                ErrorCode.UNAUTHENTICATED,
                f"identity {service_id} is not enrolled with this key (kid {self.key.kid}; {exc.message}):"
                f" enroll it (python -m deploy.keygen enroll --registry {self._url} ...), or start it"
                " with FLEET_ENROLLMENT_TOKEN",
            ) from exc

    async def rotate_key(self, new: SigningKey) -> None:
        """Make ``new`` this identity's key: the registry checks a proof signed by the current key;
        the current key keeps verifying for a grace period. Then this client signs with ``new``
        (the caller keeps the new key, e.g. writes it over the key file)."""
        now = int(time.time())
        url = f"{self._url}/v1/identities/{self._settings.service_id}/keys"
        proof = self.key.sign(
            {
                "iss": self._settings.service_id,
                "sub": self._settings.service_id,
                "aud": url,
                "iat": now,
                "exp": now + 60,
                "jti": uuid.uuid4().hex,
                "new_kid": new.kid,
            }
        )
        response = await self._http.post(url, json={"public_jwk": new.public_jwk(), "proof": proof})
        _raise_for(response, "key rotation refused")
        self.key = new
        for client in (self.tokens, *self._outside_tokens.values()):
            client.use_key(new)

    async def _headers(self, scope: str) -> dict[str, str]:
        token = await self.tokens.token("registry", "default", [scope])
        return {"Authorization": f"Bearer {token}"}

    async def register_agent(self, base_url: str) -> AgentRecord:
        response = await self._http.put(
            f"{self._url}/v1/agents/{self._settings.service_id}",
            json={"url": base_url},
            headers=await self._headers("registry:write"),
        )
        _raise_for(response, "registration refused")
        return AgentRecord.model_validate(response.json())

    async def register_mcp_server(self, url: str, tools: list[dict[str, Any]]) -> McpServerRecord:
        """Register this MCP server's endpoint and its tools (name, description, scopes each)."""
        response = await self._http.put(
            f"{self._url}/v1/mcp-servers/{self._settings.service_id}",
            json={"url": url, "tools": tools},
            headers=await self._headers("registry:write"),
        )
        _raise_for(response, "registration refused")
        return McpServerRecord.model_validate(response.json())

    @property
    def own_keys_url(self) -> str:
        """Where the registry publishes this identity's public keys (the ``jku`` of its card)."""
        return f"{self._url}/v1/agents/{self._settings.service_id}/jwks.json"

    async def ready_for_bus(self) -> None:
        """Enroll this identity's key, or check that it is enrolled (once per process): the bus
        lets in enrolled identities only, so a service does this before it connects to NATS."""
        async with self._enrolling:
            if not self._enrolled:
                await _retry("enroll", self.enroll)
                self._enrolled = True

    async def join_as_agent(self, base_url: str) -> AgentRecord:
        """Enroll this identity's key (or check it is enrolled), then register the agent card
        served at ``base_url``."""
        await self.ready_for_bus()
        await _retry("revocations", self.follow_revocations)
        return await _retry("register", lambda: self.register_agent(base_url))

    async def join_as_worker(self) -> None:
        """Enroll this identity's key (a worker registers nothing: it only calls others)."""
        await self.ready_for_bus()
        await _retry("revocations", self.follow_revocations)

    async def join_as_mcp_server(self, url: str, tools: list[dict[str, Any]]) -> McpServerRecord:
        """Enroll this identity's key, then register the MCP endpoint at ``url``."""
        await self.ready_for_bus()
        await _retry("revocations", self.follow_revocations)
        return await _retry("register", lambda: self.register_mcp_server(url, tools))

    async def _read(
        self, path: str, what: str, *, params: dict[str, str] | None = None, authorized: bool = True
    ) -> Any:
        """GET a registry resource. A registry that cannot be reached, or answers that what it
        stands on is failing over, is asked again for up to ``FAILOVER_PATIENCE_S``; then it is
        :class:`DependencyUnavailable` (the caller's work waits and is retried, it does not fail)."""
        return await retrying(
            what,
            lambda: self._read_once(path, what, params, authorized),
            retry_on=(DependencyUnavailable,),
            patience_s=FAILOVER_PATIENCE_S,
            base_s=FAILOVER_RETRY_S,
            cap_s=2.0,
        )

    async def _read_once(self, path: str, what: str, params: dict[str, str] | None, authorized: bool) -> Any:
        headers = await self._headers("registry:read") if authorized else {}
        try:
            response = await self._http.get(self._url + path, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise DependencyUnavailable(
                f"{what}: the registry did not answer ({type(exc).__name__})"
            ) from exc
        _raise_for(response, what)
        return response.json()

    async def tenant_key(self, caller_token: str, tenant: str) -> tuple[TenantKey, float]:
        """Tenant ``tenant``'s key (see :mod:`fleet.tenant_keys`), which the registry gives this
        service only against ``caller_token``: the access token a caller of that tenant sent it.
        With the seconds it may be kept. ``tenant_key_refused`` or ``policy_denied`` if not."""
        try:
            response = await self._http.post(
                self._url + "/v1/tenant-keys",
                json={"caller_token": caller_token, "tenant": tenant},
                headers=await self._headers("registry:read"),
            )
        except httpx.TransportError as exc:
            raise DependencyUnavailable(
                f"tenant key: the registry did not answer ({type(exc).__name__})"
            ) from exc
        _raise_for(response, "tenant key refused")
        body = response.json()
        key = TenantKey.from_json(body)
        if key.tenant != tenant:
            raise FleetError(ErrorCode.INTERNAL, f"the registry answered tenant {key.tenant!r}'s key")
        return key, float(body.get("expires_in", 0))

    async def agents_with_skill(self, skill: str) -> list[AgentRecord]:
        body = await self._read("/v1/agents", "discovery failed", params={"skill": skill})
        return [AgentRecord.model_validate(a) for a in body["agents"]]

    async def agents(self) -> list[AgentRecord]:
        """Every registered agent, whatever its status (see :attr:`AgentRecord.offered`)."""
        body = await self._read("/v1/agents", "agents")
        return [AgentRecord.model_validate(a) for a in body["agents"]]

    async def agent(self, agent_id: str) -> AgentRecord:
        return AgentRecord.model_validate(await self._read(f"/v1/agents/{agent_id}", f"agent {agent_id}"))

    async def mcp_server(self, server_id: str) -> McpServerRecord:
        body = await self._read(f"/v1/mcp-servers/{server_id}", f"MCP server {server_id}")
        return McpServerRecord.model_validate(body)

    async def mcp_servers(self) -> list[McpServerRecord]:
        """The MCP servers this identity may use, each with the tools it has the scopes for."""
        body = await self._read("/v1/mcp-servers", "MCP servers")
        return [McpServerRecord.model_validate(m) for m in body["mcp_servers"]]

    async def agent_keys(self, agent_id: str) -> list[dict[str, Any]]:
        body = await self._read(f"/v1/agents/{agent_id}/jwks.json", f"keys of {agent_id}", authorized=False)
        keys: list[dict[str, Any]] = body["keys"]
        return keys


START_PATIENCE_S = 60.0


async def _retry(
    what: str, action: Callable[[], Awaitable[T]], *, attempts: int = 50, delay_s: float = 0.1
) -> T:
    """Retry a start-up call (enroll, register) while the registry is still coming up, for at most
    ``attempts`` tries and ``START_PATIENCE_S`` in all (each try may itself wait out a failover):
    a registry that never answers is a misconfiguration, reported while someone still watches."""
    deadline = time.monotonic() + START_PATIENCE_S
    for attempt in range(attempts):
        try:
            return await action()
        except (httpx.HTTPError, FleetError) as exc:
            retryable = isinstance(exc, httpx.HTTPError) or exc.retryable
            if not retryable or attempt == attempts - 1 or time.monotonic() >= deadline:
                raise
            log.info("%s failed (%s); retrying", what, exc)
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable")
