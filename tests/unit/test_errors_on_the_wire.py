"""Every error kind crosses every wire as data: a FleetError raised by a real MCP server (over
Streamable HTTP), a real A2A agent (JSON-RPC, behind the fleet's bearer check) and a real HTTP API
(problem details) reads back on the other side with the same code, retryability, retry-after,
details and cause, and no code is ever written into a message."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2
import pytest
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.helpers import new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCard, Message, Role, SendMessageRequest
from a2a.utils.errors import A2AError, InternalError
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf.json_format import ParseDict
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, TextContent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleet.a2a_support import RPC_PATH, a2a_app, a2a_error, build_card, error_of_a2a
from fleet.errors import PROBLEM_MEDIA_TYPE, ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.mcp_errors import error_of
from fleet.service import always_ready, problem_response
from fleet.tokens import TokenVerifier
from fleetctl.cli_common import error_of as cli_error_of
from fleetctl.testing.serving import loopback_socket, serving
from mcp_servers._base import TracedMCPServer
from registry.client import _raise_for

ISSUER = "fleet-registry"
CODES = list(ErrorCode)


def sent(code: ErrorCode, retryable: bool) -> FleetError:
    """The error a far side raises for ``code``: with details, a retry-after when retryable, and a
    cause, none of which the wire may lose."""
    return FleetError(
        code,
        f"refused (case {CODES.index(code)}, an error kind of its own)",
        retryable=retryable,
        retry_after_s=7 if retryable else None,
        details={"attempt": 3, "why": ["a", "b"]},
        cause=FleetError(ErrorCode.INVALID_REQUEST, "the layer below said no", details={"field": "x"}),
    )


def assert_same(read: FleetError, code: ErrorCode, retryable: bool) -> None:
    expected = sent(code, retryable)
    assert read.to_dict() == expected.to_dict()
    assert read.code is code and read.retryable is retryable
    assert str(code) not in read.message  # the code travels beside the message, never in it


# ------------------------------------------------------------------------------------------ MCP


def mcp_server() -> TracedMCPServer:
    mcp = TracedMCPServer("errors", "mcp-errors")

    @mcp.tool()
    async def fail(code: str, retryable: bool) -> dict[str, Any]:
        """Raises the error named."""
        raise sent(ErrorCode(code), retryable)

    @mcp.tool()
    async def crash() -> dict[str, Any]:
        """Raises something unplanned, with a secret in its text."""
        raise RuntimeError("password=hunter2 leaked in a traceback")

    return mcp


@contextlib.asynccontextmanager
async def mcp_session() -> AsyncIterator[Client]:
    mcp = mcp_server()
    app = mcp.streamable_http_app()
    async with (
        serving(app) as url,
        httpx2.AsyncClient(timeout=30) as http,
        Client(streamable_http_client(url + "/mcp", http_client=http)) as client,
    ):
        yield client


async def test_every_error_kind_reads_back_the_same_across_mcp() -> None:
    async with mcp_session() as client:
        for code in CODES:
            for retryable in (False, True):
                result = await client.call_tool("fail", {"code": str(code), "retryable": retryable})
                assert result.is_error
                error = error_of(result)
                assert error is not None
                assert_same(error, code, retryable)
                assert [getattr(part, "text", "") for part in result.content] == [error.message]


async def test_mcp_refusals_of_the_sdk_and_crashes_are_envelopes_too_and_a_crash_tells_nothing() -> None:
    async with mcp_session() as client:
        unknown = error_of(await client.call_tool("no_such_tool", {}))
        invalid = error_of(await client.call_tool("fail", {"code": 5}))  # fails the input schema
        crashed = await client.call_tool("crash", {})
    assert unknown is not None and unknown.code == ErrorCode.INVALID_REQUEST
    assert invalid is not None and invalid.code == ErrorCode.INVALID_REQUEST
    error = error_of(crashed)
    assert error is not None and error.code == ErrorCode.INTERNAL and not error.retryable
    assert "hunter2" not in crashed.model_dump_json()


def test_a_text_only_error_answer_of_a_foreign_mcp_server_reads_as_tool_failed() -> None:
    foreign = CallToolResult(content=[TextContent(type="text", text="upstream broke")], is_error=True)
    error = error_of(foreign)
    assert error is not None and (error.code, error.message) == (ErrorCode.TOOL_FAILED, "upstream broke")
    assert error_of(CallToolResult(content=[], structured_content={"x": 1})) is None


# ------------------------------------------------------------------------------------------ A2A


class Refusing(AgentExecutor):
    """Refuses every message with the error its text names (``code retryable``)."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        code, retryable = context.get_user_input().split()
        raise a2a_error(sent(ErrorCode(code), retryable == "1"))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise a2a_error(FleetError(ErrorCode.CONFLICT, "nothing to cancel"))


