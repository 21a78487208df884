"""The SQL MCP server's token gate and the registry's enrollment, token service and card checks."""

from __future__ import annotations

import time
from typing import Any

import httpx
import httpx2
import jwt
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from fleet.keys import SigningKey
from fleet.tokens import client_assertion
from fleetctl.testing.e2e import Stack
from fleetctl.testing.mcp import error_in
from tests.e2e.identities import Impostor, serve_card

pytestmark = pytest.mark.e2e

MCP_LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}


async def post_mcp(stack: Stack, token: str | None) -> httpx.Response:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with httpx.AsyncClient() as http:
        return await http.post(stack.endpoints["mcp_servers"]["mcp-sql"], json=MCP_LIST, headers=headers)


@pytest.mark.parametrize("case", ["missing", "expired", "wrong_audience", "foreign_signer"])
async def test_mcp_server_rejects_bad_tokens_with_401(stack: Stack, case: str) -> None:
    token = {
        "missing": None,
        "expired": stack.forge(aud="mcp-sql", iat=1_700_000_000, exp=1_700_000_300),
        "wrong_audience": stack.forge(aud="coordinator", scope="sql:query"),
        "foreign_signer": SigningKey.generate().sign({"aud": "mcp-sql", "tenant": "acme"}),
    }[case]
    response = await post_mcp(stack, token)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")


async def call_query(stack: Stack, token: str, sql: str) -> Any:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        url = stack.endpoints["mcp_servers"]["mcp-sql"]
        async with Client(streamable_http_client(url, http_client=http)) as client:
            return await client.call_tool("query", {"sql": sql})


async def test_mcp_query_sees_only_the_token_tenant_even_when_sql_sets_another(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="globex", scopes=("sql:query",))
    hostile = "SELECT DISTINCT tenant_id FROM tenant_data.invoices WHERE tenant_id IN ('acme', 'globex')"
    result = await call_query(stack, token, hostile)
    assert not result.is_error
    assert result.structured_content["rows"] == [["globex"]]


async def test_mcp_query_cannot_escalate_to_another_role(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="globex", scopes=("sql:query",))
    for statement in ("SELECT set_config('role', 'postgres', true)", "SET ROLE postgres"):
        result = await call_query(stack, token, statement)
        error = error_in(result)
        assert (
            error.code == "sql_refused" and "the statement uses function set_config" in error.message
        ) or (
            error.code == "invalid_request" and error.message.startswith("the database refused the statement")
        ), error
    after = await call_query(stack, token, "SELECT current_user AS u")
    assert after.structured_content["rows"] != [["postgres"]]


async def test_mcp_call_without_the_tool_scope_is_denied_by_policy(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=())
    result = await call_query(stack, token, "SELECT 1")
    error = error_in(result)
    assert error.code == "policy_denied" and "the token lacks scope sql:query" in error.message
    assert error.details["decision_id"] and not error.retryable


# ----------------------------------------------------------------------------- registry
async def test_card_signed_by_a_key_that_is_not_enrolled_is_refused(impostor: Impostor) -> None:
    async with httpx.AsyncClient() as http, serve_card(SigningKey.generate()) as url:
        response = await impostor.register(http, url)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "card_invalid"
    assert "signature does not verify" in response.json()["error"]["message"]


async def test_card_signed_by_the_enrolled_key_is_accepted_and_discoverable(impostor: Impostor) -> None:
    async with httpx.AsyncClient() as http, serve_card(impostor.key) as url:
        response = await impostor.register(http, url)
        assert response.status_code == 200, response.text
        token = impostor.stack.token("registry", scopes=("registry:read",))
        found = await http.get(
            impostor.registry + "/v1/agents",
            params={"skill": "impersonate"},
            headers={"Authorization": f"Bearer {token}"},
        )
    agents = found.json()["agents"]  # other tests' impostors offer the skill too
    assert impostor.id in [a["id"] for a in agents]
    assert all("impersonate" in [s["id"] for s in a["skills"]] for a in agents)


async def test_card_that_names_another_host_is_refused(impostor: Impostor) -> None:
    async with (
        httpx.AsyncClient() as http,
        serve_card(impostor.key, host_in_card="http://evil.example") as url,
    ):
        response = await impostor.register(http, url)
    assert response.status_code == 400
    assert "not on the registered host" in response.json()["error"]["message"]


async def test_enrollment_token_works_once(stack: Stack) -> None:
    identity = Impostor(stack)
    token = identity.enrollment_token()
    async with httpx.AsyncClient() as http:
        assert (await identity.enroll(http, token)).status_code == 201
        again = await identity.enroll(http, token)
    assert again.status_code == 401
    assert again.json()["error"]["message"] == "enrollment token was already used"


