"""Tokens: how fast one is verified, how fast they are issued, and how fast a revocation reaches
the services that verify them.

* verification (target p50 <= 200 us): the fleet's verifier (``fleet.tokens.TokenVerifier``:
  algorithm allow-list, required claims, one audience, the issuer, the key by ``kid``, and the
  revocation check against a list followed live from a real NATS with ``REVOKED`` entries) against
  bare PyJWT (``jwt.decode`` with the same key, audience and issuer), interleaved, one token at a time.
* issuance (target >= 1,000/s): the token service's whole client-credentials grant (the client's
  assertion verified against its enrolled key, read from NATS KV (cached 2 s); the key checked against
  the revocation list; the assertion's ``jti`` used once, in NATS KV; the grant checked; the token
  signed), one at a time and 32 at once, against bare PyJWT
  signing the same claims (``jwt.encode``); and signing alone (``TokenService.issue``).
* revocation reach (target <= 2 s, across processes): on a real stack, an identity holds tokens for
  the coordinator, the registry and the SQL MCP server (three processes); its key is revoked; each
  service is asked every 5 ms until it refuses the token. Reported: the slowest service, per try.

Run: ``.venv/bin/python -m bench.tokens`` (starts its own NATS, and its own stack for the last part).
"""

from __future__ import annotations

import asyncio
import functools
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx
import jwt
from cryptography.hazmat.primitives.asymmetric import ec

from deploy.enrollment import enrollment_token
from deploy.local_stack import ServiceSpec
from fleet.issuer_certs import CertifiedKey, IssuerTrust, certify_issuer_key
from fleet.keys import ALGORITHM, SigningKey
from fleet.natsconn import connect
from fleet.revocations import Revocation, Revocations, record_revocation
from fleet.tokens import CLIENT_ASSERTION_TYPE, TokenVerifier, client_assertion
from fleetctl.cli_common import operator_token_client
from fleetctl.layout import StackLayout
from fleetctl.testing.nats import embedded_nats
from fleetctl.testing.stack import running_stack
from policy import RegorusEngine
from registry._records import IdentityRecord
from registry._seal import RecordSeal
from registry._store import RegistryStore
from registry._token_service import TokenService

ISSUER = "fleet-registry"
VERIFY_ROUNDS, VERIFY_PER_ROUND = 7, 2_000
ISSUE_N, ISSUE_CONCURRENCY = 2_000, 32
REVOKED = 100
REACH_TRIES = 5
VERIFY_TARGET_US, ISSUE_TARGET_PER_S, REACH_TARGET_S = 200.0, 1_000.0, 2.0


def _issuer() -> tuple[IssuerTrust, CertifiedKey]:
    """A registry key certified by an operator key, and the trust of a verifier that pins it."""
    operator, key = SigningKey.generate(), SigningKey.generate()
    cert = certify_issuer_key(operator, ISSUER, key.public_jwk())
    return IssuerTrust(operator.public_jwk(), ISSUER), CertifiedKey(key, cert)


def _claims(audience: str = "coordinator") -> dict[str, Any]:
    now = int(time.time())
    return {
        "iss": ISSUER,
        "sub": "bench-client",
        "aud": audience,
        "tenant": "acme",
        "scope": "agent:invoke",
        "iat": now,
        "nbf": now,
        "exp": now + 300,
        "jti": uuid.uuid4().hex,
        "client_kid": "bench-client-key",
    }


async def verification(nats_url: str) -> dict[str, Any]:
    trust, signer = _issuer()
    key = signer.key
    public = key.private_key.public_key()
    client = await connect(nats_url, "bench-tokens")
    try:
        for n in range(REVOKED):
            revocation = Revocation(f"revoked-{n}", "someone", time.time(), "bench", "")
            await record_revocation(client, revocation, signer, ISSUER)
        revocations = Revocations(trust)
        await revocations.follow(client)

        async def lookup(kid: str) -> ec.EllipticCurvePublicKey | None:
            return public if kid == key.kid else None

        verifier = TokenVerifier(lookup, issuer=ISSUER, audience="coordinator", revocations=revocations)
        ours, bare = [], []
        for _ in range(VERIFY_ROUNDS):
            tokens = [key.sign(_claims(), typ="at+jwt") for _ in range(VERIFY_PER_ROUND)]
            for token in tokens:
                started = time.perf_counter()
                jwt.decode(token, public, algorithms=[ALGORITHM], audience="coordinator", issuer=ISSUER)
                bare.append(time.perf_counter() - started)
            for token in tokens:
                started = time.perf_counter()
                await verifier.verify(token, required_scopes=["agent:invoke"])
                ours.append(time.perf_counter() - started)
        await revocations.stop()
    finally:
        await client.drain()
    p50, base = statistics.median(ours) * 1e6, statistics.median(bare) * 1e6
    return {
        "verify_p50_us": round(p50, 1),
        "verify_p95_us": round(sorted(ours)[int(len(ours) * 0.95)] * 1e6, 1),
        "verify_bare_pyjwt_p50_us": round(base, 1),
        "verify_ratio": round(p50 / base, 2),
        "verify_tokens": len(ours),
        "revoked_in_list": REVOKED,
    }


