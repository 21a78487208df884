"""Forgeries through the bus (security review C1): whoever can write the registry's NATS buckets
(here: anyone, the stack's NATS has no authentication) writes keys, revocations and records there
directly. None of it is believed: the registry's keys need the operator's certificate, revocations
and records the registry's signature. Each test writes what an attacker would, against the running
stack, and puts back what it replaced (the stack is shared)."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jwt
import pytest
from nats.js.kv import KeyValue

from fleet.issuer_certs import certify_issuer_key, with_cert
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.tokens import client_assertion
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import Stack, token_claims
from fleetctl.testing.mcp import logged

pytestmark = pytest.mark.e2e

RECORDS, REVOCATIONS = "fleet-registry", "fleet-revocations"


@contextlib.asynccontextmanager
async def bucket(stack: Stack, name: str) -> AsyncIterator[KeyValue]:
    # As the bus's bootstrap admin, the one identity that may still write these buckets: a
    # compromised admin's writes are what is not believed here.
    client = await connect(stack.endpoints["nats"], "forger", credentials=stack_admin(stack.endpoints))
    try:
        yield await client.jetstream().key_value(name)
    finally:
        await client.drain()


@contextlib.asynccontextmanager
async def replaced(stack: Stack, key: str, change: Any) -> AsyncIterator[None]:
    """The record ``key`` of the registry's bucket as ``change`` makes it (written as plain JSON,
    as an attacker can), and the genuine one back afterwards."""
    async with bucket(stack, RECORDS) as records:
        genuine = (await records.get(key)).value
        assert genuine is not None
        forged = change(_record_of(genuine))
        await records.put(key, json.dumps(forged).encode())
        try:
            yield
        finally:
            await records.put(key, genuine)


def _record_of(value: bytes) -> dict[str, Any]:
    """What a stored record says (a signed one's payload, read without verifying it)."""
    stored = json.loads(value)
    if "sealed" not in stored:  # a plain record
        return dict(stored)
    payload: dict[str, Any] = jwt.decode(stored["sealed"], options={"verify_signature": False})
    return dict(payload["record"])


async def get(stack: Stack, service: str, path: str, token: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.get(stack.endpoints[service] + path, headers=headers)


async def registry_kid(stack: Stack) -> str:
    """The key id the registry signs tokens with now."""
    return str(jwt.get_unverified_header(stack.token("coordinator"))["kid"])


async def test_a_key_added_to_the_registrys_record_signs_no_token_the_fleet_accepts(stack: Stack) -> None:
    evil = SigningKey.generate()
    self_certified = with_cert(
        evil.public_jwk(), certify_issuer_key(evil, "fleet-registry", evil.public_jwk())
    )

    def add_key(record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "keys": {**record["keys"], evil.kid: self_certified}}

    async with replaced(stack, "identity.registry", add_key):
        forged = {"scope": "agent:invoke runs:approve", "tenant": "globex"}
        coordinator = await get(stack, "coordinator", "/v1/runs", evil.sign(token_claims(**forged)))
        registry_token = evil.sign(token_claims(aud="registry", scope="registry:read"))
        registry = await get(stack, "registry", "/v1/agents", registry_token)
        jwks = await get(stack, "registry", "/.well-known/jwks.json", "")
    assert coordinator.status_code == 401, coordinator.text
    assert registry.status_code == 401, registry.text
    assert evil.kid not in {key["kid"] for key in jwks.json()["keys"]}
    await logged(stack, "registry", "ignoring the registry record identity.registry")
    assert (await get(stack, "coordinator", "/v1/runs", stack.token("coordinator"))).status_code == 200


async def test_a_forged_unsigned_revocation_of_the_registrys_key_changes_nothing_and_is_reported(
    stack: Stack,
) -> None:
    kid = await registry_kid(stack)
    forged = {"kid": kid, "identity": "registry", "revoked_at": time.time(), "by": "operator", "reason": "x"}
    async with bucket(stack, REVOCATIONS) as revocations:
        await revocations.put(f"kid.{kid}", json.dumps(forged).encode())
        try:
            for service in ("coordinator", "registry", "mcp-sql"):
                await logged(stack, service, "ignoring a revocation entry", kid)
            assert (
                await get(stack, "coordinator", "/v1/runs", stack.token("coordinator"))
            ).status_code == 200
            token = stack.token("registry", scopes=("registry:read",))
            assert (await get(stack, "registry", "/v1/agents", token)).status_code == 200
        finally:
            await revocations.delete(f"kid.{kid}")


async def test_a_revocation_signed_by_a_key_the_operator_did_not_certify_is_ignored(stack: Stack) -> None:
    operator_kid = SigningKey.load_or_create(stack.layout.key_file("operator")).kid  # the tokens' client
    foreign_operator, foreign = SigningKey.generate(), SigningKey.generate()
    signed = foreign.sign(
        {"iss": "fleet-registry", "kid": operator_kid, "identity": "operator", "revoked_at": 0, "by": "x"},
        typ="revocation+jwt",
    )
    entry = {
        "schema_version": 2,
        "revocation": signed,
        "issuer_cert": certify_issuer_key(foreign_operator, "fleet-registry", foreign.public_jwk()),
    }
    async with bucket(stack, REVOCATIONS) as revocations:
        await revocations.put(f"kid.{operator_kid}", json.dumps(entry).encode())
        try:
            await logged(stack, "coordinator", "ignoring a revocation entry", operator_kid)
            assert (
                await get(stack, "coordinator", "/v1/runs", stack.token("coordinator"))
            ).status_code == 200
        finally:
            await revocations.delete(f"kid.{operator_kid}")


async def test_a_forged_mcp_server_record_with_another_url_is_not_served(stack: Stack) -> None:
    evil_url = f"http://127.0.0.1:9/{uuid.uuid4().hex}/mcp"
    token = stack.token("registry", scopes=("registry:read",))
    async with replaced(stack, "mcp.mcp-sql", lambda record: {**record, "url": evil_url}):
        served = await get(stack, "registry", "/v1/mcp-servers/mcp-sql", token)
        listed = await get(stack, "registry", "/v1/mcp-servers", token)
    assert evil_url not in served.text and evil_url not in listed.text
    assert served.status_code == 404, served.text  # a record that does not verify is absent
    await logged(stack, "registry", "ignoring the registry record mcp.mcp-sql")
    assert (await get(stack, "registry", "/v1/mcp-servers/mcp-sql", token)).status_code == 200


async def test_a_key_added_to_an_identitys_record_gets_no_token(stack: Stack) -> None:
    evil = SigningKey.generate()
    registry = stack.endpoints["registry"]

    def add_key(record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "keys": {**record["keys"], evil.kid: evil.public_jwk()}}

    async with replaced(stack, "identity.stats", add_key), httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(
            registry + "/oauth/token",
            data={
                "grant_type": "client_credentials",
                "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                "client_assertion": client_assertion(evil, "stats", registry + "/oauth/token"),
                "audience": "registry",
                "tenant": "acme",
                "scope": "registry:read",
            },
        )
    assert answer.status_code == 401 and answer.json()["error"] == "invalid_client", answer.text
    await logged(stack, "registry", "ignoring the registry record identity.stats")
