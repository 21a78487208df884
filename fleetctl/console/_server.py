"""The operator console: a web page over the run API, the registry, the policy and the memory audit.

The console holds no state of its own and no power of its own: every call it makes to the
coordinator or the registry is made with a token in the signed-in person's name (see
:mod:`fleetctl.console._session`), so the coordinator authenticates and policy-checks an approval
from the console exactly as one from the CLI. The page is static (``static/``); the console serves
it and a same-origin JSON API under ``/api/`` that forwards to the backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from nats.aio.client import Client as NATS
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet import transport
from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import connect, service_credentials
from fleet.service import Readiness, configure_logging, problem_response, serve_app, start_in_background
from fleet.settings import ServiceSettings
from fleetctl.console._charts import MetricsHistory, series, window_of
from fleetctl.console._feeds import memory_audit, policy_view
from fleetctl.console._session import Person, Sessions, SignOuts
from registry.client import RegistryClient

STATIC = Path(__file__).parent / "static"
# runs:admin only if the person signed in with it (Sessions.token_for keeps what they have).
RUN_SCOPES = ("agent:invoke", "runs:admin")
ANSWER_SCOPES = ("agent:invoke", "runs:approve", "runs:admin")
REGISTRY_SCOPES = ("registry:read",)
BACKEND_TIMEOUT_S = 15.0
STREAM_TIMEOUT = httpx.Timeout(BACKEND_TIMEOUT_S, read=None)  # a run may be quiet for days
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]

log = logging.getLogger(__name__)


class _Backends:
    """Where the console's calls go, found through the registry when the console starts."""

    def __init__(self) -> None:
        self.coordinator = ""
        self.coordinator_id = "coordinator"
        self.nats: NATS | None = None


def _error(exc: FleetError) -> JSONResponse:
    return problem_response(exc)