async def issuance(nats_url: str) -> dict[str, Any]:
    (trust, signer), client_key = _issuer(), SigningKey.generate()
    issuer_key = signer.key
    token_url = "http://registry.bench/oauth/token"
    client = await connect(nats_url, "bench-issuance")
    try:
        revocations = Revocations(trust)
        await revocations.follow(client)
        seal = RecordSeal(trust, lambda kid: revocations.check(kid) is not None)
        seal.signer = signer  # the registry's records are signed and verified, as it runs
        store = await RegistryStore.open(client, seal)
        await store.put_identity(
            IdentityRecord(  # a caller in its own name (a specialist may only exchange its callers' tokens)
                id="bench-client",
                kind="operator",
                keys={client_key.kid: client_key.public_jwk()},
                scopes=["agent:invoke"],
                tenants=["*"],
                enrolled_at=time.time(),
            )
        )
        await store.put_identity(
            IdentityRecord(id="coordinator", kind="coordinator", keys={}, enrolled_at=time.time())
        )
        # with the fleet's policy, as the registry runs it: every token is a fleet.tokens decision
        service = TokenService(
            store, issuer_key, ISSUER, token_url, revocations, policy=RegorusEngine.from_dir()
        )

        def form() -> dict[str, str]:
            return {
                "grant_type": "client_credentials",
                "client_assertion_type": CLIENT_ASSERTION_TYPE,
                "client_assertion": client_assertion(client_key, "bench-client", token_url),
                "audience": "coordinator",
                "tenant": "acme",
                "scope": "agent:invoke",
            }

        forms = [form() for _ in range(ISSUE_N)]  # the client's signing is the client's cost
        started = time.perf_counter()
        for body in forms[: ISSUE_N // 4]:
            await service.grant(body)
        sequential = (ISSUE_N // 4) / (time.perf_counter() - started)

        queue: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        for body in forms[ISSUE_N // 4 :]:
            queue.put_nowait(body)

        async def worker() -> None:
            while not queue.empty():
                await service.grant(queue.get_nowait())

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(ISSUE_CONCURRENCY)))
        concurrent = (ISSUE_N - ISSUE_N // 4) / (time.perf_counter() - started)

        claims = [_claims() for _ in range(ISSUE_N)]
        started = time.perf_counter()
        for c in claims:
            jwt.encode(c, issuer_key.private_key, algorithm=ALGORITHM, headers={"kid": issuer_key.kid})
        bare = ISSUE_N / (time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(ISSUE_N):
            service.issue("bench-client", "coordinator", "acme", ["agent:invoke"], client_key.kid)
        signing = ISSUE_N / (time.perf_counter() - started)
    finally:
        await client.drain()
    return {
        "grant_per_s_sequential": round(sequential),
        "grant_per_s_concurrent": round(concurrent),
        "grant_concurrency": ISSUE_CONCURRENCY,
        "issue_per_s": round(signing),
        "bare_pyjwt_sign_per_s": round(bare),
    }


async def _enrolled(layout: StackLayout, registry: str, http: httpx.AsyncClient) -> tuple[str, SigningKey]:
    operator = SigningKey.load_or_create(layout.key_file("operator"))
    identity, key = f"bench-{uuid.uuid4().hex[:8]}", SigningKey.generate()
    spec = ServiceSpec(identity, "worker", "x:y", scopes=("registry:read",))  # a caller in its own name
    response = await http.post(
        registry + "/v1/enroll",
        json={
            "id": identity,
            "public_jwk": key.public_jwk(),
            "enrollment_token": enrollment_token(operator, spec),
        },
    )
    response.raise_for_status()
    return identity, key


async def _token(
    http: httpx.AsyncClient, registry: str, identity: str, key: SigningKey, audience: str, scope: str
) -> str:
    response = await http.post(
        registry + "/oauth/token",
        data={
            "grant_type": "client_credentials",
            "client_assertion_type": CLIENT_ASSERTION_TYPE,
            "client_assertion": client_assertion(key, identity, registry + "/oauth/token"),
            "audience": audience,
            "tenant": "acme",
            "scope": scope,
        },
    )
    response.raise_for_status()
    return str(response.json()["access_token"])


Probe = Callable[[], Awaitable[httpx.Response]]


def _probes(http: httpx.AsyncClient, endpoints: dict[str, Any], tokens: dict[str, str]) -> dict[str, Probe]:
    """A request per service, each with the token for that service."""
    mcp_headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {tokens['mcp-sql']}",
    }
    listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    return {
        "coordinator": functools.partial(
            http.get,
            endpoints["coordinator"] + "/v1/runs",
            headers={"Authorization": f"Bearer {tokens['coordinator']}"},
        ),
        "registry": functools.partial(
            http.get,
            endpoints["registry"] + "/v1/agents",
            headers={"Authorization": f"Bearer {tokens['registry']}"},
        ),
        "mcp-sql": functools.partial(
            http.post, endpoints["mcp_servers"]["mcp-sql"], json=listing, headers=mcp_headers
        ),
    }


async def _refused_after(request: Probe, started: float) -> float:
    while True:
        response = await request()
        if response.status_code == 401:
            return time.perf_counter() - started
        if time.perf_counter() - started > 30:
            raise TimeoutError("a service still accepts a revoked key's token after 30 s")
        await asyncio.sleep(0.005)


async def revocation_reach(layout: StackLayout, endpoints: dict[str, Any]) -> dict[str, Any]:
    registry = endpoints["registry"]
    slowest: list[float] = []
    per_service: dict[str, list[float]] = {"coordinator": [], "registry": [], "mcp-sql": []}
    async with httpx.AsyncClient(timeout=10) as http:
        admin = operator_token_client(layout, registry + "/oauth/token", http)
        for _ in range(REACH_TRIES):
            identity, key = await _enrolled(layout, registry, http)
            tokens = {
                "coordinator": await _token(http, registry, identity, key, "coordinator", ""),
                "registry": await _token(http, registry, identity, key, "registry", "registry:read"),
                "mcp-sql": await _token(http, registry, identity, key, "mcp-sql", ""),
            }
            requests = _probes(http, endpoints, tokens)
            for name, request in requests.items():  # accepted before (403: verified, then lacks scope)
                status = (await request()).status_code
                assert status in (200, 403), (name, status)
            bearer = await admin.token("registry", "default", ["registry:admin"])
            started = time.perf_counter()
            revoked = await http.post(
                f"{registry}/v1/keys/{key.kid}/revoke",
                json={"reason": "benchmark"},
                headers={"Authorization": f"Bearer {bearer}"},
            )
            revoked.raise_for_status()
            delays = await asyncio.gather(*(_refused_after(r, started) for r in requests.values()))
            for name, delay in zip(requests, delays, strict=True):
                per_service[name].append(delay)
            slowest.append(max(delays))
    return {
        "reach_tries": REACH_TRIES,
        "reach_slowest_s": [round(s, 3) for s in slowest],
        "reach_median_of_slowest_s": round(statistics.median(slowest), 3),
        "reach_max_s": round(max(slowest), 3),
        "reach_median_s_by_service": {k: round(statistics.median(v), 3) for k, v in per_service.items()},
    }


def main() -> dict[str, Any]:
    with embedded_nats() as nats_url:
        verified = asyncio.run(verification(nats_url))
        issued = asyncio.run(issuance(nats_url))
    with (
        TemporaryDirectory(prefix="fleet-bench-") as tmp,
        running_stack(Path(tmp) / "fleet") as (layout, endpoints),
    ):
        reach = asyncio.run(revocation_reach(layout, endpoints))
    result = {
        "benchmark": "tokens",
        **verified,
        **issued,
        **reach,
        "verify_target_us": VERIFY_TARGET_US,
        "issue_target_per_s": ISSUE_TARGET_PER_S,
        "reach_target_s": REACH_TARGET_S,
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
