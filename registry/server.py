"""The registry service: enrollment, the token service and JWKS, agent and MCP-server records,
discovery by skill. Every record lives in NATS KV; this process holds no state of its own beyond its
signing key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
import jwt
import nats.errors
import nats.js.errors
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fleet import transport
from fleet.buskeys import REGISTRY_KEYS, BusKeys
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.issuer_certs import CertifiedKey, IssuerTrust
from fleet.keys import SigningKey, public_key_from_jwk
from fleet.natsconn import TRANSIENT, Credentials, connect
from fleet.outbound import guarded_client
from fleet.revocations import Revocations, record_revocation
from fleet.service import always_ready, configure_logging, problem_response, serve_app
from fleet.settings import ServiceSettings
from fleet.tenant_keys import MasterSecret
from fleet.tokens import (
    ACCESS_TOKEN_TYPE,
    TOKEN_EXCHANGE,
    Claims,
    ExternalTokenVerifier,
    TokenVerifier,
    bearer_token,
)
from policy.live import LivePolicy, enforcing, live_policy
from registry import _producers as producers
from registry._callout import BusAuthority
from registry._cards import fetch_verified_card
from registry._enrollment import OPERATOR_ISSUER, Enrollment
from registry._keys import KeyAdmin
from registry._records import CardVersion, IdentityRecord, McpServerRecord, ProducerRecord
from registry._refresh import refresh, refresh_forever, registered
from registry._seal import RecordSeal
from registry._skills import SkillBinding
from registry._store import RegistryStore
from registry._tenant_keys import TenantKeyService
from registry._token_service import REGISTRY_AUDIENCE, OAuthError, TokenService

log = logging.getLogger(__name__)


ADMIN_SCOPE = "registry:admin"


@dataclass(slots=True)
class RegistryState:
    store: RegistryStore
    tokens: TokenService
    enrollment: Enrollment
    verifier: TokenVerifier
    keys: KeyAdmin
    revocations: Revocations
    # the registry's signing keys, by kid, with when each stops verifying (None: the current one)
    issuer_keys: dict[str, tuple[ec.EllipticCurvePublicKey, float | None]]
    http: httpx.AsyncClient  # agents' cards: a guarded client (fleet.outbound, purpose "card")
    trust: IssuerTrust  # the operator's key: which of the registry's keys are its own
    signer: CertifiedKey  # the current signing key and its certificate
    tenant_keys: TenantKeyService
    skills: SkillBinding  # which skills each identity's card may claim

    @property
    def key(self) -> SigningKey:
        return self.tokens.key

    def sign_with(self, signer: CertifiedKey) -> None:
        """Sign tokens, revocations and records with ``signer`` from now on."""
        self.signer = signer
        self.tokens.key = signer.key
        self.store.seal.signer = signer

    def trust_issuer_keys(self, identity: IdentityRecord) -> None:
        """Verify with the registry's usable keys that the operator certified (no other)."""
        self.issuer_keys = {
            kid: (key, identity.retiring.get(kid))
            for kid, jwk in identity.usable_keys(time.time()).items()
            if (key := self.trust.certified(jwk)) is not None
        }

    def issuer_key(self, kid: str) -> ec.EllipticCurvePublicKey | None:
        """A signing key of the registry that verifies now (a retired one until its grace ends)."""
        found = self.issuer_keys.get(kid)
        if found is None or (found[1] is not None and found[1] <= time.time()):
            return None
        return found[0]


def error_response(exc: FleetError) -> JSONResponse:
    headers = {}
    if exc.code == ErrorCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = 'Bearer error="invalid_token"'
    return problem_response(exc, headers)


Handler = Callable[[Request, RegistryState], Awaitable[Response]]
# NATS not answering for now (a node failing over), not a request NATS refuses (a bad key: a 4xx/500).
_BROKER_TROUBLE: tuple[type[Exception], ...] = (
    *TRANSIENT,
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
)


