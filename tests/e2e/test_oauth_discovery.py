"""A standard MCP client finds how to get a token from a fleet MCP server's 401, with no code of the
fleet's: RFC 9728 protected-resource metadata on the server (named by ``resource_metadata`` in its
``WWW-Authenticate``), RFC 8414 metadata on the registry, then the client-credentials grant with a
private_key_jwt assertion (RFC 7523) and the server named by ``resource`` (RFC 8707).

The client is the MCP SDK's own ``PrivateKeyJWTOAuthProvider`` with its ``SignedJWTParameters``
(no ``kid``, the registry's issuer URL as the audience, every scope the server lists asked for),
given only the server's URL, its client id and key, and which issuer it trusts. The one thing done
the fleet's way is what an operator does once: enrolling that client (its key, tenant and scopes).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import httpx2
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from mcp.client.auth import TokenStorage
from mcp.client.auth.extensions.client_credentials import PrivateKeyJWTOAuthProvider, SignedJWTParameters
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

from deploy.enrollment import enrollment_token
from deploy.local_stack import ServiceSpec
from fleet.keys import SigningKey
from fleetctl.testing.e2e import Stack

pytestmark = pytest.mark.e2e

ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"


class Memory(TokenStorage):
    """Where the SDK keeps what it was given (in memory, as its examples do)."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


async def enrolled_client(
    stack: Stack, http: httpx.AsyncClient, *, tenants: tuple[str, ...] = ("acme",)
) -> tuple[str, SigningKey]:
    """An outside client the operator enrolled (``external``: it calls in with tokens of its own, for
    its tenants): its id and key, for ``tenants``, allowed to query."""
    client_id = f"partner-{uuid.uuid4().hex[:8]}"
    key = SigningKey.generate()
    operator = SigningKey.load_or_create(stack.layout.key_file("operator"))
    spec = ServiceSpec(client_id, "specialist", "x:y", scopes=("sql:query",), tenants=tenants)
    body = {
        "id": client_id,
        "public_jwk": key.public_jwk(),
        "enrollment_token": enrollment_token(operator, spec, external=True),
    }
    answer = await http.post(stack.endpoints["registry"] + "/v1/enroll", json=body)
    assert answer.status_code == 201, answer.text
    return client_id, key


def pem(key: SigningKey) -> str:
    return key.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


async def test_a_standard_mcp_client_finds_the_token_endpoint_from_a_401_and_calls_a_tool(
    stack: Stack,
) -> None:
    url = stack.endpoints["mcp_servers"]["mcp-sql"]
    registry = stack.endpoints["registry"]
    async with httpx.AsyncClient(timeout=30) as http:
        client_id, key = await enrolled_client(stack, http)
    storage = Memory()
    provider = PrivateKeyJWTOAuthProvider(
        server_url=url,
        storage=storage,
        client_id=client_id,
        assertion_provider=SignedJWTParameters(
            issuer=client_id, subject=client_id, signing_key=pem(key), signing_algorithm="ES256"
        ).create_assertion_provider(),
        issuer=registry,
    )
    async with (
        httpx2.AsyncClient(auth=provider, timeout=30) as http2,
        Client(streamable_http_client(url, http_client=http2)) as client,
    ):
        result = await client.call_tool("query", {"sql": "SELECT count(*) AS n FROM tenant_data.invoices"})
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict) and result.structured_content["rows"], result
    # What it was given: a token of the fleet's for this server, in its tenant, with only the scope
    # its enrollment allows of the two the server lists (it asked for both).
    assert storage.tokens is not None and storage.tokens.scope == "sql:query"
    claims = jwt.decode(storage.tokens.access_token, options={"verify_signature": False})
    assert (claims["aud"], claims["tenant"], claims["sub"]) == ("mcp-sql", "acme", client_id)


async def test_the_401_names_the_metadata_that_names_the_registry(stack: Stack) -> None:
    url = stack.endpoints["mcp_servers"]["mcp-sql"]
    registry = stack.endpoints["registry"]
    async with httpx.AsyncClient(timeout=30) as http:
        refused = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert refused.status_code == 401
        challenge = refused.headers["WWW-Authenticate"]
        assert challenge.startswith("Bearer ") and 'error="invalid_token"' in challenge
        named = challenge.split('resource_metadata="', 1)[1].split('"', 1)[0]
        assert named == url.replace("/mcp", "/.well-known/oauth-protected-resource/mcp")
        resource = (await http.get(named)).json()
        assert resource["resource"] == url
        assert [s.rstrip("/") for s in resource["authorization_servers"]] == [registry]
        assert set(resource["scopes_supported"]) >= {"sql:query"} and resource[
            "bearer_methods_supported"
        ] == ["header"]
        server = (await http.get(registry + "/.well-known/oauth-authorization-server")).json()
        assert server["issuer"] == registry and server["token_endpoint"] == registry + "/oauth/token"
        assert server["token_endpoint_auth_methods_supported"] == ["private_key_jwt"]
        assert "client_credentials" in server["grant_types_supported"]
        authorize = await http.get(server["authorization_endpoint"], params={"response_type": "code"})
        assert (authorize.status_code, authorize.json()["error"]) == (400, "unsupported_response_type")