async def test_client_assertion_cannot_be_replayed(impostor: Impostor) -> None:
    assertion = client_assertion(impostor.key, impostor.id, impostor.registry + "/oauth/token")
    async with httpx.AsyncClient() as http:
        first = await impostor.request_token(http, assertion=assertion)
        second = await impostor.request_token(http, assertion=assertion)
    assert first.status_code == 200
    assert second.status_code == 401
    assert second.json()["error"] == "invalid_client"


async def test_scope_outside_the_enrollment_is_refused(impostor: Impostor) -> None:
    async with httpx.AsyncClient() as http:
        response = await impostor.request_token(http, scope="sql:query")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_scope"


async def test_access_tokens_are_short_lived_and_bound_to_one_audience_and_tenant(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="globex", scopes=("sql:query",))
    async with httpx.AsyncClient() as http:
        jwks = (await http.get(stack.endpoints["registry"] + "/.well-known/jwks.json")).json()
    key = jwt.PyJWK(jwks["keys"][0], algorithm="ES256")
    claims = jwt.decode(token, key, algorithms=["ES256"], audience="mcp-sql")
    assert claims["aud"] == "mcp-sql"
    assert claims["tenant"] == "globex"
    assert claims["scope"] == "sql:query"
    assert claims["exp"] - claims["iat"] <= 300
    assert claims["exp"] > time.time()


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1; COMMIT; DELETE FROM tenant_data.invoices",
        "SET statement_timeout = 0",
        "DELETE FROM tenant_data.invoices",
        "WITH gone AS (DELETE FROM tenant_data.invoices RETURNING 1) SELECT * FROM gone",
        "CREATE TEMP TABLE invoices (x int)",
    ],
)
async def test_mcp_query_refuses_anything_but_one_select(stack: Stack, statement: str) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    result = await call_query(stack, token, statement)
    error = error_in(result)
    assert error.code == "invalid_request" and error.message.startswith("the database refused the ")
    after = await call_query(stack, token, "SELECT count(*) AS n FROM tenant_data.invoices")
    assert after.structured_content["rows"] == [[7]]


async def test_mcp_session_state_set_by_one_call_does_not_reach_the_next(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    for _ in range(12):  # more calls than the pool has connections
        result = await call_query(stack, token, "SELECT set_config('search_path', 'pg_catalog', false)")
        error = error_in(result)  # refused by the tool's allow-list before it runs
        assert error.code == "sql_refused" and "the statement uses function set_config" in error.message
    after = await call_query(stack, token, "SELECT current_setting('search_path') AS p")
    assert after.structured_content["rows"] == [['"$user", public']]


async def test_mcp_query_returns_at_most_the_row_limit(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    result = await call_query(stack, token, "SELECT g FROM generate_series(1, 100000) AS g")
    assert result.structured_content["row_count"] == 500
    assert result.structured_content["truncated"] is True


async def test_client_assertion_for_another_token_endpoint_is_refused(impostor: Impostor) -> None:
    lookalike = client_assertion(impostor.key, impostor.id, "http://lookalike.example/oauth/token")
    async with httpx.AsyncClient() as http:
        response = await impostor.request_token(http, assertion=lookalike)
    assert response.status_code == 401
    assert (
        response.json()["error_description"]
        == "client assertion rejected: token is not meant for this service"
    )


async def test_enrollment_publishes_only_the_public_key_under_its_thumbprint(stack: Stack) -> None:
    identity = Impostor(stack)
    leaky = {**identity.key.public_jwk(), "kid": "chosen-by-caller", "d": "c2VjcmV0"}
    body = {"id": identity.id, "public_jwk": leaky, "enrollment_token": identity.enrollment_token()}
    async with httpx.AsyncClient() as http:
        assert (await http.post(identity.registry + "/v1/enroll", json=body)).status_code == 201
        published = (await http.get(f"{identity.registry}/v1/agents/{identity.id}/jwks.json")).json()
    assert published["keys"] == [identity.key.public_jwk()]


async def test_enrollment_with_an_unusable_key_keeps_the_token_usable(stack: Stack) -> None:
    identity = Impostor(stack)
    token = identity.enrollment_token()
    broken = {"kty": "EC", "crv": "P-256", "x": "AAAA", "y": "AAAA"}
    async with httpx.AsyncClient() as http:
        refused = await http.post(
            identity.registry + "/v1/enroll",
            json={"id": identity.id, "public_jwk": broken, "enrollment_token": token},
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_request"
        assert (await identity.enroll(http, token)).status_code == 201