@pytest.fixture
def key() -> SigningKey:
    return SigningKey.generate()


def verifier_of(key: SigningKey) -> TokenVerifier:
    public = key.private_key.public_key()

    async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
        return public if kid == key.kid else None

    return TokenVerifier(lookup, issuer=ISSUER, audience="refuser")


def token(key: SigningKey) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "sub": "caller", "aud": "refuser", "tenant": "acme", "scope": "agent:invoke"}
    return key.sign({**claims, "iat": now, "exp": now + 300, "jti": uuid.uuid4().hex})


@contextlib.asynccontextmanager
async def refusing_agent(key: SigningKey) -> AsyncIterator[str]:
    bound = loopback_socket()
    async with serving(agent_app(key, bound[1]), bound=bound) as url:
        yield url


def agent_app(key: SigningKey, url: str, routes: list[Route] | None = None) -> Starlette:
    """An A2A agent served with the fleet's kit (bearer check on JSON-RPC and on ``/v1/``) whose
    executor refuses everything, and ``routes`` beside it."""
    card = build_card(
        name="refuser",
        description="refuses",
        version="1",
        base_url=url,
        skills=[],
        token_url=url + "/oauth/token",
        required_scope="agent:invoke",
        streaming=False,
    )
    return a2a_app(
        card=card,
        handler=DefaultRequestHandler(
            agent_executor=Refusing(), task_store=InMemoryTaskStore(), agent_card=card
        ),
        readiness=always_ready("refuser", "specialist"),
        verifier=verifier_of(key),
        required_scope="agent:invoke",
        lifespan=_no_lifespan,
        extra_routes=routes or [],
        protected_prefixes=(RPC_PATH, "/v1/"),
    )


@contextlib.asynccontextmanager
async def _no_lifespan(app: Starlette) -> AsyncIterator[None]:
    yield


async def test_every_error_kind_reads_back_the_same_across_a2a(key: SigningKey) -> None:
    async with refusing_agent(key) as url, httpx.AsyncClient(timeout=30) as http:
        card_json = (await http.get(url + "/.well-known/agent-card.json")).json()
        card = ParseDict(card_json, AgentCard(), ignore_unknown_fields=True)
        client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
        context = ClientCallContext(service_parameters={"Authorization": f"Bearer {token(key)}"})
        try:
            for code in CODES:
                for retryable in (False, True):
                    message = Message(
                        role=Role.ROLE_USER,
                        message_id=uuid.uuid4().hex,
                        parts=[new_text_part(f"{code} {int(retryable)}")],
                    )
                    with pytest.raises(A2AError) as caught:
                        async for _ in client.send_message(
                            SendMessageRequest(message=message), context=context
                        ):
                            pass
                    assert_same(error_of_a2a(caught.value), code, retryable)
        finally:
            await client.close()


def test_an_a2a_error_without_an_envelope_reads_as_the_fallback_with_its_message() -> None:
    error = error_of_a2a(InternalError(message="their own words"))
    assert (error.code, error.message) == (ErrorCode.SPECIALIST_FAILED, "their own words")


# ----------------------------------------------------------------------------------------- HTTP


async def fail(request: Request) -> JSONResponse:
    code, retryable = request.path_params["code"], request.query_params.get("retryable") == "1"
    return problem_response(sent(ErrorCode(code), retryable))