def assertion(client_id: str, key: SigningKey, audience: str, **header: Any) -> str:
    now = int(time.time())
    claims = {"iss": client_id, "sub": client_id, "aud": audience, "iat": now, "exp": now + 60}
    return jwt.encode(
        {**claims, "jti": uuid.uuid4().hex}, pem(key), algorithm="ES256", headers=header or None
    )


async def test_what_the_standard_path_does_not_let_through(stack: Stack) -> None:
    """An assertion for another server, a resource that is no MCP server of the fleet, a client of
    several tenants that names none, a resource and an audience that disagree, scopes none of
    which the client holds, and an assertion naming no key from a client that holds two: each
    refused with its OAuth error."""
    registry = stack.endpoints["registry"]
    url = stack.endpoints["mcp_servers"]["mcp-sql"]
    async with httpx.AsyncClient(timeout=30) as http:
        one, one_key = await enrolled_client(stack, http)
        many, many_key = await enrolled_client(stack, http, tenants=("acme", "globex"))

        async def ask(client_id: str, key: SigningKey, aud: str = registry, **form: str) -> httpx.Response:
            fields = {
                "grant_type": "client_credentials",
                "client_assertion_type": ASSERTION_TYPE,
                "client_assertion": assertion(client_id, key, aud),
                **form,
            }
            return await http.post(registry + "/oauth/token", data=fields)

        def error(answer: httpx.Response) -> tuple[int, str]:
            return answer.status_code, answer.json()["error"]

        granted = await ask(one, one_key, resource=url, scope="sql:query")
        assert granted.status_code == 200, granted.text
        assert error(await ask(one, one_key, "https://elsewhere.example", resource=url)) == (
            401,
            "invalid_client",
        )
        assert error(await ask(one, one_key, resource=registry + "/mcp")) == (400, "invalid_target")
        assert error(await ask(one, one_key, resource=url, audience="mcp-cases")) == (400, "invalid_target")
        assert error(await ask(many, many_key, resource=url, scope="sql:query")) == (400, "invalid_request")
        assert error(await ask(one, one_key, resource=url, scope="cases:write")) == (400, "invalid_scope")
        # The fleet's own way (the audience named) is as strict as it was: nothing beyond the enrollment.
        assert error(
            await ask(one, one_key, audience="mcp-sql", tenant="acme", scope="sql:query sql:write")
        ) == (
            400,
            "invalid_scope",
        )
        # A client holding two keys (a rotation's grace) must name the one it signs with.
        fresh = SigningKey.generate()
        rotate = f"{registry}/v1/identities/{one}/keys"
        now = int(time.time())
        proof = one_key.sign(
            {"iss": one, "sub": one, "aud": rotate, "iat": now, "exp": now + 60, "jti": uuid.uuid4().hex,
             "new_kid": fresh.kid}
        )  # fmt: skip
        rotated = await http.post(rotate, json={"public_jwk": fresh.public_jwk(), "proof": proof})
        assert rotated.status_code == 200, rotated.text
        assert error(await ask(one, fresh, resource=url, scope="sql:query")) == (401, "invalid_client")
        named = await http.post(
            registry + "/oauth/token",
            data={
                "grant_type": "client_credentials",
                "client_assertion_type": ASSERTION_TYPE,
                "client_assertion": assertion(one, fresh, registry, kid=fresh.kid),
                "resource": url,
                "scope": "sql:query",
            },
        )
        assert named.status_code == 200, named.text


async def test_a_request_addressed_to_another_name_is_refused_by_the_rebinding_check(stack: Stack) -> None:
    # The MCP SDK's DNS-rebinding check stays on: a server admits requests addressed to its public
    # name (here the local stack's loopback URL; deployed, its service name: the hosts test) and no
    # other, so a page on another site whose name resolves here cannot reach it through a browser.
    url = stack.endpoints["mcp_servers"]["mcp-sql"]
    token = stack.token("mcp-sql", scopes=("sql:query",))
    request = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(timeout=30) as http:
        rebound = await http.post(url, json=request, headers={**headers, "Host": "attacker.example:80"})
        assert rebound.status_code == 421
        foreign = await http.post(
            url, json=request, headers={**headers, "Origin": "https://attacker.example"}
        )
        assert foreign.status_code == 403
        addressed = await http.post(url, json=request, headers=headers)
        assert addressed.status_code == 200, addressed.text
