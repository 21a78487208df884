"""What every A2A server of the fleet shares: the bearer-JWT gate (the SDK enforces no auth), the call
context carrying the verified claims, and signed agent cards."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

from a2a.server.context import ServerCallContext
from a2a.server.jsonrpc_models import InvalidRequestError, JSONParseError, JSONRPCError
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.server.routes import (
    DefaultServerCallContextBuilder,
    create_agent_card_routes,
    create_jsonrpc_routes,
    create_rest_routes,
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
from a2a.utils.errors import A2AError, InternalError, InvalidParamsError
from a2a.utils.signing import create_agent_card_signer
from jwt import PyJWK
from jwt.algorithms import ECAlgorithm
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.bodylimit import BodyLimit
from fleet.errors import PROBLEM_MEDIA_TYPE, ErrorCode, FleetError
from fleet.keys import ALGORITHM, SigningKey
from fleet.service import Readiness
from fleet.settings import ServiceSettings
from fleet.tokens import BearerVerifier, Claims, bearer_token

RPC_PATH = "/a2a/jsonrpc"
REST_PATH = "/a2a/rest"  # A2A's HTTP+JSON binding: /a2a/rest/message:send, /a2a/rest/tasks/{id}, ...
A2A_PATHS = (RPC_PATH, REST_PATH)  # the A2A surface, on either binding

if TYPE_CHECKING:
    from fleet.a2a_grpc import GrpcBinding

log = logging.getLogger(__name__)


def a2a_error(exc: FleetError, kind: type[A2AError] | None = None) -> A2AError:
    """``exc`` as an A2A error: its message as the message and its envelope as the data (which the
    SDK sends as a ``google.rpc.ErrorInfo``'s metadata, and its client hands back as the error's
    ``data``). ``kind`` is the A2A error type; by default a caller's fault (4xx) is invalid
    params and anything else (a 5xx, or what may work later) an internal error."""
    if kind is None:
        kind = InternalError if exc.http_status >= 500 or exc.retryable else InvalidParamsError
    return kind(message=exc.message, data=exc.to_dict())


def error_of_a2a(exc: A2AError, fallback: ErrorCode = ErrorCode.SPECIALIST_FAILED) -> FleetError:
    """The FleetError an A2A error carries (its data is a fleet envelope when a fleet agent sent it);
    ``fallback`` with the error's message when it carries none (an agent that is not the fleet's)."""
    data = exc.data
    if isinstance(data, dict) and "code" in data:
        return FleetError.from_dict(data, fallback=fallback)
    return FleetError(fallback, str(getattr(exc, "message", "") or type(exc).__name__))


def a2a_body_limit(settings: ServiceSettings) -> BodyLimit:
    """The body cap of the A2A JSON-RPC path (for :func:`fleet.service.serve_app`): refusals there
    are JSON-RPC errors."""
    return BodyLimit(RPC_PATH, settings.max_body_bytes, jsonrpc=True)


class JsonRpcBodyCheck:
    """Answers an A2A JSON-RPC body that is not UTF-8 JSON with -32700 Parse error, and JSON that is
    not an object with -32600 Invalid Request (JSON-RPC 2.0: ``1`` is an invalid request; batches are
    not supported), both with id null. The SDK's dispatcher answers some of these -32603 with a logged
    traceback. Other bodies reach the app unchanged. The body is read whole here, as the dispatcher
    reads it: the cap of :mod:`fleet.bodylimit` bounds it."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != RPC_PATH:
            await self._app(scope, receive, send)
            return
        body = await _read_body(receive)
        if body is None:
            return  # the caller went away: nobody to answer
        error = _body_error(body)
        if error is not None:
            claims = scope.get("state", {}).get("claims")
            who = f"{claims.tenant}/{claims.sub}" if isinstance(claims, Claims) else "-"
            log.warning("A2A request refused (%d %s); principal=%s", error.code, error.message, who)
            await JSONResponse(build_error_response(None, error))(scope, receive, send)
            return
        await self._app(scope, _replay(body, receive), send)


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _body_error(body: bytes) -> JSONRPCError | None:
    try:
        parsed = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return JSONParseError(message="Parse error: the body is not UTF-8 JSON")
    if isinstance(parsed, list):
        return InvalidRequestError(message="Batch requests are not supported")
    if not isinstance(parsed, dict):
        return InvalidRequestError(message="Invalid request: the body must be a JSON object")
    return None


class _CallerFaultTraces(logging.Filter):
    """Drops the a2a-sdk dispatcher's ERROR records with a stack trace for requests it refuses as
    the caller's fault (-32600 Invalid Request, -32602 Invalid params): it logs each again as a
    WARNING with the reason, and a caller must not be able to fill the log with stack traces."""

    MESSAGES = frozenset({"Failed to validate base JSON-RPC request", "Failed to parse request params"})

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.MESSAGES