class _Api:
    """The JSON API of the page: each handler finds the person, then forwards in their name."""

    def __init__(
        self, sessions: Sessions, registry: RegistryClient, http: httpx.AsyncClient, backends: _Backends
    ):
        self._sessions = sessions
        self._registry = registry
        self._http = http
        self._backends = backends
        self._history = MetricsHistory()

    async def _call(
        self,
        request: Request,
        base: str,
        audience: str,
        scopes: tuple[str, ...],
        path: str,
        *,
        method: str = "GET",
    ) -> Response:
        try:
            person = await self._sessions.person(request)
            token = await self._sessions.token_for(person, audience, scopes)
            body = await request.body() if method == "POST" else None
            response = await self._http.request(
                method,
                base + path,
                content=body,
                params=dict(request.query_params),
                headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
                timeout=BACKEND_TIMEOUT_S,
            )
        except FleetError as exc:
            return _error(exc)
        except httpx.HTTPError as exc:
            return _error(
                FleetError(
                    ErrorCode.DEPENDENCY_UNAVAILABLE, f"{audience} did not answer: {type(exc).__name__}"
                )
            )
        return Response(response.content, status_code=response.status_code, media_type="application/json")

    async def run_api(self, request: Request) -> Response:
        """``/api/runs[/{run_id}[/signals|operations|debug-bundle]]`` -> the coordinator's
        ``/v1/runs...`` (the routes name every part; each segment is checked: no ``..`` reaches a
        backend)."""
        try:
            path = "/v1" + _backend_path(request, "/api")
        except FleetError as exc:
            return _error(exc)
        scopes = ANSWER_SCOPES if request.method == "POST" else RUN_SCOPES
        return await self._call(
            request,
            self._backends.coordinator,
            self._backends.coordinator_id,
            scopes,
            path,
            method=request.method,
        )

    async def agents(self, request: Request) -> Response:
        """``/api/agents[/{agent_id}]`` -> the registry's."""
        try:
            path = "/v1" + _backend_path(request, "/api")
        except FleetError as exc:
            return _error(exc)
        return await self._call(request, self._registry.url, "registry", REGISTRY_SCOPES, path)

    async def mcp_servers(self, request: Request) -> Response:
        return await self._call(request, self._registry.url, "registry", REGISTRY_SCOPES, "/v1/mcp-servers")

    async def events(self, request: Request) -> Response:
        """A run's event stream, relayed as it comes (the browser's ``EventSource`` reconnects
        with ``Last-Event-ID``, which goes to the coordinator unchanged)."""
        try:
            path = f"/v1/runs/{_segment(request.path_params['run_id'])}/events"
        except FleetError as exc:
            return _error(exc)
        return await self._relay_stream(request, path)

    async def changes(self, request: Request) -> Response:
        """The tenant's newest runs, pushed whenever they change (the lanes' feed)."""
        return await self._relay_stream(request, "/v1/runs/changes")

    async def _relay_stream(self, request: Request, path: str) -> Response:
        """A server-sent event stream of the coordinator's run API, relayed as it comes, in the
        signed-in person's name."""
        try:
            person = await self._sessions.person(request)
            token = await self._sessions.token_for(person, self._backends.coordinator_id, RUN_SCOPES)
        except FleetError as exc:
            return _error(exc)
        headers = {"authorization": f"Bearer {token}"}
        if cursor := request.headers.get("last-event-id"):
            headers["last-event-id"] = cursor
        upstream = self._http.build_request(
            "GET",
            self._backends.coordinator + path,
            headers=headers,
            params=dict(request.query_params),
            timeout=STREAM_TIMEOUT,
        )
        try:
            response = await self._http.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return _error(FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, f"coordinator: {type(exc).__name__}"))
        if response.status_code != 200:  # a refusal, ``stream_limit`` (429) with its Retry-After included
            body = await response.aread()
            await response.aclose()
            retry = (
                {"retry-after": response.headers["retry-after"]} if "retry-after" in response.headers else {}
            )
            return Response(
                body, status_code=response.status_code, media_type="application/json", headers=retry
            )

        async def relay() -> AsyncIterator[str]:
            # Without the ``event:`` lines: a browser's EventSource hands only untyped events to
            # one handler, and each event's data says what it is anyway.
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("event:"):
                        yield line + "\n"
            finally:
                await response.aclose()

        # The background task closes the upstream stream also when the browser left before the
        # relay began (its ``finally`` then never runs); closing twice is harmless.
        return StreamingResponse(
            relay(),
            media_type="text/event-stream",
            headers={"cache-control": "no-store"},
            background=BackgroundTask(response.aclose),
        )

    async def me(self, request: Request) -> Response:
        try:
            person = await self._sessions.person(request)
        except FleetError as exc:
            return _error(exc)
        claims = person.claims
        return JSONResponse(
            {
                "sub": claims.sub,
                "tenant": claims.tenant,
                "scopes": sorted(claims.scopes),
                "expires_at": claims.expires_at,
            }
        )

    async def policy(self, request: Request) -> Response:
        """The fleet's policy status and decision log: for a sign-in that may read the fleet's
        records (``registry:read``), as they name no tenant."""
        try:
            person = await self._sessions.person(request)
            _require(person, "registry:read")
            return JSONResponse(await policy_view(self._nats()))
        except FleetError as exc:
            return _error(exc)

    async def metrics(self, request: Request) -> Response:
        """``/api/metrics?window=15m|1h|6h``: the fleet's charts over time (see
        :mod:`fleetctl.console._charts`), for a sign-in that may read the fleet's records
        (``registry:read``): the metrics name no tenant."""
        try:
            person = await self._sessions.person(request)
            _require(person, "registry:read")
            window_s = window_of(request.query_params.get("window"))
            await self._history.refresh(self._nats())
        except FleetError as exc:
            return _error(exc)
        return JSONResponse(series(self._history.samples, time.time(), window_s))

    async def memory(self, request: Request) -> Response:
        """The memory audit of the sign-in's tenant: for a sign-in that may read its runs."""
        try:
            person = await self._sessions.person(request)
            _require(person, "agent:invoke")
            return JSONResponse({"events": await memory_audit(self._nats(), person.claims.tenant)})
        except FleetError as exc:
            return _error(exc)

    def _nats(self) -> NATS:
        if self._backends.nats is None:
            raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "the console is not connected to NATS yet")
        return self._backends.nats


