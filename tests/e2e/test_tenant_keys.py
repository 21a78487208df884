"""The registry's tenant keys (``POST /v1/tenant-keys``) on a running stack, asked for as the services'
own identities would (their enrolled keys from the stack's data dir) and as an attacker holding one
of those keys would: a tenant's key goes only to a service that policy lets hold tenant keys, and only
against a valid access token of one of that tenant's callers, addressed to that service.

Every refusal test fails on the code before tenant keys (no such endpoint: a 404, not the refusal)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fleet.keys import SigningKey
from fleet.tenant_keys import TenantKey
from fleet.tokens import client_assertion
from fleetctl.testing.e2e import Stack
from tests.e2e.identities import Impostor

pytestmark = pytest.mark.e2e


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as client:
        yield client


async def service_token(
    http: httpx.AsyncClient, stack: Stack, identity: str, key: SigningKey | None = None
) -> str:
    """``identity``'s own registry token, got with its enrolled key (what a thief of that key gets)."""
    registry = stack.endpoints["registry"]
    key = key or SigningKey.load_or_create(stack.layout.key_file(identity))
    form = {
        "grant_type": "client_credentials",
        "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        "client_assertion": client_assertion(key, identity, registry + "/oauth/token"),
        "audience": "registry",
        "tenant": "default",
        "scope": "registry:read",
    }
    response = await http.post(registry + "/oauth/token", data=form)
    assert response.status_code == 200, response.text
    return str(response.json()["access_token"])


async def ask(
    http: httpx.AsyncClient, stack: Stack, service: str, body: dict[str, Any], token: str | None = None
) -> httpx.Response:
    token = token or await service_token(http, stack, service)
    return await http.post(
        stack.endpoints["registry"] + "/v1/tenant-keys",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
    )


def caller(stack: Stack, audience: str = "mcp-sandbox", tenant: str = "globex", **claims: Any) -> str:
    """An access token of a caller of ``tenant`` for ``audience`` (signed with the registry's key)."""
    return stack.forge(aud=audience, tenant=tenant, scope="sandbox:run", sub="sql-analyst", **claims)


def refused(response: httpx.Response, code: str, why: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == code and why in error["message"], error
    assert "key" not in response.json() or not isinstance(response.json().get("key"), str)


async def test_a_service_gets_the_key_of_its_caller_s_tenant(stack: Stack, http: httpx.AsyncClient) -> None:
    response = await ask(http, stack, "mcp-sandbox", {"caller_token": caller(stack), "tenant": "globex"})
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    key = TenantKey.from_json(response.json())
    assert key.tenant == "globex" and 0 < response.json()["expires_in"] <= 300
    # The same key again, for another caller of the tenant; another tenant's is another key.
    again = await ask(http, stack, "mcp-outbox", {"caller_token": caller(stack, "mcp-outbox")})
    assert TenantKey.from_json(again.json()) == key
    acme = await ask(http, stack, "mcp-sandbox", {"caller_token": caller(stack, tenant="acme")})
    assert TenantKey.from_json(acme.json()).secret != key.secret


async def test_a_token_of_another_tenant_is_refused(stack: Stack, http: httpx.AsyncClient) -> None:
    response = await ask(
        http, stack, "mcp-sandbox", {"caller_token": caller(stack, tenant="acme"), "tenant": "globex"}
    )
    refused(response, "tenant_key_refused", "for tenant 'acme', not 'globex'")


async def test_a_token_for_another_audience_is_refused(stack: Stack, http: httpx.AsyncClient) -> None:
    # A caller's token for the outbox does not open the tenant's key for the sandbox (nor the
    # coordinator's token for anyone but the coordinator).
    for audience in ("mcp-outbox", "coordinator"):
        response = await ask(http, stack, "mcp-sandbox", {"caller_token": caller(stack, audience)})
        refused(response, "tenant_key_refused", "the caller's token is refused")


async def test_an_expired_token_is_refused(stack: Stack, http: httpx.AsyncClient) -> None:
    now = int(time.time())
    expired = caller(stack, iat=now - 600, exp=now - 300)
    refused(await ask(http, stack, "mcp-sandbox", {"caller_token": expired}), "tenant_key_refused", "expired")


async def test_a_token_whose_client_key_was_revoked_is_refused(
    stack: Stack, http: httpx.AsyncClient, impostor: Impostor
) -> None:
    token = caller(stack, client_kid=impostor.key.kid)
    assert (await ask(http, stack, "mcp-sandbox", {"caller_token": token})).status_code == 200
    admin = stack.token("registry", "default", ("registry:admin",))
    revoked = await http.post(
        f"{impostor.registry}/v1/keys/{impostor.key.kid}/revoke",
        json={"reason": "test"},
        headers={"Authorization": f"Bearer {admin}"},
    )
    assert revoked.status_code == 200, revoked.text
    refused(await ask(http, stack, "mcp-sandbox", {"caller_token": token}), "tenant_key_refused", "revoked")


async def test_no_token_a_forged_one_or_a_grant_is_refused(stack: Stack, http: httpx.AsyncClient) -> None:
    refused(await ask(http, stack, "mcp-sandbox", {}), "tenant_key_refused", "caller's token")
    forged = SigningKey.generate().sign({"iss": "fleet-registry", "aud": "mcp-sandbox", "tenant": "globex"})
    refused(await ask(http, stack, "mcp-sandbox", {"caller_token": forged}), "tenant_key_refused", "refused")
    grant = caller(stack, token_use="run_grant", run_id="r")
    refused(await ask(http, stack, "mcp-sandbox", {"caller_token": grant}), "tenant_key_refused", "refused")


async def test_a_token_for_every_tenant_is_refused(stack: Stack, http: httpx.AsyncClient) -> None:
    response = await ask(http, stack, "mcp-sandbox", {"caller_token": caller(stack, tenant="*")})
    refused(response, "tenant_key_refused", "no one tenant")


async def test_a_service_policy_keeps_from_tenant_keys_gets_none(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    # An MCP server that keeps no artifacts, with a good token of its own caller.
    response = await ask(http, stack, "mcp-sql", {"caller_token": caller(stack, "mcp-sql")})
    refused(response, "policy_denied", "mcp-sql (mcp_server) does not keep artifacts")
    # A worker, with a caller's token addressed to it.
    response = await ask(http, stack, "worker-1", {"caller_token": caller(stack, "worker-1")})
    refused(response, "policy_denied", "only MCP servers hold tenant keys")


async def test_without_the_service_s_own_token_nothing_is_given(
    stack: Stack, http: httpx.AsyncClient
) -> None:
    registry = stack.endpoints["registry"] + "/v1/tenant-keys"
    response = await http.post(registry, json={"caller_token": caller(stack)})
    assert response.status_code == 401, response.text
    # The caller's token itself is not a service's registry token.
    response = await http.post(
        registry,
        json={"caller_token": caller(stack)},
        headers={"Authorization": f"Bearer {caller(stack)}"},
    )
    assert response.status_code == 401, response.text


async def test_a_delegated_registry_token_is_refused(stack: Stack, http: httpx.AsyncClient) -> None:
    delegated = stack.forge(
        aud="registry", tenant="default", scope="registry:read", sub="operator", act={"sub": "mcp-sandbox"},
        jti=uuid.uuid4().hex,
    )  # fmt: skip
    response = await ask(http, stack, "mcp-sandbox", {"caller_token": caller(stack)}, token=delegated)
    refused(response, "tenant_key_refused", "own name")
