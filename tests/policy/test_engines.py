"""The two engines behind one interface: the embedded one, and OPA over REST (``opa-python-client``)
against an OPA-REST-compatible server (``fleet policy serve``, run here as its own process: no
``opa`` binary can be installed). They must agree on the whole policy test suite and on decisions,
and the REST backend must fail closed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from fleetctl.policy_cli import SERVE_MAX_BODY_BYTES
from policy import DEFAULT_BUNDLE_DIR, Bundle, PolicyError, RegorusEngine
from policy.live import LivePolicy, live_policy
from policy.opa_rest import OpaRestEngine
from policy.testing import run_bundle_tests, run_tests_with

TOKEN = "decision-point-secret"
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("fleet.tools.decision", {"server": "mcp-sql", "tool": "query", "tenant": "acme", "subject": "a",
                              "scopes": ["sql:query"], "arguments": {"sql_length": 40}}),
    ("fleet.tools.decision", {"server": "mcp-sql", "tool": "query", "tenant": "acme", "subject": "a",
                              "scopes": [], "arguments": {"sql_length": 40}}),
    ("fleet.tools.decision", {"server": "mcp-cases", "tool": "issue_refund", "tenant": "acme", "subject": "a",
                              "scopes": ["cases:write"], "arguments": {"amount_cents": 500000}}),
    ("fleet.tools.decision", {"server": "mcp-sql", "tool": "drop", "tenant": "", "scopes": []}),
    ("fleet.routing.decision", {"text": "any outlier in the invoices?", "tenant": "acme"}),
    ("fleet.routing.decision", {"text": "write a sonnet", "tenant": "acme"}),
    ("fleet.budgets.decision", {"tenant": "acme"}),
    ("fleet.approvals.deadlines", {"tenant": "acme"}),
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def opa_process() -> Iterator[subprocess.Popen[bytes]]:
    """``fleet policy serve`` in a process of its own, empty (each test loads its bundle)."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetctl", "policy", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "FLEET_OPA_TOKEN": TOKEN},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, process.stderr
        time.sleep(0.05)
    process.url = url  # type: ignore[attr-defined]
    try:
        yield process
    finally:
        process.terminate()
        process.wait(10)
        assert process.stderr is not None
        process.stderr.close()


@pytest.fixture(scope="module")
def opa_url(opa_process: subprocess.Popen[bytes]) -> str:
    return str(opa_process.url)  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def loaded(url: str, bundle: Bundle, **kwargs: Any) -> AsyncIterator[OpaRestEngine]:
    engine = await OpaRestEngine.load(url, bundle, token=TOKEN, **kwargs)
    try:
        yield engine
    finally:
        await engine.aclose()


async def test_both_engines_agree_on_the_whole_policy_test_suite(opa_url: str) -> None:
    bundle = Bundle.load()
    embedded, _ = run_bundle_tests(bundle)
    async with loaded(opa_url, bundle, with_tests=True) as rest:
        over_rest = await run_tests_with(bundle, rest.evaluate)
    outcome = {(r.package, r.name): r.outcome for r in embedded}
    assert len(outcome) > 40 and set(outcome.values()) == {"pass"}
    assert {(r.package, r.name): r.outcome for r in over_rest} == outcome


async def test_both_engines_take_the_same_decisions(opa_url: str) -> None:
    bundle = Bundle.load()
    embedded = RegorusEngine(bundle)
    async with loaded(opa_url, bundle) as rest:
        assert rest.revision == embedded.revision
        for path, document in CALLS:
            ours, theirs = await embedded.decide(path, document), await rest.decide(path, document)
            assert (ours.allow, ours.reasons, ours.result) == (theirs.allow, theirs.reasons, theirs.result)


async def test_the_rest_backend_fails_closed(opa_url: str, tmp_path: Path) -> None:
    bundle = Bundle.load()
    async with loaded(opa_url, bundle) as rest:
        with pytest.raises(PolicyError, match="did not return a decision"):
            await rest.decide("fleet.tools.no_such_rule", {})  # undefined: OPA answers {}
    broken = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, broken)
    (broken / "tools.rego").write_text("package fleet.tools\n\nallow {\n")
    with pytest.raises(PolicyError, match="does not compile on OPA"):
        await OpaRestEngine.load(opa_url, Bundle.load(broken), token=TOKEN)
    async with loaded(opa_url, bundle) as rest:  # the refused module left the server as it was
        assert (await rest.decide(*CALLS[0])).allow
    with pytest.raises(PolicyError, match="cannot load the bundle into OPA"):
        await OpaRestEngine.load(f"http://127.0.0.1:{_free_port()}", bundle, token=TOKEN)  # nothing listens


async def test_the_decision_point_wants_its_token_and_keeps_data_off_the_rules(opa_url: str) -> None:
    async with loaded(opa_url, Bundle.load()) as rest, httpx.AsyncClient(base_url=opa_url) as http:
        anonymous = await http.post("/v1/data/fleet/tools/decision", json={"input": CALLS[0][1]})
        assert anonymous.status_code == 401 and anonymous.json()["code"] == "unauthorized"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        shadow = await http.put("/v1/data/fleet/tools/decision", json={"allow": True}, headers=bearer)
        assert shadow.status_code == 400 and "conflicts with package fleet.tools" in shadow.json()["message"]
        denied = CALLS[1]  # no scope
        assert not (await rest.decide(*denied)).allow  # the rule still decides
        assert (await http.get("/health")).status_code == 200  # open: says nothing


async def test_a_decision_not_made_in_time_is_a_denial(
    opa_url: str, opa_process: subprocess.Popen[bytes]
) -> None:
    """An OPA that stops answering (its process stopped; the kernel still accepts connections): the
    decision is refused within the policy timeout, with the policy_unavailable code."""
    async with loaded(opa_url, Bundle.load()) as rest:
        policy = LivePolicy("svc", lambda b: OpaRestEngine.load(opa_url, b, token=TOKEN), rest, timeout_s=0.3)
        assert (await policy.decide(*CALLS[0])).allow
        os.kill(opa_process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(PolicyError) as refused:
                await policy.decide(*CALLS[0])
            assert time.monotonic() - started < 1.5
            assert refused.value.code == ErrorCode.POLICY_UNAVAILABLE
        finally:
            os.kill(opa_process.pid, signal.SIGCONT)
        assert (await policy.decide(*CALLS[0])).allow


def test_with_the_opa_engine_nothing_is_decided_before_the_bundle_is_loaded(tmp_path: Path) -> None:
    settings = ServiceSettings(
        service_id="svc", key_file=tmp_path / "k", public_url="http://127.0.0.1:1",
        policy_engine="opa", opa_url="http://127.0.0.1:1",
    )  # fmt: skip
    policy = live_policy(settings)
    assert policy.engine is None and policy.revision == "none"
    with pytest.raises(PolicyError, match="no policy is loaded here yet"):
        asyncio.run(policy.decide(*CALLS[0]))


async def test_the_decision_point_refuses_a_body_over_its_cap_with_413(opa_url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.put(
            opa_url + "/v1/data/huge",
            content=b"x" * (SERVE_MAX_BODY_BYTES + 1),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"