async def test_every_error_kind_reads_back_the_same_across_http_as_problem_details(key: SigningKey) -> None:
    bound = loopback_socket()
    app = agent_app(key, bound[1], [Route("/v1/fail/{code}", fail)])
    async with serving(app, bound=bound) as url, httpx.AsyncClient(timeout=30) as http:
        headers = {"Authorization": f"Bearer {token(key)}"}
        for code in CODES:
            for retryable in (False, True):
                answer = await http.get(
                    f"{url}/v1/fail/{code}", params={"retryable": int(retryable)}, headers=headers
                )
                expected = sent(code, retryable)
                assert answer.status_code == expected.http_status
                assert answer.headers["content-type"] == PROBLEM_MEDIA_TYPE
                body = answer.json()  # RFC 9457 members, the envelope as an extension
                assert (body["type"], body["status"], body["detail"]) == (
                    f"urn:agent-fleet:error:{code}",
                    expected.http_status,
                    expected.message,
                )
                assert answer.headers.get("retry-after") == ("7" if retryable else None)
                assert_same(FleetError.from_response(answer), code, retryable)
                assert_same(cli_error_of(answer), code, retryable)  # the CLI reads the same
                with pytest.raises(FleetError) as caught:  # and so does the registry's client
                    _raise_for(answer, "asking")
                # (a 503 dependency_unavailable from the registry is its store failing over: waited out)
                waited = code == ErrorCode.DEPENDENCY_UNAVAILABLE
                assert caught.value.code is code and caught.value.retryable is (retryable or waited)
                assert caught.value.message == f"asking: {expected.message}"
        # The bearer check refuses in the same shape.
        refused = await http.get(f"{url}/v1/fail/conflict")
    assert refused.status_code == 401 and refused.headers["content-type"] == PROBLEM_MEDIA_TYPE
    assert FleetError.from_response(refused).code == ErrorCode.UNAUTHENTICATED


def test_an_answer_that_is_not_a_fleet_service_s_reads_from_its_status() -> None:
    for status, code, retryable in (
        (502, ErrorCode.DEPENDENCY_UNAVAILABLE, True),
        (404, ErrorCode.NOT_FOUND, False),
        (429, ErrorCode.RATE_LIMITED, True),
        (500, ErrorCode.INTERNAL, False),
        (418, ErrorCode.INVALID_REQUEST, False),
    ):
        error = FleetError.from_response(httpx.Response(status, text="<html>proxy</html>"))
        assert (error.code, error.retryable) == (code, retryable)


# ------------------------------------------------------------------------------------- envelope


def test_an_envelope_from_elsewhere_is_bounded_and_an_unknown_code_is_kept_aside() -> None:
    deep: dict[str, Any] = {"code": "conflict", "message": "m"}
    for _ in range(20):
        deep = {"code": "tool_failed", "message": "x" * 10_000, "cause": deep, "details": {"k": "v" * 10_000}}
    error = FleetError.from_dict(deep)
    assert len(error.chain()) <= 5 and all(len(e.message) <= 4000 for e in error.chain())
    assert "k" not in error.details
    newer = FleetError.from_dict({"code": "a_code_of_a_newer_version", "message": "m", "retryable": True})
    assert (newer.code, newer.details["code"], newer.retryable) == (
        ErrorCode.INTERNAL,
        "a_code_of_a_newer_version",
        True,
    )
    assert FleetError.from_dict("not an envelope").code == ErrorCode.INTERNAL


def test_another_process_cannot_pass_itself_off_as_the_control_plane_failing_over() -> None:
    """A hostile agent or tool may send ``dependency_unavailable``: it reads back as that code, never
    as :class:`DependencyUnavailable`, which makes a worker stop and retry the run as it does when the
    fleet's own registry fails over."""
    sent_by_an_agent = {"code": "dependency_unavailable", "message": "try me again", "retryable": True}
    error = FleetError.from_dict(sent_by_an_agent)
    assert error.code == ErrorCode.DEPENDENCY_UNAVAILABLE and type(error) is FleetError
    assert type(FleetError.from_response(httpx.Response(503, json=error.problem()))) is FleetError
