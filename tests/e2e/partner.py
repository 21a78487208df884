"""A partner organisation's agent, run by the test beside the fleet: its own authorization server and
an A2A agent that accepts only that server's tokens. The partner trusts the fleet's identities: its
authorization server authenticates a client's ``private_key_jwt`` assertion against the keys the
fleet's registry publishes for that identity. The fleet enrolled the agent as external and knows
nothing else of it: the worker finds where to get a token in the agent's card.

Everything the partner receives is recorded, so a test can say what left the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import jwt
import uvicorn
from a2a.helpers import get_data_parts, new_data_part, new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentSkill
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from fleet.a2a_support import RPC_PATH, a2a_app, build_card, sign_card
from fleet.errors import AuthError
from fleet.keys import SigningKey, public_key_from_jwk
from fleet.service import Readiness
from fleet.tokens import Claims, client_assertion
from fleetctl.testing.e2e import Stack, fleet

SKILL = "fraud-score"
SCOPE = "partner:score"


@dataclass
class PartnerRecord:
    """What reached the partner."""

    assertions: list[dict[str, Any]] = field(default_factory=list)  # client assertions it accepted
    tokens: list[dict[str, Any]] = field(default_factory=list)  # access tokens its agent accepted
    inputs: list[dict[str, Any]] = field(default_factory=list)  # the inputs of the steps it ran
    registration: tuple[int, dict[str, Any]] = (0, {})  # the registry's answer to its registration


class _PartnerVerifier:
    """The partner agent's check: a token of the partner's own authorization server, for it."""

    def __init__(self, key: SigningKey, issuer: str, audience: str, record: PartnerRecord) -> None:
        self._key, self._issuer, self._audience, self._record = key, issuer, audience, record

    async def verify(self, token: str, *, required_scopes: Any = ()) -> Claims:
        try:
            raw = jwt.decode(
                token, self._key.private_key.public_key(), algorithms=["ES256"], audience=self._audience,
                issuer=self._issuer,
            )  # fmt: skip
        except jwt.PyJWTError as exc:
            raise AuthError(f"not a partner token: {type(exc).__name__}") from exc
        self._record.tokens.append(raw)
        return Claims(
            raw["sub"],
            raw["tenant"],
            self._audience,
            frozenset(raw["scope"].split()),
            raw["jti"],
            raw["exp"],
            raw,
        )


class _FraudScore(AgentExecutor):
    def __init__(self, record: PartnerRecord) -> None:
        self._record = record

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        data = [d for d in get_data_parts(context.message.parts) if isinstance(d, dict)]
        given = data[0].get("input", {}) if data else {}
        self._record.inputs.append(given)
        task = context.current_task or new_task_from_user_message(context.message)
        await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        # A query for the fleet to run next: what a careless plan would act on.
        answer = {"score": 0.91, "query": "SELECT count(*) FROM tenant_data.invoices"}
        await updater.add_artifact([new_data_part(answer)], name=SKILL, last_chunk=True)
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


async def _authorization_server(
    request: Request, stack: Stack, key: SigningKey, issuer: str, token_url: str, record: PartnerRecord
) -> JSONResponse:
    form = await request.form()
    assertion = str(form.get("client_assertion", ""))
    client = str(jwt.decode(assertion, options={"verify_signature": False}).get("sub", ""))
    async with httpx.AsyncClient() as http:  # the keys the fleet's registry publishes for it
        keys = (await http.get(f"{stack.endpoints['registry']}/v1/agents/{client}/jwks.json")).json()
    kid = jwt.get_unverified_header(assertion).get("kid")
    jwk = next((k for k in keys.get("keys", []) if k["kid"] == kid), None)
    if jwk is None:
        return JSONResponse({"error": "invalid_client"}, status_code=401)
    try:
        claims = jwt.decode(assertion, public_key_from_jwk(jwk), algorithms=["ES256"], audience=token_url)
    except jwt.PyJWTError:
        return JSONResponse({"error": "invalid_client"}, status_code=401)
    record.assertions.append(
        {**claims, "form": {k: str(v) for k, v in form.items() if k != "client_assertion"}}
    )
    now = int(time.time())
    token = key.sign({
        "iss": issuer, "sub": client, "aud": str(form.get("resource", "")), "tenant": "partner",
        "scope": str(form.get("scope", "")), "iat": now, "exp": now + 300, "jti": uuid.uuid4().hex,
    })  # fmt: skip
    return JSONResponse({"access_token": token, "token_type": "Bearer", "expires_in": 300})


@contextlib.asynccontextmanager
async def partner_agent(
    stack: Stack,
    agent_id: str | None = None,
    *,
    skills: Sequence[str] = (SKILL,),
    enrolled_for: Sequence[str] | None = None,
    must_register: bool = True,
) -> AsyncIterator[tuple[str, PartnerRecord]]:
    """The partner's agent (``agent_id``, or a new id), enrolled as external for the skills
    ``enrolled_for`` (default: ``skills``), serving a card that offers ``skills``, and registered
    with the fleet's registry; yields its id and the record of what reached it. Unless
    ``must_register``, a refused registration is only recorded (``PartnerRecord.registration``)."""
    agent_id = agent_id or f"partner-{uuid.uuid4().hex[:6]}"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    token_url, issuer = base + "/partner-as/token", base + "/partner-as"
    key, record = SigningKey.generate(), PartnerRecord()
    card = build_card(
        name="Partner fraud check",
        description="Scores invoices for fraud (run by a partner)",
        version="1",
        base_url=base,
        skills=[
            AgentSkill(id=skill, name=skill, description="score an invoice", tags=["fraud"])
            for skill in skills
        ],
        token_url=token_url,
        required_scope=SCOPE,
    )
    card = sign_card(card, key, jku=f"{stack.endpoints['registry']}/v1/agents/{agent_id}/jwks.json")
    handler = DefaultRequestHandler(
        agent_executor=_FraudScore(record), task_store=InMemoryTaskStore(), agent_card=card
    )

    async def token_endpoint(request: Request) -> JSONResponse:
        return await _authorization_server(request, stack, key, issuer, token_url, record)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield

    readiness = Readiness(agent_id, "specialist")
    readiness.set_ready()
    agent = a2a_app(
        card=card,
        handler=handler,
        readiness=readiness,
        verifier=_PartnerVerifier(key, issuer, base + RPC_PATH, record),  # the resource: its A2A endpoint
        required_scope=SCOPE,
        lifespan=lifespan,
    )
    app = Starlette(
        routes=[Route("/partner-as/token", token_endpoint, methods=["POST"]), Mount("/", app=agent)]
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        # The operator hands the partner a one-time enrollment token, as an operator would.
        offers = skills if enrolled_for is None else enrolled_for
        issued = fleet(
            "keys", "enrollment-token", agent_id, "--data-dir", stack.data_dir,
            "--scope", "registry:write", "--tenant", "*", "--external",
            *[arg for skill in offers for arg in ("--skill", skill)], timeout=60,
        )  # fmt: skip
        assert issued.returncode == 0, issued.stderr
        registry = stack.endpoints["registry"]
        async with httpx.AsyncClient() as http:
            enrolled = await http.post(registry + "/v1/enroll", json={
                "id": agent_id, "public_jwk": key.public_jwk(), "enrollment_token": issued.stdout.strip(),
            })  # fmt: skip
            assert enrolled.status_code == 201, enrolled.text
            form = {
                "grant_type": "client_credentials",
                "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                "client_assertion": client_assertion(key, agent_id, registry + "/oauth/token"),
                "audience": "registry", "tenant": "acme", "scope": "registry:write",
            }  # fmt: skip
            write = (await http.post(registry + "/oauth/token", data=form)).json()["access_token"]
            registered = await http.put(
                f"{registry}/v1/agents/{agent_id}",
                json={"url": base},
                headers={"Authorization": f"Bearer {write}"},
            )
            record.registration = (registered.status_code, registered.json())
            if must_register:
                assert registered.status_code == 200, registered.text
                assert registered.json()["external"] is True
        yield agent_id, record
    finally:
        server.should_exit = True
        await task
