"""What every A2A server of the fleet shares: the bearer-JWT gate (the SDK enforces no auth), the call
context carrying the verified claims, and signed agent cards."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import (
    DefaultServerCallContextBuilder,
    create_agent_card_routes,
    create_jsonrpc_routes,
)
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentExtension,
    AgentInterface,
    AgentSkill,
    ClientCredentialsOAuthFlow,
    HTTPAuthSecurityScheme,
    OAuth2SecurityScheme,
    OAuthFlows,
    SecurityRequirement,
    SecurityScheme,
    StringList,
)
from a2a.utils.signing import create_agent_card_signer
from jwt import PyJWK
from jwt.algorithms import ECAlgorithm
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fleet.errors import FleetError
from fleet.keys import ALGORITHM, SigningKey
from fleet.service import Readiness
from fleet.tokens import BearerVerifier, Claims, bearer_token

RPC_PATH = "/a2a/jsonrpc"


class BearerAuthMiddleware:
    """Requires a valid access token for this service on every A2A call (the card stays public).

    A request without one gets 401 and ``WWW-Authenticate``; a verified request carries its
    :class:`Claims` in ``scope["state"]["claims"]`` and a user named after the token subject.
    """

    def __init__(
        self,
        app: ASGIApp,
        verifier: BearerVerifier,
        required_scope: str,
        protected_prefixes: tuple[str, ...] = (RPC_PATH,),
        rpc_verifier: BearerVerifier | None = None,
    ) -> None:
        """``rpc_verifier``: another verifier for the A2A JSON-RPC path only (the coordinator's,
        which also takes outside issuers' tokens there, and nowhere else)."""
        self._app = app
        self._verifier = verifier
        self._rpc_verifier = rpc_verifier or verifier
        self._scope = required_scope
        self._prefixes = protected_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self._prefixes):
            await self._app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1") or None
        verifier = self._rpc_verifier if scope["path"].startswith(RPC_PATH) else self._verifier
        try:
            claims = await verifier.verify(bearer_token(authorization), required_scopes=[self._scope])
        except FleetError as exc:
            await _deny(send, exc)
            return
        scope["user"] = _TokenUser(claims)
        scope.setdefault("state", {})["claims"] = claims
        await self._app(scope, receive, send)


async def _deny(send: Send, exc: FleetError) -> None:
    body = json.dumps({"error": exc.to_dict()}).encode()
    challenge = f'Bearer error="invalid_token", error_description="{exc.message}"'
    if exc.http_status == 403:
        challenge = f'Bearer error="insufficient_scope", error_description="{exc.message}"'
    await send(
        {
            "type": "http.response.start",
            "status": exc.http_status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", challenge.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _TokenUser:
    """The Starlette user of a verified request; the SDK scopes tasks by ``display_name``.

    Tasks belong to ``tenant/subject`` so that one tenant never sees another's tasks.
    """

    def __init__(self, claims: Claims) -> None:
        self.claims = claims

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return f"{self.claims.tenant}/{self.claims.sub}"


class ClaimsContextBuilder(DefaultServerCallContextBuilder):
    """Puts the verified claims into the SDK's call context (``state["claims"]``)."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state["claims"] = request.scope.get("state", {}).get("claims")
        return context


def request_claims(request: Request) -> Claims:
    """The verified claims of a plain HTTP request behind :class:`BearerAuthMiddleware`."""
    claims = request.scope.get("state", {}).get("claims")
    if not isinstance(claims, Claims):
        raise RuntimeError("a protected route was reached without verified claims")
    return claims


def claims_of(context: ServerCallContext | None) -> Claims:
    """The verified claims of the current A2A call (the auth middleware guarantees them)."""
    claims = context.state.get("claims") if context is not None else None
    if not isinstance(claims, Claims):
        raise RuntimeError("A2A call reached an executor without verified claims")
    return claims


def build_card(
    *,
    name: str,
    description: str,
    version: str,
    base_url: str,
    skills: list[AgentSkill],
    token_url: str,
    required_scope: str,
    streaming: bool = True,
    extensions: Sequence[AgentExtension] = (),
    input_modes: Sequence[str] = ("text/plain", "application/json"),
) -> AgentCard:
    """An unsigned card for an agent served at ``base_url`` behind bearer-JWT auth.

    The card says how to get a token: an OAuth 2 client-credentials flow at the registry's token
    endpoint (``private_key_jwt``, an ``audience`` of this agent's id, a ``tenant``)."""
    return AgentCard(
        name=name,
        description=description,
        version=version,
        supported_interfaces=[
            AgentInterface(url=base_url + RPC_PATH, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=streaming, extensions=list(extensions)),
        default_input_modes=list(input_modes),
        default_output_modes=["text/plain", "application/json"],
        security_schemes={
            "bearer": SecurityScheme(
                http_auth_security_scheme=HTTPAuthSecurityScheme(
                    scheme="Bearer",
                    bearer_format="JWT",
                    description="An access token from the fleet registry's token service "
                    "(audience: this agent's id)",
                )
            ),
            "fleet_oauth": SecurityScheme(
                oauth2_security_scheme=OAuth2SecurityScheme(
                    description="Client credentials with private_key_jwt (RFC 7523); send "
                    "audience=<this agent's id> and tenant=<your tenant> with the token request.",
                    flows=OAuthFlows(
                        client_credentials=ClientCredentialsOAuthFlow(
                            token_url=token_url, scopes={required_scope: "call this agent"}
                        )
                    ),
                )
            ),
        },
        security_requirements=[
            SecurityRequirement(schemes={"bearer": StringList(list=[])}),
            SecurityRequirement(schemes={"fleet_oauth": StringList(list=[required_scope])}),
        ],
        skills=skills,
    )


def a2a_app(
    *,
    card: AgentCard,
    handler: DefaultRequestHandler,
    readiness: Readiness,
    verifier: BearerVerifier,
    required_scope: str,
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]],
    extra_routes: Sequence[BaseRoute] = (),
    protected_prefixes: tuple[str, ...] = (RPC_PATH,),
    rpc_verifier: BearerVerifier | None = None,
) -> Starlette:
    """An A2A agent's app: ``/healthz`` and the card are public; JSON-RPC (and any other
    ``protected_prefixes``) need a token for this agent."""
    app = Starlette(
        routes=[
            Route("/healthz", readiness.endpoint),
            *create_agent_card_routes(card),
            *create_jsonrpc_routes(handler, rpc_url=RPC_PATH, context_builder=ClaimsContextBuilder()),
            *extra_routes,
        ],
        lifespan=lifespan,
    )
    app.add_middleware(
        BearerAuthMiddleware,
        verifier=verifier,
        required_scope=required_scope,
        protected_prefixes=protected_prefixes,
        rpc_verifier=rpc_verifier,
    )
    return app


def sign_card(card: AgentCard, key: SigningKey, jku: str | None = None) -> AgentCard:
    """Sign ``card`` (JWS over its RFC 8785 canonical form, as A2A 1.0 specifies)."""
    private_jwk: dict[str, Any] = ECAlgorithm.to_jwk(key.private_key, as_dict=True)
    header: dict[str, Any] = {"alg": ALGORITHM, "kid": key.kid, "typ": "JOSE"}
    if jku:
        header["jku"] = jku
    signer = create_agent_card_signer(PyJWK(private_jwk, algorithm=ALGORITHM), header)  # type: ignore[arg-type]
    return signer(card)


__all__ = [
    "RPC_PATH",
    "BearerAuthMiddleware",
    "ClaimsContextBuilder",
    "a2a_app",
    "build_card",
    "claims_of",
    "request_claims",
    "sign_card",
]