def _route(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Adapts a handler that takes the registry state and maps FleetErrors to responses."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, request.app.state.registry)
        except _BROKER_TROUBLE as exc:
            # Records live in NATS KV: a node failing over makes reads time out for a few seconds.
            log.warning(
                "%s %s: NATS did not answer (%s)", request.method, request.url.path, type(exc).__name__
            )
            return error_response(DependencyUnavailable("the registry's store (NATS) did not answer"))
        except FleetError as exc:
            if exc.http_status in (400, 401, 403, 409):
                log.warning("%s %s refused (%s): %s", request.method, request.url.path, exc.code, exc.message)
            return error_response(exc)

    return endpoint


async def _authorize(request: Request, state: RegistryState, scope: str) -> Claims:
    """The caller's claims. A change to the registry (registering, refreshing, revoking, rotating)
    takes a token in the caller's own name: a delegated one (with ``act``) is refused."""
    token = bearer_token(request.headers.get("authorization"))
    claims = await state.verifier.verify(token, required_scopes=[scope])
    if scope != "registry:read" and claims.actors:
        raise FleetError(ErrorCode.FORBIDDEN, "a delegated token cannot change the registry")
    return claims


async def _json_body(request: Request) -> dict[str, object]:
    try:
        body = await request.json()
    except (ValueError, RecursionError) as exc:  # not UTF-8 JSON, or nested deeper than Python parses
        raise FleetError(ErrorCode.INVALID_REQUEST, "body must be JSON") from exc
    if not isinstance(body, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "body must be a JSON object")
    return body


# ------------------------------------------------------------------------------------ handlers
async def jwks(request: Request, state: RegistryState) -> Response:
    """The registry's signing keys: the current one, and any retiring after a rotation (the tokens
    they signed still verify until the grace ends), each with the operator's certificate (member
    ``issuer_cert``: verifiers trust no key without one). Cached 60 s by verifiers; a new key id
    makes them fetch again at once."""
    identity = await state.store.identity(state.keys.issuer_id)
    keys = identity.usable_keys(time.time()) if identity else {state.key.kid: state.signer.public_jwk()}
    return JSONResponse({"keys": list(keys.values())}, headers={"Cache-Control": "max-age=60"})


async def token(request: Request, state: RegistryState) -> Response:
    form = {k: str(v) for k, v in (await request.form()).items()}
    try:
        issued = await state.tokens.grant(form)
    except OAuthError as exc:
        log.warning(
            "token request refused (%s, %s): %s; client=%r audience=%r tenant=%r",
            exc.error,
            exc.status,
            exc.description,
            _claimed_client(form.get("client_assertion", "")),
            form.get("audience"),
            form.get("tenant"),
        )
        retry = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
        return JSONResponse(
            {"error": exc.error, "error_description": exc.description}, status_code=exc.status, headers=retry
        )
    return JSONResponse(
        {
            "access_token": issued.access_token,
            # A grant (run or session) is not usable as a bearer token (RFC 8693 section 2.2.1: "N_A").
            "token_type": "Bearer" if issued.issued_token_type == ACCESS_TOKEN_TYPE else "N_A",
            "issued_token_type": issued.issued_token_type,
            "expires_in": issued.expires_in,
            "scope": issued.scope,
        },
        headers={"Cache-Control": "no-store"},
    )


def authorization_server_metadata(settings: ServiceSettings) -> dict[str, object]:
    """The registry's RFC 8414 metadata: what a standard OAuth client needs to get a token here. The
    registry issues tokens to machines only (client credentials with a private_key_jwt assertion,
    and token exchange, RFC 8693); its authorization endpoint exists because common clients (the
    MCP SDK's among them) require the member, and it refuses every request. ``issuer`` is the URL
    the metadata is found under; the tokens themselves name the fleet's issuer (``iss``,
    ``FLEET_ISSUER``), which the fleet's verifiers check."""
    base = settings.public_url.rstrip("/")
    return {
        "issuer": base,
        "authorization_endpoint": f"{base}/oauth/authorize",
        "token_endpoint": f"{base}/oauth/token",
        "jwks_uri": f"{base}/.well-known/jwks.json",
        "response_types_supported": [],
        "grant_types_supported": ["client_credentials", TOKEN_EXCHANGE],
        "token_endpoint_auth_methods_supported": ["private_key_jwt"],
        "token_endpoint_auth_signing_alg_values_supported": ["ES256"],
    }


def _metadata_route(metadata: dict[str, object]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return JSONResponse(metadata, headers={"Cache-Control": "max-age=3600"})

    return endpoint


async def authorize(request: Request) -> Response:
    """No authorization code or implicit grant here: every request is refused (RFC 6749 4.1.2.1,
    answered directly: no redirect URI is trusted, since no client registered one)."""
    return JSONResponse(
        {
            "error": "unsupported_response_type",
            "error_description": "this server issues tokens to machines only: client credentials with"
            " a private_key_jwt assertion, or token exchange, at the token endpoint",
        },
        status_code=400,
        headers={"Cache-Control": "no-store"},
    )


def _claimed_client(assertion: str) -> object:
    """Who a client assertion says it is (unverified: for the log of a refusal only)."""
    try:
        return jwt.decode(assertion, options={"verify_signature": False}).get("sub")
    except jwt.PyJWTError:
        return None


async def enroll(request: Request, state: RegistryState) -> Response:
    record = await state.enrollment.enroll(await _json_body(request))
    log.info("enrolled %s (%s)", record.id, record.kind)
    return JSONResponse({"id": record.id, "kids": list(record.keys)}, status_code=201)


async def register_agent(request: Request, state: RegistryState) -> Response:
    claims = await _authorize(request, state, "registry:write")
    agent_id = request.path_params["agent_id"]
    if claims.sub != agent_id:
        raise FleetError(ErrorCode.FORBIDDEN, "an agent may register only itself")
    body = await _json_body(request)
    identity = await _identity(state, agent_id)
    fetched = await fetch_verified_card(state.http, identity, str(body.get("url", "")))
    try:
        decision = await state.skills.check(identity, fetched)
    except FleetError as exc:
        if exc.code == ErrorCode.SKILL_NOT_ALLOWED:
            refused = CardVersion(
                at=time.time(), change="refused", version=fetched.version, detail=exc.message[:500]
            )
            await state.store.note_card(agent_id, refused)
        raise
    record = await registered(state.store, fetched)
    log.info(
        "registered agent %s with skills %s (decision %s)",
        agent_id,
        [s.id for s in record.skills],
        decision.decision_id,
    )
    return JSONResponse(record.model_dump(mode="json"))


async def register_mcp_server(request: Request, state: RegistryState) -> Response:
    claims = await _authorize(request, state, "registry:write")
    server_id = request.path_params["server_id"]
    if claims.sub != server_id:
        raise FleetError(ErrorCode.FORBIDDEN, "a server may register only itself")
    body = await _json_body(request)
    identity = await _identity(state, server_id)
    if identity.kind != "mcp_server":
        raise FleetError(ErrorCode.FORBIDDEN, f"{server_id} is not enrolled as an MCP server")
    try:
        record = McpServerRecord.model_validate(
            {
                "id": server_id,
                "url": str(body.get("url", "")),
                "audience": server_id,
                "tools": body.get("tools", []),
                "registered_at": time.time(),
            }
        )
    except ValidationError as exc:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"invalid tools: {exc.errors()[0]['msg']}") from exc
    await state.store.put_mcp_server(record)
    log.info(
        "registered MCP server %s at %s with tools %s", server_id, record.url, [t.name for t in record.tools]
    )
    return JSONResponse(record.model_dump(mode="json"))


async def list_mcp_servers(request: Request, state: RegistryState) -> Response:
    """The MCP servers the caller may use, each with only the tools its enrollment has the scopes
    for: what an agent loads to see its tools (a server registered since shows on its next load).
    Through the console, the caller is the signed-in person (the operator sees every tool)."""
    claims = await _authorize(request, state, "registry:read")
    caller = await state.store.identity(str(claims.raw.get("client_id", claims.sub)))
    if caller is not None and caller.kind == "console":  # it asks in the signed-in person's name
        caller = await state.store.identity(claims.sub) or caller
    if caller is None:
        raise FleetError(ErrorCode.FORBIDDEN, "the caller is not enrolled")
    usable = [m.usable_by(caller.allows_scope) for m in await state.store.mcp_servers()]
    return JSONResponse({"mcp_servers": [m.model_dump(mode="json") for m in usable if m.tools]})


async def _identity(state: RegistryState, identity_id: str) -> IdentityRecord:
    identity = await state.store.identity(identity_id)
    if identity is None:
        raise FleetError(ErrorCode.NOT_FOUND, f"{identity_id} is not enrolled")
    return identity


async def list_agents(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, "registry:read")
    skill = request.query_params.get("skill")
    agents = await state.store.agents()
    if skill:  # discovery: only agents whose card verified when last checked, and that answer,
        # and whose identity may offer the skill now (policy, or the identity, may have changed)
        agents = [
            a
            for a in agents
            if a.offered
            and any(s.id == skill for s in a.skills)
            and await state.skills.offers(await state.store.identity(a.id), skill)
        ]
    return JSONResponse({"agents": [a.model_dump(mode="json") for a in agents]})


async def get_agent(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, "registry:read")
    record = await state.store.agent(request.path_params["agent_id"])
    if record is None:
        raise FleetError(ErrorCode.NOT_FOUND, "no such agent")
    return JSONResponse(record.model_dump(mode="json"))


async def agent_history(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, "registry:read")
    history = await state.store.agent_history(request.path_params["agent_id"])
    return JSONResponse(history.model_dump(mode="json"))


async def refresh_agent(request: Request, state: RegistryState) -> Response:
    """Check an agent's card now (the operator, or the agent itself), as the periodic check does."""
    claims = await _authorize(request, state, "registry:write")
    agent_id = request.path_params["agent_id"]
    if claims.sub != agent_id and ADMIN_SCOPE not in claims.scopes:
        raise FleetError(ErrorCode.FORBIDDEN, "only the agent itself or an operator may ask for a check")
    record = await refresh(state.store, state.http, state.skills, agent_id)
    if record is None:
        raise FleetError(ErrorCode.NOT_FOUND, "no such agent")
    return JSONResponse(record.model_dump(mode="json"))


async def agent_keys(request: Request, state: RegistryState) -> Response:
    """The public keys an agent signs its card with (public, like any JWKS): those usable now."""
    identity = await state.store.identity(request.path_params["agent_id"])
    if identity is None:
        raise FleetError(ErrorCode.NOT_FOUND, "no such identity")
    return JSONResponse({"keys": list(identity.usable_keys(time.time()).values())})


async def rotate_identity_key(request: Request, state: RegistryState) -> Response:
    """An identity replaces its key, proving that it holds a current one (no bearer token: the
    proof is the credential)."""
    record = await state.keys.rotate_identity_key(
        request.path_params["identity_id"], await _json_body(request)
    )
    log.info("identity %s rotated its key; retiring %s", record.id, sorted(record.retiring))
    return JSONResponse({"id": record.id, "kids": list(record.keys), "retiring": record.retiring})


async def revoke_key(request: Request, state: RegistryState) -> Response:
    claims = await _authorize(request, state, ADMIN_SCOPE)
    body = await _json_body(request)
    revocation = await state.keys.revoke(
        request.path_params["kid"], claims.sub, str(body.get("reason", "")), state.signer, state.trust.issuer
    )
    state.revocations.note(revocation)  # refused here from this answer on; elsewhere as it arrives
    if revocation.identity == state.keys.issuer_id:
        identity = await state.store.identity(state.keys.issuer_id)
        if identity is not None:
            state.trust_issuer_keys(identity)
    return JSONResponse(revocation.to_json())


async def rotate_issuer_key(request: Request, state: RegistryState) -> Response:
    """The first step of a rotation: a new signing key, pending until the operator certifies it
    (the second step, :func:`certify_issuer_key`). The registry keeps signing with its key."""
    claims = await _authorize(request, state, ADMIN_SCOPE)
    pending = state.keys.begin_issuer_rotation()
    log.warning("%s began a rotation of the registry's signing key: %s pending", claims.sub, pending.kid)
    body = {
        "status": "pending",
        "issuer": state.trust.issuer,
        "kid": pending.kid,
        "public_jwk": pending.public_jwk(),
    }
    return JSONResponse(body)


async def certify_issuer_key(request: Request, state: RegistryState) -> Response:
    """The second step: given the operator's certificate for the pending key, the registry signs
    with it from now on; the old one verifies what it signed until the grace ends (revoke it to
    end that sooner)."""
    claims = await _authorize(request, state, ADMIN_SCOPE)
    old = state.key.kid
    state.sign_with(
        await state.keys.complete_issuer_rotation(str((await _json_body(request)).get("certificate", "")))
    )
    identity = await state.store.identity(state.keys.issuer_id)
    if identity is not None:
        state.trust_issuer_keys(identity)
    log.warning("%s rotated the registry's signing key: %s -> %s", claims.sub, old, state.key.kid)
    return JSONResponse({"kid": state.key.kid, "retiring": [old]})


async def issue_producer(request: Request, state: RegistryState) -> Response:
    """Credentials for an event producer outside the fleet (the operator: ``fleet producers
    issue``): its nkey may publish its tenant's events as its sources until it expires."""
    claims = await _authorize(request, state, ADMIN_SCOPE)
    record = await producers.issue(state.store, await _json_body(request), claims.sub)
    log.warning(
        "%s issued producer %s credentials for tenant %s, sources %s",
        claims.sub,
        record.id,
        record.tenant,
        record.sources,
    )
    return JSONResponse(record.model_dump(mode="json"), status_code=201)


async def list_producers(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, ADMIN_SCOPE)
    return JSONResponse({"producers": [p.model_dump(mode="json") for p in await state.store.producers()]})


async def revoke_producer(request: Request, state: RegistryState) -> Response:
    """Take a producer's credentials back: its connections are closed within a second."""
    claims = await _authorize(request, state, ADMIN_SCOPE)
    body = await _json_body(request)
    revoked = await producers.revoke(
        state.store, request.path_params["producer_id"], claims.sub, str(body.get("reason", ""))
    )
    for revocation in revoked:
        await record_revocation(state.keys.nats, revocation, state.signer, state.trust.issuer)
        state.revocations.note(revocation)
    return JSONResponse({"revoked": [r.to_json() for r in revoked]})


async def list_revocations(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, "registry:read")
    return JSONResponse({"revoked": [r.to_json() for r in state.revocations.revoked()]})


async def tenant_key(request: Request, state: RegistryState) -> Response:
    """A tenant's key for the asking service (its own registry token), against the access token one
    of that tenant's callers sent it (``caller_token``; see ``registry._tenant_keys``)."""
    service = await _authorize(request, state, "registry:read")
    body = await _json_body(request)
    released = await state.tenant_keys.release(
        service,
        await state.store.identity(service.sub),
        str(body.get("caller_token") or ""),
        str(body.get("tenant") or ""),
    )
    return JSONResponse(released.to_json(), headers={"Cache-Control": "no-store"})


async def get_mcp_server(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, "registry:read")
    record = await state.store.mcp_server(request.path_params["server_id"])
    if record is None:
        raise FleetError(ErrorCode.NOT_FOUND, "no such MCP server")
    return JSONResponse(record.model_dump(mode="json"))


async def records(request: Request, state: RegistryState) -> Response:
    await _authorize(request, state, "registry:read")
    return JSONResponse(
        {
            "identities": [
                {"id": i.id, "kind": i.kind, "kids": list(i.keys), "retiring": i.retiring}
                for i in await state.store.identities()
            ],
            "agents": [
                {
                    "id": a.id,
                    "kind": a.kind,
                    "url": a.url,
                    "version": a.version,
                    "status": a.status,
                    "skills": [s.model_dump() for s in a.skills],
                }
                for a in await state.store.agents()
            ],
            "mcp_servers": [m.model_dump(mode="json") for m in await state.store.mcp_servers()],
        }
    )


# ------------------------------------------------------------------------------------ app
def build_app(settings: ServiceSettings) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        key = SigningKey.load_or_create(settings.key_file)
        trust = IssuerTrust.from_file(settings.operator_jwk_file, settings.issuer)
        revocations = Revocations(trust)
        door = await _open_bus(settings, key, revocations)
        try:
            nc = await connect(
                settings.nats_url,
                settings.service_id,
                replicas=settings.nats_replicas,
                credentials=Credentials(settings.service_id, key=key, tls_ca=settings.tls_ca_file),
            )
        except BaseException:
            if door is not None:
                await door.authority.stop()
            raise
        try:
            async with (
                httpx.AsyncClient(event_hooks=transport.hooks()) as http,
                contextlib.AsyncExitStack() as stack,
            ):
                await revocations.follow(nc)
                seal = RecordSeal(trust, lambda kid: revocations.check(kid) is not None)
                store = await RegistryStore.open(nc, seal)
                if door is not None:
                    door.store = store
                    stack.push_async_callback(door.authority.stop)
                admin = KeyAdmin(
                    store, nc, settings.service_id, settings.key_file, settings.public_url, trust
                )
                signer = seal.signer = await _certified(key, admin, settings)
                operator_key = await _enroll_operator(store, settings)
                policy = await stack.enter_async_context(
                    enforcing(door.policy if door else live_policy(settings), nc)
                )
                cards = await stack.enter_async_context(
                    guarded_client("card", policy, local=settings.local_stack)
                )

                async def own_key(kid: str) -> ec.EllipticCurvePublicKey | None:
                    registry: RegistryState = app.state.registry
                    return registry.issuer_key(kid)

                master = MasterSecret.load_or_create(
                    settings.tenant_key_master_file or settings.local_state_dir() / "tenant-key-master.json"
                )
                state = RegistryState(
                    store=store,
                    tokens=TokenService(
                        store,
                        key,
                        settings.issuer,
                        settings.public_url + "/oauth/token",
                        revocations,
                        own_key,
                        policy=policy,
                        external=[
                            ExternalTokenVerifier(issuer, http, revocations=revocations)
                            for issuer in settings.external_issuers
                        ],
                        issuer_url=settings.public_url,
                    ),
                    enrollment=Enrollment(store, operator_key),
                    verifier=TokenVerifier(
                        own_key, issuer=settings.issuer, audience=REGISTRY_AUDIENCE, revocations=revocations
                    ),
                    keys=admin,
                    revocations=revocations,
                    issuer_keys={},
                    http=cards,
                    trust=trust,
                    signer=signer,
                    tenant_keys=TenantKeyService(master, own_key, settings.issuer, revocations, policy),
                    skills=SkillBinding(policy),
                )
                state.trust_issuer_keys(await admin.publish_issuer_key(signer))
                revocations.on_revoke(lambda revoked: _distrust(state, revoked.kid))
                app.state.registry = state
                checks = (
                    asyncio.create_task(
                        refresh_forever(store, cards, state.skills, settings.card_refresh_s),
                        name="card-checks",
                    )
                    if settings.card_refresh_s > 0
                    else None
                )
                yield
                if checks is not None:
                    checks.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await checks
                await revocations.stop()
        finally:
            await nc.drain()

    routes = [
        Route("/healthz", always_ready(settings.service_id, "registry").endpoint),
        Route("/.well-known/jwks.json", _route(jwks)),
        Route("/oauth/token", _route(token), methods=["POST"]),
        Route("/oauth/authorize", authorize, methods=["GET", "POST"]),
        Route(
            "/.well-known/oauth-authorization-server",
            _metadata_route(authorization_server_metadata(settings)),
        ),
        Route("/v1/enroll", _route(enroll), methods=["POST"]),
        Route("/v1/records", _route(records)),
        Route("/v1/agents", _route(list_agents)),
        Route("/v1/agents/{agent_id}", _route(get_agent)),
        Route("/v1/agents/{agent_id}", _route(register_agent), methods=["PUT"]),
        Route("/v1/agents/{agent_id}/jwks.json", _route(agent_keys)),
        Route("/v1/agents/{agent_id}/history", _route(agent_history)),
        Route("/v1/agents/{agent_id}/refresh", _route(refresh_agent), methods=["POST"]),
        Route("/v1/mcp-servers", _route(list_mcp_servers)),
        Route("/v1/mcp-servers/{server_id}", _route(get_mcp_server)),
        Route("/v1/mcp-servers/{server_id}", _route(register_mcp_server), methods=["PUT"]),
        Route("/v1/identities/{identity_id}/keys", _route(rotate_identity_key), methods=["POST"]),
        Route("/v1/keys/{kid}/revoke", _route(revoke_key), methods=["POST"]),
        Route("/v1/issuer/rotate", _route(rotate_issuer_key), methods=["POST"]),
        Route("/v1/issuer/certificate", _route(certify_issuer_key), methods=["POST"]),
        Route("/v1/revocations", _route(list_revocations)),
        Route("/v1/tenant-keys", _route(tenant_key), methods=["POST"]),
        Route("/v1/producers", _route(list_producers)),
        Route("/v1/producers", _route(issue_producer), methods=["POST"]),
        Route("/v1/producers/{producer_id}/revoke", _route(revoke_producer), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


@dataclass(slots=True)
class _BusDoor:
    """The registry as the bus's authority: it answers NATS's authorization requests from before
    its own connection exists (it connects through its own door), with records once the store is
    open."""

    authority: BusAuthority
    policy: LivePolicy
    store: RegistryStore | None = None


async def _open_bus(settings: ServiceSettings, key: SigningKey, revocations: Revocations) -> _BusDoor | None:
    """Start answering the bus's authorization requests, if this registry holds the bus's keys."""
    if settings.nats_keys_dir is None:
        return None
    policy = live_policy(settings)

    async def identity(identity_id: str) -> IdentityRecord | None:
        if identity_id == settings.service_id:  # itself: its own key, before any record exists
            return IdentityRecord(
                id=identity_id, kind="registry", keys={key.kid: key.public_jwk()}, enrolled_at=time.time()
            )
        return await door.store.identity(identity_id) if door.store is not None else None

    async def producer(nkey: str) -> ProducerRecord | None:
        return await door.store.producer(nkey) if door.store is not None else None

    authority = BusAuthority(
        keys=BusKeys.load(settings.nats_keys_dir, *REGISTRY_KEYS),
        identities=identity,
        producers=producer,
        policy=policy,
        revocations=revocations,
        self_id=settings.service_id,
        tls_ca=settings.tls_ca_file,
    )
    door = _BusDoor(authority, policy)
    await authority.start(settings.nats_url)
    return door


def _distrust(state: RegistryState, kid: str) -> None:
    state.issuer_keys.pop(kid, None)


async def _certified(key: SigningKey, admin: KeyAdmin, settings: ServiceSettings) -> CertifiedKey:
    """``key`` with the operator's certificate for it: from ``FLEET_ISSUER_CERT_FILE`` (written
    where the operator key is: ``fleet up``, ``deploy.keygen``), or as a completed rotation
    recorded it. Without one the registry does not start: no verifier would trust its tokens."""
    if settings.issuer_cert_file is not None and settings.issuer_cert_file.exists():
        cert = settings.issuer_cert_file.read_text().strip()
        if admin.trusts(key, cert):
            return CertifiedKey(key, cert)
    recorded = await admin.certificate_of(key)
    if recorded is None:
        raise FleetError(
            ErrorCode.INVALID_REQUEST,
            f"the registry's signing key {key.kid} has no operator certificate (FLEET_ISSUER_CERT_FILE)",
        )
    return CertifiedKey(key, recorded)


async def _enroll_operator(store: RegistryStore, settings: ServiceSettings) -> ec.EllipticCurvePublicKey:
    """The operator's key is the registry's root of trust: it is enrolled from the data dir."""
    if settings.operator_jwk_file is None:
        raise FleetError(ErrorCode.INVALID_REQUEST, "FLEET_OPERATOR_JWK_FILE is required")
    jwk = json.loads(settings.operator_jwk_file.read_text())
    await store.put_identity(
        IdentityRecord(
            id=OPERATOR_ISSUER,
            kind="operator",
            keys={jwk["kid"]: jwk},
            scopes=["*"],
            tenants=["*"],
            enrolled_at=time.time(),
        )
    )
    return public_key_from_jwk(jwk)


async def main(settings: ServiceSettings) -> None:
    configure_logging(settings.service_id, settings.log_level)
    await serve_app(build_app(settings), settings)
