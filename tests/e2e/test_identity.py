"""Identity and trust on the real stack: a security suite of refused tokens, assertions and cards
(each refused with the right status, and logged by the service that refused it), key rotation by an
identity, and revocation reaching other processes while the revoked key's tokens are still unexpired.

The registry's own key (rotation under load, revoking its old key) is tested on a stack of its own:
revoking a registry key refuses every token it signed, in every service."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from fleet.errors import FleetError
from fleet.issuer_certs import certify_issuer_key
from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleet.tokens import RUN_GRANT_TYPE, SESSION_GRANT_TYPE, TokenClient, client_assertion
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import (
    Stack,
    all_events,
    fleet,
    send,
    start_stack,
    stop_stack,
    token_claims,
    user_message,
)
from fleetctl.testing.mcp import call as call_mcp
from fleetctl.testing.mcp import logged
from mcp_servers._base import read_audit
from tests.e2e.identities import Impostor, PartnerIdp, card_server, serve_card, team_mcp_server

pytestmark = pytest.mark.e2e


async def runs_api(stack: Stack, token: str) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(
            stack.endpoints["coordinator"] + "/v1/runs", headers={"Authorization": f"Bearer {token}"}
        )


async def mcp_call(stack: Stack, server: str, token: str) -> httpx.Response:
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    async with httpx.AsyncClient() as http:
        return await http.post(stack.endpoints["mcp_servers"][server], json=body, headers=headers)


async def audited(
    stack: Stack, server: str, match: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
) -> dict[str, Any]:
    """The first audit event of ``server`` (stream ``FLEET_AUDIT``) that ``match`` accepts, waiting for
    it to be stored (within about 50 ms of its call)."""
    broker = await connect(stack.endpoints["nats"], "audit-reader", credentials=stack_admin(stack.endpoints))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            events = await read_audit(broker, server)
            for event in events:
                if match(event):
                    return event
            if time.monotonic() > deadline:
                raise AssertionError(f"{server} stored no such audit event; the last: {events[-3:]}")
            await asyncio.sleep(0.1)
    finally:
        await broker.close()


def _chain(event: dict[str, Any]) -> str:
    return ">".join(event["actors"])


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def unsigned(claims: dict[str, Any]) -> str:
    return f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."


def tampered(token: str, **changes: Any) -> str:
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return f"{header}.{_b64({**claims, **changes})}.{signature}"


def hs256_with_the_public_key(stack: Stack, claims: dict[str, Any]) -> str:
    """The classic confusion: the issuer's public key (PEM) used as an HMAC secret."""
    key = SigningKey.load_or_create(stack.layout.key_file("registry"))
    pem = key.private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = _b64({"alg": "HS256", "typ": "JWT", "kid": key.kid})
    body = _b64(claims)
    mac = hmac.new(pem, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


# Each case: the token (made with its own jti), the status, and the reason the coordinator logs.
FORGED: dict[str, tuple[Callable[[Stack, str], str], int, str]] = {
    "expired": (lambda s, j: s.forge(jti=j, iat=1_700_000_000, exp=1_700_000_300), 401, "token expired"),
    "not yet valid": (lambda s, j: s.forge(jti=j, nbf=int(time.time()) + 3600), 401, "token not valid yet"),
    "wrong audience": (lambda s, j: s.forge(jti=j, aud="mcp-sql"), 401, "not meant for this service"),
    "wrong issuer": (lambda s, j: s.forge(jti=j, iss="https://evil.example"), 401, "another issuer"),
    "alg none": (lambda s, j: unsigned(token_claims(jti=j)), 401, "algorithm not allowed"),
    "HS256 with the public key": (
        lambda s, j: hs256_with_the_public_key(s, token_claims(jti=j)),
        401,
        "algorithm not allowed",
    ),
    "unknown key id": (lambda s, j: SigningKey.generate().sign(token_claims(jti=j)), 401, "unknown key"),
    "tampered payload": (
        lambda s, j: tampered(s.forge(jti=j, tenant="acme"), tenant="globex"),
        401,
        "signature does not verify",
    ),
    "missing tenant": (lambda s, j: s.forge(jti=j, tenant=None), 401, "tenant"),
    "missing scope": (lambda s, j: s.forge(jti=j, scope=""), 403, "lacks scope agent:invoke"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
async def test_a_bad_token_is_refused_with_its_status_and_logged(stack: Stack, case: str) -> None:
    make, status, reason = FORGED[case]
    jti = uuid.uuid4().hex
    token = make(stack, jti)
    response = await runs_api(stack, token)
    assert response.status_code == status, response.text
    line = await logged(stack, "coordinator", "token refused", reason, jti)
    assert token not in line  # the log names the token, never holds it


async def test_a_token_for_one_mcp_server_is_refused_by_another_and_logged(stack: Stack) -> None:
    token = stack.token("mcp-sql", scopes=("sql:query",))
    assert (await mcp_call(stack, "mcp-sql", token)).status_code == 200
    refused = await mcp_call(stack, "mcp-cases", token)
    assert refused.status_code == 401
    jti = jwt.decode(token, options={"verify_signature": False})["jti"]
    await logged(stack, "mcp-cases", "token refused", "not meant for this service", jti)


async def test_scope_escalation_and_a_replayed_assertion_are_refused_at_the_token_service(
    stack: Stack, impostor: Impostor
) -> None:
    async with httpx.AsyncClient() as http:
        escalated = await impostor.request_token(http, scope="registry:write registry:admin")
        assert (escalated.status_code, escalated.json()["error"]) == (400, "invalid_scope")
        await logged(stack, "registry", "token request refused (invalid_scope", impostor.id)
        assertion = client_assertion(impostor.key, impostor.id, impostor.registry + "/oauth/token")
        assert (await impostor.request_token(http, assertion=assertion)).status_code == 200
        replayed = await impostor.request_token(http, assertion=assertion)
        assert (replayed.status_code, replayed.json()["error"]) == (401, "invalid_client")
        await logged(stack, "registry", "already used", impostor.id)


async def test_policy_grants_only_the_scopes_the_audience_acts_on_even_to_the_operator(stack: Stack) -> None:
    # The operator is enrolled for every scope; policy still gives a token only what its one
    # audience acts on (fleet.tokens), and says why not.
    async with httpx.AsyncClient() as http:
        operator = operator_token_client(stack.layout, stack.endpoints["registry"] + "/oauth/token", http)
        assert await operator.token("mcp-sql", "acme", ["sql:query"])
        with pytest.raises(FleetError) as refused:
            await operator.token("mcp-sql", "acme", ["sql:query", "cases:write"])
    assert refused.value.details["oauth_error"] == "invalid_scope"
    assert "cases:write is not one that mcp-sql (mcp_server) acts on" in refused.value.message
    await logged(stack, "registry", "token request refused (invalid_scope", "policy refuses", "'operator'")


async def test_a_forged_card_signature_is_refused_and_logged(stack: Stack, impostor: Impostor) -> None:
    async with httpx.AsyncClient() as http, serve_card(SigningKey.generate()) as url:
        response = await impostor.register(http, url)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "card_invalid"
    await logged(stack, "registry", f"/v1/agents/{impostor.id} refused (card_invalid)")


async def coordinator_token(
    impostor: Impostor, http: httpx.AsyncClient, key: SigningKey | None = None
) -> httpx.Response:
    """An access token for the impostor at the coordinator (its enrollment allows registry scopes only,
    so it asks for none: the coordinator then refuses it for lack of scope, after checking it)."""
    form = {
        "grant_type": "client_credentials",
        "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        "client_assertion": client_assertion(
            key or impostor.key, impostor.id, impostor.registry + "/oauth/token"
        ),
        "audience": "registry",
        "tenant": "acme",
        "scope": "registry:read",
    }
    return await http.post(impostor.registry + "/oauth/token", data=form)


async def test_an_identity_rotates_its_key_and_the_old_one_verifies_until_the_grace_ends(
    stack: Stack, impostor: Impostor
) -> None:
    new = SigningKey.generate()
    rotate_url = f"{impostor.registry}/v1/identities/{impostor.id}/keys"

    def proof(signer: SigningKey, names: SigningKey, jti: str | None = None) -> str:
        now = int(time.time())
        return signer.sign(
            {"iss": impostor.id, "sub": impostor.id, "aud": rotate_url, "iat": now, "exp": now + 60,
             "jti": jti or uuid.uuid4().hex, "new_kid": names.kid}
        )  # fmt: skip

    async with httpx.AsyncClient() as http:
        # A proof signed by a key the identity does not hold, or naming another key: refused.
        stranger = await http.post(
            rotate_url, json={"public_jwk": new.public_jwk(), "proof": proof(new, new)}
        )
        assert stranger.status_code == 401
        other = await http.post(
            rotate_url,
            json={"public_jwk": new.public_jwk(), "proof": proof(impostor.key, SigningKey.generate())},
        )
        assert other.status_code == 401
        good = proof(impostor.key, new)
        rotated = await http.post(rotate_url, json={"public_jwk": new.public_jwk(), "proof": good})
        assert rotated.status_code == 200, rotated.text
        assert set(rotated.json()["kids"]) == {impostor.key.kid, new.kid}
        assert list(rotated.json()["retiring"]) == [impostor.key.kid]
        again = await http.post(rotate_url, json={"public_jwk": new.public_jwk(), "proof": good})
        assert again.status_code == 401  # a proof is good once
        # The retiring key verifies what it signed, but cannot hand the identity to anyone (had it
        # leaked, the thief could not take over the identity its owner has just moved to a new key).
        third = SigningKey.generate()
        hijack = await http.post(
            rotate_url, json={"public_jwk": third.public_jwk(), "proof": proof(impostor.key, third)}
        )
        assert hijack.status_code == 401 and "current key" in hijack.text
        # Both keys authenticate during the grace: what the old one signed a moment ago still works.
        assert (await coordinator_token(impostor, http)).status_code == 200
        assert (await coordinator_token(impostor, http, new)).status_code == 200
        keys = (await http.get(f"{impostor.registry}/v1/agents/{impostor.id}/jwks.json")).json()["keys"]
        assert {k["kid"] for k in keys} == {impostor.key.kid, new.kid}


async def test_a_revoked_client_key_stops_its_unexpired_tokens_in_other_processes(
    stack: Stack, impostor: Impostor
) -> None:
    async with httpx.AsyncClient() as http:
        issued = await coordinator_token(impostor, http)
        token = issued.json()["access_token"]
        registry_api = f"{impostor.registry}/v1/agents"
        assert (await http.get(registry_api, headers={"Authorization": f"Bearer {token}"})).status_code == 200
        # The token also reaches the coordinator, which checks it (and refuses it only for its scope).
        before = await runs_api(stack, token)
        assert before.status_code == 401 and "not meant for this service" in before.text

        admin = stack.token("registry", scopes=("registry:admin", "registry:read"))
        revoked = await http.post(
            f"{impostor.registry}/v1/keys/{impostor.key.kid}/revoke",
            json={"reason": "key leaked"},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert revoked.status_code == 200, revoked.text
        assert revoked.json()["identity"] == impostor.id
        # The registry itself refuses the unexpired token, and a new assertion with the key.
        refused = await http.get(registry_api, headers={"Authorization": f"Bearer {token}"})
        assert refused.status_code == 401
        assert (await coordinator_token(impostor, http)).status_code == 401
        listed = await http.get(
            f"{impostor.registry}/v1/revocations", headers={"Authorization": f"Bearer {admin}"}
        )
        assert impostor.key.kid in {r["kid"] for r in listed.json()["revoked"]}
    jti = jwt.decode(token, options={"verify_signature": False})["jti"]
    await logged(stack, "registry", "token refused", "client whose key was revoked", jti)
    # Another process (the coordinator) learned it by itself: its log says the key was revoked.
    await logged(stack, "coordinator", impostor.key.kid, "revoked by operator")


async def test_only_an_operator_revokes_and_the_registry_key_in_use_cannot_be(
    stack: Stack, impostor: Impostor
) -> None:
    async with httpx.AsyncClient() as http:
        token = (await coordinator_token(impostor, http)).json()["access_token"]
        url = f"{impostor.registry}/v1/keys/{impostor.key.kid}/revoke"
        forbidden = await http.post(url, json={}, headers={"Authorization": f"Bearer {token}"})
        assert forbidden.status_code == 403
        admin = stack.token("registry", scopes=("registry:admin",))
        signing = SigningKey.load_or_create(stack.layout.key_file("registry")).kid
        in_use = await http.post(
            f"{impostor.registry}/v1/keys/{signing}/revoke",
            json={},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert in_use.status_code == 409
        unknown = await http.post(
            f"{impostor.registry}/v1/keys/no-such-key/revoke",
            json={},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert unknown.status_code == 404


# ------------------------------------------------------------------ the registry's own key
async def _hammer(stack: Stack, stop: asyncio.Event, outcomes: list[int]) -> None:
    """Call the coordinator and an MCP server with tokens fetched fresh every few calls (so tokens
    signed by the old key and by the new one are both in use around a rotation)."""
    async with httpx.AsyncClient(timeout=30) as http:
        token_url = stack.endpoints["registry"] + "/oauth/token"
        while not stop.is_set():
            operator = operator_token_client(stack.layout, token_url, http)  # a new one: no cached token
            coordinator = await operator.token("coordinator", "acme", ["agent:invoke"])
            mcp = await operator.token("mcp-sql", "acme", ["sql:query"])
            for _ in range(3):
                answers = await asyncio.gather(runs_api(stack, coordinator), mcp_call(stack, "mcp-sql", mcp))
                outcomes += [answer.status_code for answer in answers]


async def _until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the load did not reach its count"
        await asyncio.sleep(0.05)


async def test_rotating_the_registry_key_under_load_fails_no_call_and_revoking_the_old_one_stops_its_tokens(
    tmp_path: Path,
) -> None:
    stack = start_stack(tmp_path / "fleet")
    try:
        old_token = stack.token("coordinator")
        old_mcp_token = stack.token("mcp-sql", scopes=("sql:query",))
        # `stack.token` runs the CLI and blocks this loop: no call of it while the load runs, or the
        # load's own connects time out here, in the test, while the fleet is answering.
        admin = stack.token("registry", scopes=("registry:admin",))
        headers = {"Authorization": f"Bearer {admin}"}
        stop, outcomes = asyncio.Event(), []
        load = asyncio.gather(*(_hammer(stack, stop, outcomes) for _ in range(4)))
        await _until(lambda: len(outcomes) >= 40)  # load before the rotation (however fast this host)
        async with httpx.AsyncClient() as http:
            # Two steps: the registry makes a key; it signs with it once the operator certifies it.
            pending = await http.post(stack.endpoints["registry"] + "/v1/issuer/rotate", headers=headers)
            assert pending.status_code == 200 and pending.json()["status"] == "pending", pending.text
            jwk = pending.json()["public_jwk"]
            uncertified = await http.post(
                stack.endpoints["registry"] + "/v1/issuer/certificate",
                json={"certificate": certify_issuer_key(SigningKey.generate(), "fleet-registry", jwk)},
                headers=headers,
            )
            assert uncertified.status_code == 401, uncertified.text  # not by the operator's key
            current = await asyncio.to_thread(stack.token, "coordinator")
            assert jwt.get_unverified_header(current)["kid"] != jwk["kid"]
            operator = SigningKey.load_or_create(stack.layout.key_file("operator"))
            rotated = await http.post(
                stack.endpoints["registry"] + "/v1/issuer/certificate",
                json={"certificate": certify_issuer_key(operator, "fleet-registry", jwk)},
                headers=headers,
            )
        assert rotated.status_code == 200, rotated.text
        old_kid, new_kid = rotated.json()["retiring"][0], rotated.json()["kid"]
        assert new_kid == jwk["kid"]
        before = len(outcomes)
        await asyncio.sleep(2)  # at least this long with tokens of both keys about
        await _until(lambda: len(outcomes) >= before + 80)
        stop.set()
        await load
        assert len(outcomes) >= before + 80 and set(outcomes) == {200}, (len(outcomes), sorted(set(outcomes)))
        new_token = stack.token("coordinator")
        assert jwt.get_unverified_header(new_token)["kid"] == new_kid
        assert (await runs_api(stack, old_token)).status_code == 200  # the old key verifies in its grace

        revoked = await asyncio.to_thread(
            fleet,
            "keys",
            "revoke",
            "--reason",
            "rotated out early",
            "--data-dir",
            stack.data_dir,
            "--",  # a key id (a base64url thumbprint) may start with "-"
            old_kid,
            timeout=60,
        )
        assert revoked.returncode == 0 and f"revoked {old_kid}" in revoked.stdout, (
            revoked.stdout + revoked.stderr
        )
        listed = await asyncio.to_thread(fleet, "keys", "revoked", "--data-dir", stack.data_dir, timeout=60)
        assert old_kid in listed.stdout and "rotated out early" in listed.stdout
        # Two other processes stop accepting what the old key signed, unexpired as it is.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            codes = (
                (await runs_api(stack, old_token)).status_code,
                (await mcp_call(stack, "mcp-sql", old_mcp_token)).status_code,
            )
            if codes == (401, 401):
                break
            await asyncio.sleep(0.05)
        assert codes == (401, 401)
        assert (await runs_api(stack, new_token)).status_code == 200
    finally:
        stop_stack(stack)


async def discovered(http: httpx.AsyncClient, stack: Stack, token: str) -> list[str]:
    found = await http.get(
        stack.endpoints["registry"] + "/v1/agents",
        params={"skill": "impersonate"},
        headers={"Authorization": f"Bearer {token}"},
    )
    return [a["id"] for a in found.json()["agents"]]


async def test_a_card_swapped_after_registration_is_quarantined_and_no_longer_offered(
    stack: Stack, impostor: Impostor
) -> None:
    reader = stack.token("registry", scopes=("registry:read",))
    operator = stack.token("registry", scopes=("registry:write", "registry:admin"))
    refresh_url = f"{impostor.registry}/v1/agents/{impostor.id}/refresh"
    async with httpx.AsyncClient() as http, card_server() as agent:
        agent.serve(impostor.key)
        registered = await impostor.register(http, agent.base)
        assert (registered.status_code, registered.json()["status"]) == (200, "healthy"), registered.text
        assert impostor.id in await discovered(http, stack, reader)

        # A new version, signed by the agent's key: checked, accepted, kept in the history.
        agent.serve(impostor.key, version="2")
        checked = await http.post(refresh_url, headers={"Authorization": f"Bearer {operator}"})
        assert (checked.json()["status"], checked.json()["version"]) == ("healthy", "2")

        # Swapped for a card signed by someone else: quarantined at once, not offered any more.
        agent.serve(SigningKey.generate(), version="3")
        checked = await http.post(refresh_url, headers={"Authorization": f"Bearer {operator}"})
        assert checked.json()["status"] == "quarantined"
        assert "signature does not verify" in checked.json()["status_reason"]
        assert impostor.id not in await discovered(http, stack, reader)
        # It stays quarantined though the card is fixed, until the agent registers again.
        agent.serve(impostor.key, version="4")
        again = await http.post(refresh_url, headers={"Authorization": f"Bearer {operator}"})
        assert again.json()["status"] == "quarantined"
        history = await http.get(
            f"{impostor.registry}/v1/agents/{impostor.id}/history",
            headers={"Authorization": f"Bearer {reader}"},
        )
        changes = [(e["change"], e["version"]) for e in history.json()["entries"]]
        assert changes == [("registered", "1"), ("updated", "2"), ("refused", "")]
        assert (await impostor.register(http, agent.base)).json()["status"] == "healthy"
        assert impostor.id in await discovered(http, stack, reader)
    await logged(stack, "registry", f"agent {impostor.id} quarantined")


async def test_an_unsigned_card_or_one_moved_to_another_host_is_quarantined(
    stack: Stack, impostor: Impostor
) -> None:
    operator = stack.token("registry", scopes=("registry:write", "registry:admin"))
    async with httpx.AsyncClient() as http, card_server() as agent:
        agent.serve(impostor.key)
        assert (await impostor.register(http, agent.base)).status_code == 200
        unsigned = functools.partial(agent.serve, None)
        moved = functools.partial(agent.serve, impostor.key, host_in_card="http://evil.example")
        for swap in (unsigned, moved):
            swap()
            checked = await http.post(
                f"{impostor.registry}/v1/agents/{impostor.id}/refresh",
                headers={"Authorization": f"Bearer {operator}"},
            )
            assert checked.json()["status"] == "quarantined", checked.text
            assert (
                await impostor.register(http, agent.base)
            ).status_code == 400  # and refused at registration
            agent.serve(impostor.key)
            assert (await impostor.register(http, agent.base)).json()["status"] == "healthy"


# ------------------------------------------------------------------ delegation (token exchange)
def acting_as(stack: Stack, identity: str, http: httpx.AsyncClient) -> TokenClient:
    """A token client with the key of one of the stack's services (as that service would hold it)."""
    key = SigningKey.load_or_create(stack.layout.key_file(identity))
    return TokenClient(
        token_url=stack.endpoints["registry"] + "/oauth/token", client_id=identity, key=key, http=http
    )


def claims_of(token: str) -> dict[str, Any]:
    return dict(jwt.decode(token, options={"verify_signature": False}))


async def exchange_refused(client: TokenClient, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(FleetError) as refused:
        await client.exchange(*args, **kwargs)
    return refused.value.message


async def test_a_token_passed_down_the_chain_keeps_the_caller_and_names_every_hop(stack: Stack) -> None:
    caller = stack.token("coordinator", tenant="acme")  # the outside caller (here: the operator)
    async with httpx.AsyncClient() as http:
        coordinator, analyst = acting_as(stack, "coordinator", http), acting_as(stack, "sql-analyst", http)
        for_specialist = await coordinator.exchange(caller, "sql-analyst", ["agent:invoke"])
        hop = claims_of(for_specialist)
        assert (hop["sub"], hop["tenant"], hop["aud"], hop["client_id"]) == (
            "operator",
            "acme",
            "sql-analyst",
            "coordinator",
        )
        assert hop["act"] == {"sub": "coordinator"}
        for_tool = await analyst.exchange(for_specialist, "mcp-sql", ["sql:query"])
        tool = claims_of(for_tool)
        assert (tool["sub"], tool["tenant"], tool["aud"]) == ("operator", "acme", "mcp-sql")
        assert tool["act"] == {"sub": "sql-analyst", "act": {"sub": "coordinator"}}
        assert (await mcp_call(stack, "mcp-sql", for_tool)).status_code == 200
        called = await call_mcp(stack, "mcp-sql", for_tool, "query", {"sql": "SELECT 1"})
        assert not called.is_error, called.content
    # The tool server's audit event names the caller and the chain that brought its token.
    await audited(
        stack,
        "mcp-sql",
        lambda e: (
            (e["tool"], e["subject"], _chain(e), e["outcome"])
            == ("query", "operator", "sql-analyst>coordinator", "allowed")
        ),
    )
    async with httpx.AsyncClient() as http:
        coordinator, analyst = acting_as(stack, "coordinator", http), acting_as(stack, "sql-analyst", http)

        # Only the party a token was given to may pass it on; a hop never changes the tenant;
        # scopes stay within what the actor was enrolled for.
        assert "refused" in await exchange_refused(analyst, caller, "mcp-sql", ["sql:query"])
        assert "scopes not granted" in await exchange_refused(
            coordinator, caller, "mcp-sql", ["registry:admin"]
        )
    form = {
        "grant_type": "urn:ietf:params:oauth:grant-type:token-exchange",
        "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        "client_assertion": client_assertion(
            SigningKey.load_or_create(stack.layout.key_file("coordinator")), "coordinator",
            stack.endpoints["registry"] + "/oauth/token",
        ),
        "subject_token": caller,
        "subject_token_type": "urn:ietf:params:oauth:token-type:access_token",
        "audience": "sql-analyst",
        "tenant": "globex",
    }  # fmt: skip
    async with httpx.AsyncClient() as http:
        other_tenant = await http.post(stack.endpoints["registry"] + "/oauth/token", data=form)
    assert (other_tenant.status_code, other_tenant.json()["error"]) == (400, "invalid_request")


async def test_a_run_grant_outlives_the_caller_token_but_is_no_access_token(stack: Stack) -> None:
    caller = stack.token("coordinator", tenant="acme")
    async with httpx.AsyncClient() as http:
        coordinator, worker = acting_as(stack, "coordinator", http), acting_as(stack, "worker-1", http)
        grant = await coordinator.exchange(caller, requested_type=RUN_GRANT_TYPE, run_id="run-42")
        claims = claims_of(grant)
        assert (claims["sub"], claims["aud"], claims["run_id"], claims["token_use"]) == (
            "operator", "coordinator", "run-42", "run_grant"
        )  # fmt: skip
        assert claims["exp"] - claims["iat"] > 24 * 3600  # a run may wait days for a person
        # Not a bearer token anywhere, though signed by the registry and addressed to the coordinator.
        refused = await runs_api(stack, grant)
        assert refused.status_code == 401 and "run grant is not an access token" in refused.text
        # A worker redeems it for the next hop, in the caller's name; the hop names the run.
        hop = claims_of(
            await worker.exchange(grant, "sql-analyst", ["agent:invoke"], subject_type=RUN_GRANT_TYPE)
        )
        assert (hop["sub"], hop["run_id"]) == ("operator", "run-42")
        assert hop["act"] == {"sub": "worker-1", "act": {"sub": "coordinator"}}
        # A specialist cannot redeem it, and only the coordinator can take one.
        analyst = acting_as(stack, "sql-analyst", http)
        assert "refused" in await exchange_refused(analyst, grant, "mcp-sql", subject_type=RUN_GRANT_TYPE)
        specialist_token = await coordinator.exchange(caller, "sql-analyst", ["agent:invoke"])
        assert "for the coordinator" in await exchange_refused(
            analyst, specialist_token, requested_type=RUN_GRANT_TYPE, run_id="run-43"
        )


async def test_a_console_session_grant_acts_in_the_persons_name_within_their_sign_in(stack: Stack) -> None:
    sign_in = stack.token("console", tenant="acme", scopes=("agent:invoke", "registry:read"))
    async with httpx.AsyncClient() as http:
        console, analyst = acting_as(stack, "console", http), acting_as(stack, "sql-analyst", http)
        grant = await console.exchange(sign_in, requested_type=SESSION_GRANT_TYPE)
        claims = claims_of(grant)
        assert (claims["sub"], claims["aud"], claims["tenant"], claims["token_use"]) == (
            "operator", "console", "acme", "session_grant"
        )  # fmt: skip
        assert claims["scope"] == "agent:invoke registry:read"
        assert claims["exp"] - claims["iat"] > 3600  # a working day, where a sign-in lasts minutes
        refused = await runs_api(stack, grant)
        assert refused.status_code == 401 and "session grant is not an access token" in refused.text
        # Redeemed by the console for a backend, in the person's name, with the console acting.
        hop = claims_of(
            await console.exchange(grant, "coordinator", ["agent:invoke"], subject_type=SESSION_GRANT_TYPE)
        )
        assert (hop["sub"], hop["tenant"], hop["act"]) == ("operator", "acme", {"sub": "console"})
        assert (await runs_api(stack, await console.exchange(
            grant, "coordinator", ["agent:invoke"], subject_type=SESSION_GRANT_TYPE
        ))).status_code == 200  # fmt: skip
        # Never beyond the sign-in: this person did not sign in with runs:approve.
        assert "not signed in with runs:approve" in await exchange_refused(
            console, grant, "coordinator", ["runs:approve"], subject_type=SESSION_GRANT_TYPE
        )
        # Only the console it was given to redeems it, and only a console may take one.
        assert "refused" in await exchange_refused(analyst, grant, "mcp-sql", subject_type=SESSION_GRANT_TYPE)
        specialist_token = await acting_as(stack, "coordinator", http).exchange(
            stack.token("coordinator", tenant="acme"), "sql-analyst", ["agent:invoke"]
        )
        assert "for the console" in await exchange_refused(
            analyst, specialist_token, requested_type=SESSION_GRANT_TYPE
        )
        # A service's own token for the console, or a caller's token passed down a chain, opens no
        # session: only a person's own sign-in does.
        worker_sign_in = await acting_as(stack, "worker-1", http).token("console", "acme", ["agent:invoke"])
        assert "own sign-in" in await exchange_refused(
            console, worker_sign_in, requested_type=SESSION_GRANT_TYPE
        )
        passed_down = await exchange_refused(
            acting_as(stack, "coordinator", http),
            stack.token("coordinator", tenant="acme"),
            "console",
            ["agent:invoke"],
        )
        assert "cannot be delegated" in passed_down


async def test_revoking_the_callers_key_stops_what_was_exchanged_from_its_tokens(stack: Stack) -> None:
    impostor = Impostor(stack)  # a caller in its own name (a specialist would act only for its callers)
    async with httpx.AsyncClient() as http:
        assert (await impostor.enroll(http, impostor.enrollment_token(kind="worker"))).status_code == 201
        form = {
            "grant_type": "client_credentials",
            "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
            "client_assertion": client_assertion(
                impostor.key, impostor.id, impostor.registry + "/oauth/token"
            ),
            "audience": "coordinator",
            "tenant": "acme",
            "scope": "",
        }
        caller = (await http.post(impostor.registry + "/oauth/token", data=form)).json()["access_token"]
        coordinator = acting_as(stack, "coordinator", http)
        passed_on = await coordinator.exchange(caller, "registry", ["registry:read"])
        agents = f"{impostor.registry}/v1/agents"
        assert (await http.get(agents, headers={"Authorization": f"Bearer {passed_on}"})).status_code == 200
        # A delegated token reads the registry, but cannot change it in its subject's name: policy
        # grants no such token, and the registry refuses one all the same (here: forged).
        assert "registry:write cannot be delegated" in await exchange_refused(
            coordinator, caller, "registry", ["registry:read", "registry:write"]
        )
        forged = stack.forge(
            sub=impostor.id, aud="registry", scope="registry:write", act={"sub": "coordinator"}
        )
        change = await http.put(
            f"{agents}/{impostor.id}",
            json={"url": "http://127.0.0.1:1"},
            headers={"Authorization": f"Bearer {forged}"},
        )
        assert change.status_code == 403 and "delegated" in change.text
        admin = stack.token("registry", scopes=("registry:admin",))
        revoked = await http.post(
            f"{impostor.registry}/v1/keys/{impostor.key.kid}/revoke",
            json={},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert revoked.status_code == 200
        # The coordinator's own key is fine, but the caller's is revoked: what came from it stops.
        assert (await http.get(agents, headers={"Authorization": f"Bearer {passed_on}"})).status_code == 401


async def test_a_run_acts_for_its_caller_at_every_hop_until_the_callers_key_is_revoked(stack: Stack) -> None:
    caller = Impostor(stack)  # an outside agent, enrolled to call the coordinator
    async with httpx.AsyncClient() as http:
        # a caller in its own name (a specialist would act only for its callers)
        enrolled = await caller.enroll(http, caller.enrollment_token(scopes=("agent:invoke",), kind="worker"))
        assert enrolled.status_code == 201, enrolled.text
        issued = await caller.request_token(http, "agent:invoke", audience="coordinator")
        token = issued.json()["access_token"]
    marker = uuid.uuid4().hex[:12]
    plan = {
        "steps": [
            {"id": "first", "skill": "sql-query", "input": {"sql": f"SELECT '{marker}' AS m"}},
            {"id": "pause", "wait": {"for_s": 4}, "after": ["first"]},
            {"id": "second", "skill": "sql-query", "input": {"sql": "SELECT 2 AS n"}, "after": ["pause"]},
        ]
    }
    running = asyncio.create_task(send(stack, user_message(data=plan), token=token))
    # The first step's tool call is made in the caller's name, and names each hop and the run.
    event = await audited(
        stack,
        "mcp-sql",
        lambda e: (
            e["tool"] == "query" and e["subject"] == caller.id and _chain(e).startswith("sql-analyst>worker-")
        ),
    )
    assert _chain(event).endswith(">coordinator") and event["run_id"], event
    run_id = event["run_id"]
    # While the run pauses, the caller's key is revoked: its next step cannot act in its name.
    async with httpx.AsyncClient() as http:
        admin = stack.token("registry", scopes=("registry:admin",))
        revoked = await http.post(
            f"{caller.registry}/v1/keys/{caller.key.kid}/revoke",
            json={"reason": "caller compromised"},
            headers={"Authorization": f"Bearer {admin}"},
        )
        assert revoked.status_code == 200, revoked.text
    outcome = await asyncio.wait_for(running, 60)
    assert outcome.task_id == run_id
    assert outcome.state_name == "TASK_STATE_FAILED", outcome
    assert outcome.codes[0] == "forbidden" and "revoked" in outcome.final_text, (
        outcome.codes,
        outcome.final_text,
    )
    # The grant itself never shows: not in the run's events.
    operator = stack.token("coordinator")
    events = json.dumps(await all_events(stack, run_id, operator))
    assert "run-grant" not in events and "eyJ" not in events


async def call_tool(url: str, token: str, tool: str) -> Any:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        result = await client.call_tool(tool, {})
    assert not result.is_error, result.content
    return result.structured_content


async def agent_tools(stack: Stack, agent: str) -> dict[str, list[dict[str, Any]]]:
    """What ``agent`` says it may use now: its MCP servers and their tools."""
    async with httpx.AsyncClient() as http:
        response = await http.get(
            stack.endpoints["specialists"][agent] + "/v1/tools",
            headers={"Authorization": f"Bearer {stack.token(agent)}"},
        )
    assert response.status_code == 200, response.text
    return {m["id"]: m["tools"] for m in response.json()["mcp_servers"]}


async def test_an_mcp_server_registered_at_run_time_shows_to_the_agents_whose_scopes_allow_it(
    stack: Stack, tmp_path: Path
) -> None:
    before = await agent_tools(stack, "sql-analyst")
    assert [t["scopes"] for t in before["mcp-sql"]] == [["sql:query"]]
    async with team_mcp_server(stack, tmp_path, "sql:query") as server:
        assert server not in before
        deadline = time.monotonic() + 15
        while server not in (seen := await agent_tools(stack, "sql-analyst")):
            assert time.monotonic() < deadline, f"sql-analyst never saw {server}: {sorted(seen)}"
            await asyncio.sleep(0.5)
        assert [(t["name"], t["scopes"]) for t in seen[server]] == [("whoami", ["sql:query"])]
        # The case desk is not enrolled for sql:query: it does not see the tool.
        assert server not in await agent_tools(stack, "case-desk")
        async with httpx.AsyncClient() as http:
            analyst = acting_as(stack, "sql-analyst", http)
            # Acting for a caller, the analyst gets a token for the new server: the scope its
            # tool declares, and nothing else.
            caller = stack.token("sql-analyst", tenant="globex")
            token = await analyst.exchange(caller, server, ["sql:query"])
            assert "is not one that" in await exchange_refused(analyst, caller, server, ["registry:read"])
            url = (await http.get(stack.endpoints["registry"] + f"/v1/mcp-servers/{server}", headers={
                "Authorization": f"Bearer {stack.token('registry', scopes=('registry:read',))}"
            })).json()["url"]  # fmt: skip
        answer = await call_tool(url, token, "whoami")
        assert answer == {"sub": "operator", "tenant": "globex", "actors": ["sql-analyst"]}


async def rpc_status(stack: Stack, token: str, path: str = "/a2a/jsonrpc") -> httpx.Response:
    async with httpx.AsyncClient() as http:
        body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
        return await http.post(
            stack.endpoints["coordinator"] + path, json=body, headers={"Authorization": f"Bearer {token}"}
        )


async def test_an_outside_issuers_caller_acts_in_its_mapped_tenant_down_the_chain(
    stack: Stack, partner_idp: PartnerIdp
) -> None:
    # The partner's token claims another tenant and a chain of its own: neither means anything here.
    token = partner_idp.token("alice", tenant="acme", act={"sub": "coordinator"})
    plan = {
        "steps": [
            {"skill": "sql-query", "input": {"sql": "SELECT DISTINCT tenant_id FROM tenant_data.invoices"}}
        ]
    }
    outcome = await send(stack, user_message(data=plan), token=token)
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome
    assert "globex" in json.dumps(outcome.result) and "acme" not in json.dumps(outcome.result)
    event = await audited(
        stack,
        "mcp-sql",
        lambda e: (
            e["tool"] == "query"
            and e["subject"] == "partner:alice"
            and _chain(e).startswith("sql-analyst>worker-")
        ),
    )
    assert _chain(event).endswith(">coordinator"), event
    assert (event["run_id"], event["tenant"], event["outcome"]) == (outcome.task_id, "globex", "allowed")
    assert (await rpc_status(stack, partner_idp.es256_token("bob"))).status_code != 401  # ES256 too


OUTSIDE_REFUSED: dict[str, tuple[Callable[[PartnerIdp], str], str]] = {
    "wrong audience": (lambda idp: idp.token(aud="coordinator"), "not meant for this service"),
    "expired": (lambda idp: idp.token(iat=1_700_000_000, exp=1_700_000_300), "token expired"),
    "lives too long": (lambda idp: idp.token(exp=int(time.time()) + 7200), "lives longer than 3600"),
    "unknown key": (
        lambda idp: SigningKey.generate().sign(idp.claims()),
        "unknown key",
    ),
    "another outside issuer": (
        lambda idp: idp.token(iss="https://idp.elsewhere.example"),
        "another issuer",
    ),
    "HS256": (
        lambda idp: jwt.encode(idp.claims(), "secret-of-32-bytes-at-least-0123456789", algorithm="HS256"),
        "algorithm not allowed",
    ),
}


@pytest.mark.parametrize("case", sorted(OUTSIDE_REFUSED))
async def test_a_bad_outside_token_is_refused_and_logged(
    stack: Stack, partner_idp: PartnerIdp, case: str
) -> None:
    make, reason = OUTSIDE_REFUSED[case]
    token = make(partner_idp)
    refused = await rpc_status(stack, token)
    assert refused.status_code == 401, refused.text
    assert reason in refused.text
    await logged(stack, "coordinator", reason, jwt.decode(token, options={"verify_signature": False})["iss"])


async def test_an_outside_token_is_good_for_a2a_only_and_cannot_be_passed_on_by_a_specialist(
    stack: Stack, partner_idp: PartnerIdp
) -> None:
    token = partner_idp.token("alice")
    assert (await rpc_status(stack, token, "/v1/runs")).status_code == 401  # the run API: fleet tokens only
    async with httpx.AsyncClient() as http:
        analyst = acting_as(stack, "sql-analyst", http)
        assert "only the coordinator" in await exchange_refused(analyst, token, "mcp-sql", ["sql:query"])