def _quiet_caller_faults() -> None:
    dispatcher_log = logging.getLogger("a2a.server.routes.jsonrpc_dispatcher")
    if not any(isinstance(f, _CallerFaultTraces) for f in dispatcher_log.filters):
        dispatcher_log.addFilter(_CallerFaultTraces())


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` once, then waits on the real one (for the disconnect)."""
    pending = [body]

    async def replayed() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replayed


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
        protected_prefixes: tuple[str, ...] = A2A_PATHS,
        rpc_verifier: BearerVerifier | None = None,
    ) -> None:
        """``rpc_verifier``: another verifier for the A2A surface only, on either binding (the
        coordinator's, which also takes outside issuers' tokens there, and nowhere else)."""
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
        verifier = self._rpc_verifier if scope["path"].startswith(A2A_PATHS) else self._verifier
        try:
            claims = await verifier.verify(bearer_token(authorization), required_scopes=[self._scope])
        except FleetError as exc:
            await _deny(send, exc)
            return
        scope["user"] = _TokenUser(claims)
        scope.setdefault("state", {})["claims"] = claims
        await self._app(scope, receive, send)


async def _deny(send: Send, exc: FleetError) -> None:
    body = json.dumps(exc.problem()).encode()
    challenge = f'Bearer error="invalid_token", error_description="{exc.message}"'
    if exc.http_status == 403:
        challenge = f'Bearer error="insufficient_scope", error_description="{exc.message}"'
    await send(
        {
            "type": "http.response.start",
            "status": exc.http_status,
            "headers": [
                (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
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
    grpc_url: str | None = None,
) -> AgentCard:
    """An unsigned card for an agent served at ``base_url`` behind bearer-JWT auth.

    The card says how to get a token: an OAuth 2 client-credentials flow at the registry's token
    endpoint (``private_key_jwt``, an ``audience`` of this agent's id, a ``tenant``)."""
    return AgentCard(
        name=name,
        description=description,
        version=version,
        # In the order of preference: JSON-RPC first, as the fleet's own clients speak it.
        supported_interfaces=[
            AgentInterface(url=base_url + RPC_PATH, protocol_binding="JSONRPC", protocol_version="1.0"),
            AgentInterface(url=base_url + REST_PATH, protocol_binding="HTTP+JSON", protocol_version="1.0"),
            *(
                [AgentInterface(url=grpc_url, protocol_binding="GRPC", protocol_version="1.0")]
                if grpc_url
                else []
            ),
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


def rest_routes(handler: DefaultRequestHandler) -> list[BaseRoute]:
    """The HTTP+JSON binding's routes under ``REST_PATH``. Not its optional ``/{tenant}/...`` form:
    a2a-sdk 1.3 mounts that at the root whatever the prefix, where it would take every other route
    of the app; a caller's tenant is its token's here, never a path segment."""
    routes = create_rest_routes(handler, context_builder=ClaimsContextBuilder(), path_prefix=REST_PATH)
    return [route for route in routes if isinstance(route, Route) and route.path.startswith(REST_PATH)]


def a2a_app(
    *,
    card: AgentCard,
    handler: DefaultRequestHandler,
    readiness: Readiness,
    verifier: BearerVerifier,
    required_scope: str,
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]],
    extra_routes: Sequence[BaseRoute] = (),
    protected_prefixes: tuple[str, ...] = A2A_PATHS,
    rpc_verifier: BearerVerifier | None = None,
    grpc: GrpcBinding | None = None,
) -> Starlette:
    """An A2A agent's app: ``/healthz`` and the card are public; the A2A surface on both its
    bindings, JSON-RPC (``RPC_PATH``) and HTTP+JSON (``REST_PATH``), one handler and one task store
    behind both (and any other ``protected_prefixes``) need a token for this agent. ``grpc``: the
    gRPC binding (:mod:`fleet.a2a_grpc`), started and stopped with the app."""
    if grpc is not None:
        lifespan = _with_grpc(lifespan, grpc, handler)
    app = Starlette(
        routes=[
            Route("/healthz", readiness.endpoint),
            *create_agent_card_routes(card),
            *create_jsonrpc_routes(handler, rpc_url=RPC_PATH, context_builder=ClaimsContextBuilder()),
            *rest_routes(handler),
            *extra_routes,
        ],
        lifespan=lifespan,
    )
    _quiet_caller_faults()
    app.add_middleware(JsonRpcBodyCheck)  # inside the auth: a caller without a token gets 401 unread
    app.add_middleware(
        BearerAuthMiddleware,
        verifier=verifier,
        required_scope=required_scope,
        protected_prefixes=protected_prefixes,
        rpc_verifier=rpc_verifier,
    )
    return app


def _with_grpc(
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]],
    grpc: GrpcBinding,
    handler: DefaultRequestHandler,
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def serving(app: Starlette) -> AsyncIterator[None]:
        async with lifespan(app):
            await grpc.start(handler)
            try:
                yield
            finally:
                await grpc.stop()

    return serving


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
    "JsonRpcBodyCheck",
    "a2a_app",
    "a2a_body_limit",
    "build_card",
    "claims_of",
    "request_claims",
    "sign_card",
]