class _Auth:
    """Sign-in and sign-out."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def sign_in(self, request: Request) -> Response:
        try:
            person = await self._sessions.sign_in(request)
        except FleetError as exc:
            return _error(exc)
        claims = person.claims
        response = JSONResponse({"sub": claims.sub, "tenant": claims.tenant, "expires_at": claims.expires_at})
        self._sessions.keep(response, person)
        return response

    async def sign_out(self, request: Request) -> Response:
        response = JSONResponse({"signed_out": True})
        try:
            await self._sessions.sign_out(request, response)
        except FleetError as exc:
            return _error(exc)
        return response


class _Guard:
    """Security headers on every answer; a state-changing request must come from the console's own
    page (same origin, and the header only a script of that page sets), on top of the
    ``SameSite=Strict`` cookie."""

    def __init__(self, app: ASGIApp, public_origin: str) -> None:
        self._app = app
        self._public_origin = public_origin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        request = Request(scope)
        if request.method not in ("GET", "HEAD") and not _same_origin(request, self._public_origin):
            refused = _error(
                FleetError(ErrorCode.FORBIDDEN, "a change must come from the console's own page")
            )
            await refused(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], *SECURITY_HEADERS]
            await send(message)

        await self._app(scope, receive, with_headers)


def _same_origin(request: Request, public_origin: str) -> bool:
    if request.headers.get("x-fleet-console") != "1":
        return False
    origin = request.headers.get("origin")
    return origin is None or origin in (public_origin, f"{request.url.scheme}://{request.url.netloc}")


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


_SEGMENT = re.compile(r"^(?!\.+$)[A-Za-z0-9._:@~-]{1,200}$")


def _segment(value: str) -> str:
    """``value`` as one path segment of a backend URL, or ``invalid_request``: never ``.`` or
    ``..`` (a client normalises those away, reaching another route) nor a ``/``."""
    if not _SEGMENT.match(value):
        raise FleetError(ErrorCode.INVALID_REQUEST, "not an id")
    return value


def _backend_path(request: Request, prefix: str) -> str:
    """The request's path after ``prefix``, every segment checked by :func:`_segment`."""
    tail = request.url.path.removeprefix(prefix).strip("/")
    return "".join(f"/{_segment(part)}" for part in tail.split("/"))


def _require(person: Person, scope: str) -> None:
    if scope not in person.claims.scopes:
        raise FleetError(ErrorCode.FORBIDDEN, f"the session was signed in without {scope}")


def _page(name: str) -> Any:
    async def serve(request: Request) -> Response:
        return FileResponse(STATIC / name, media_type="text/html")

    return serve


def build_app(settings: ServiceSettings) -> Starlette:
    """The console's app; it enrolls, then finds the coordinator through the registry."""
    http = httpx.AsyncClient(timeout=BACKEND_TIMEOUT_S, event_hooks=transport.hooks())
    registry = RegistryClient(settings, http)
    login, grants = Sessions.verifiers(
        registry.jwks.get,
        issuer=settings.issuer,
        console_id=settings.service_id,
        revocations=registry.revocations,
    )
    signed_out = SignOuts()
    sessions = Sessions(
        tokens=registry.tokens,
        login_verifier=login,
        grant_verifier=grants,
        secure_cookie=settings.public_url.startswith("https://"),
        signed_out=signed_out,
    )
    backends = _Backends()
    api = _Api(sessions, registry, http, backends)
    auth = _Auth(sessions)
    readiness = Readiness(settings.service_id, "console")

    async def start() -> None:
        await registry.join_as_worker()  # enroll; the console registers nothing
        backends.nats = await connect(
            settings.nats_url,
            settings.service_id,
            replicas=settings.nats_replicas,
            credentials=service_credentials(settings),
        )
        await signed_out.open(backends.nats)
        backends.coordinator = await _find_coordinator(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with start_in_background(readiness, start):
            try:
                yield
            finally:
                if backends.nats is not None:
                    await backends.nats.drain()
                await registry.aclose()
                await http.aclose()

    routes = [
        Route("/healthz", readiness.endpoint),
        Route("/", _page("index.html")),
        Route("/login", _page("login.html")),
        Route("/session", auth.sign_in, methods=["POST"]),
        Route("/session/end", auth.sign_out, methods=["POST"]),
        Route("/api/me", api.me),
        Route("/api/policy", api.policy),
        Route("/api/memory/audit", api.memory),
        Route("/api/metrics", api.metrics),
        Route("/api/runs/changes", api.changes),
        Route("/api/runs/{run_id}/events", api.events),
        Route("/api/runs", api.run_api),
        Route("/api/runs/{run_id}", api.run_api),
        Route("/api/runs/{run_id}/signals", api.run_api, methods=["GET", "POST"]),
        Route("/api/runs/{run_id}/operations", api.run_api),
        Route("/api/runs/{run_id}/debug-bundle", api.run_api),
        Route("/api/agents", api.agents),
        Route("/api/agents/{agent_id}", api.agents),
        Route("/api/mcp-servers", api.mcp_servers),
        Mount("/static", StaticFiles(directory=STATIC)),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_Guard, public_origin=_origin(settings.public_url))],
    )


async def _find_coordinator(registry: RegistryClient) -> str:
    """The coordinator's base URL, from its registered card (it starts before the console)."""
    for _ in range(100):
        for agent in await registry.agents():
            if agent.kind == "coordinator":
                return agent.card_url.split("/.well-known/", 1)[0]
        await asyncio.sleep(0.2)
    raise FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, "no coordinator is registered")


async def main(settings: ServiceSettings) -> None:
    configure_logging(settings.service_id, settings.log_level)
    await serve_app(build_app(settings), settings)
