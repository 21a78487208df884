"""A policy author edits a rule, tests and pushes the bundle, and every running process of the shared
stack enforces it within 2 s, with no restart; a bundle that does not compile or pass its tests is
refused and the old one keeps serving, and so is one written into the bucket without the operator's
signature. Each test leaves the stack on the installed bundle."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fleet.keys import SigningKey
from fleet.natsconn import connect, key_value
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import Stack, fleet
from fleetctl.testing.mcp import call as call_mcp
from policy import DEFAULT_BUNDLE_DIR, Bundle, PolicySigner, certify_author
from policy.live import BUNDLE_KEY, HISTORY, POLICY_BUCKET, bundle_message, push, pushed, statuses

ENFORCED_WITHIN_S = 2.0
LONG_SQL = "SELECT 1 AS one, 2 AS two"


def edited_bundle(tmp_path: Path, edit: Any, tests: dict[str, str] | None = None) -> Path:
    """A copy of the installed bundle with ``edit`` applied to its ``data.json`` and its test files
    changed as ``tests`` says (old text -> new text), as an author changes both."""
    root = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, root)
    data = json.loads((root / "data.json").read_text())
    edit(data["config"])
    (root / "data.json").write_text(json.dumps(data, indent=2))
    for old, new in (tests or {}).items():
        path = root / "tools_test.rego"
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))
    return root


def operator(stack: Stack) -> PolicySigner:
    """The stack's operator as a policy author (what ``fleet policy push`` signs with)."""
    return PolicySigner.operator(SigningKey.load_or_create(stack.layout.key_file("operator")))


def policy_processes(stack: Stack) -> set[str]:
    """The processes of the stack that take policy decisions."""
    services = set(stack.endpoints["services"])
    return {s for s in services if s in ("registry", "coordinator") or s.startswith(("worker-", "mcp-"))}


@pytest.fixture
async def restored(stack: Stack) -> AsyncIterator[None]:
    """Put the installed bundle back in force after the test, whatever it pushed."""
    yield
    client = await connect(stack.endpoints["nats"], "test-policy", credentials=stack_admin(stack.endpoints))
    try:
        installed = Bundle.load()
        await push(client, installed, "test", "restore the installed bundle", signer=operator(stack))
        deadline = time.monotonic() + 10
        while any(r["revision"] != installed.revision for r in await statuses(client)):
            assert time.monotonic() < deadline, await statuses(client)
            await asyncio.sleep(0.05)
    finally:
        await client.close()


async def test_a_pushed_rule_is_enforced_by_every_process_within_two_seconds(
    stack: Stack, tmp_path: Path, restored: None
) -> None:
    def tighten(config: dict[str, Any]) -> None:
        config["tools"]["mcp-sql"]["query"]["max_sql_length"] = 20  # the SQL server
        config["tokens"]["tenant_denied_audiences"] = {"globex": ["mcp-sql"]}  # the registry
        config["memory"]["tenants"] = {"acme": {"deny_pii_in": ["semantic"]}}  # the memory gate

    # ... and the tests' good call, which was longer than the new limit
    bundle_dir = edited_bundle(
        tmp_path, tighten, {'"arguments": {"sql_length": 40}': '"arguments": {"sql_length": 12}'}
    )
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    assert not (await call_mcp(stack, "mcp-sql", token, "query", {"sql": LONG_SQL})).is_error
    memory = stack.token("mcp-memory", tenant="acme", scopes=("memory:write",))
    note = {"text": "Invoices for Q3 go to ap-team@example.com from now on.", "tier": "semantic"}
    assert (await call_mcp(stack, "mcp-memory", memory, "remember", note)).structured_content[
        "status"
    ] == "stored"

    tested = fleet("policy", "test", str(bundle_dir), timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "PASS:" in tested.stdout and "FAIL" not in tested.stdout

    pushed_cli = fleet("policy", "push", str(bundle_dir), "--data-dir", stack.data_dir, timeout=120)
    assert pushed_cli.returncode == 0, pushed_cli.stdout + pushed_cli.stderr
    revision = Bundle.load(bundle_dir).revision
    assert f"pushed revision {revision}" in pushed_cli.stdout

    # Every process reports the new revision, each swapped in within 2 s of the push (one clock).
    client = await connect(stack.endpoints["nats"], "test-policy", credentials=stack_admin(stack.endpoints))
    try:
        pushes = await pushed(client)
        reports = {r["service"]: r for r in await statuses(client)}
    finally:
        await client.close()
    pushed_at = pushes[-1][2]["pushed_at"]
    assert pushes[-1][1].revision == revision
    assert set(reports) >= policy_processes(stack), sorted(reports)
    lags = {name: reports[name]["since"] - pushed_at for name in policy_processes(stack)}
    assert all(reports[name]["revision"] == revision for name in lags), reports
    assert all(0 <= lag <= ENFORCED_WITHIN_S for lag in lags.values()), lags

    # ... and acts on it: the SQL server refuses the longer statement; the registry, the token.
    refused = await call_mcp(stack, "mcp-sql", token, "query", {"sql": LONG_SQL})
    assert refused.is_error and "SQL is longer than 20 characters" in refused.content[0].text
    assert not (await call_mcp(stack, "mcp-sql", token, "query", {"sql": "SELECT 1"})).is_error
    kept_out = (await call_mcp(stack, "mcp-memory", memory, "remember", note)).structured_content
    assert kept_out["status"] == "denied" and kept_out["revision"] == revision
    assert kept_out["reasons"] == ["tenant acme keeps personal data out of semantic memory (EMAIL_ADDRESS)"]
    denied = fleet(
        "token", "--data-dir", stack.data_dir, "--audience", "mcp-sql", "--tenant", "globex",
        "--scope", "sql:query", "--json", timeout=60,
    )  # fmt: skip
    assert denied.returncode != 0, denied.stderr
    error = json.loads(denied.stderr)["error"]  # the refusal as data: ours, and the OAuth code under it
    assert (error["code"], error["details"]["oauth_error"]) == ("forbidden", "invalid_scope"), error

    status = fleet("policy", "status", "--data-dir", stack.data_dir, "--json", timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pushed"] == revision


async def test_a_bundle_that_does_not_compile_or_pass_its_tests_is_refused(
    stack: Stack, tmp_path: Path, restored: None
) -> None:
    before = {r["service"]: r["revision"] for r in await _statuses(stack)}

    broken = edited_bundle(tmp_path / "broken", lambda config: None)
    (broken / "tools.rego").write_text((broken / "tools.rego").read_text() + "\nallow {\n")
    result = fleet("policy", "push", str(broken), "--data-dir", stack.data_dir, timeout=120)
    assert result.returncode == 1 and "does not compile" in result.stderr, result.stderr

    def wrong(config: dict[str, Any]) -> None:
        config["tools"]["mcp-sql"]["query"]["scopes"] = []  # the bundle's own tests say otherwise

    failing = edited_bundle(tmp_path / "failing", wrong)
    result = fleet("policy", "push", str(failing), "--data-dir", stack.data_dir, timeout=120)
    assert result.returncode == 1 and "test(s) of the bundle do not pass" in result.stderr, result.stderr
    assert "test_query_without_scope_is_denied: FAIL" in result.stderr

    # A signed bundle that reaches the bucket without the CLI's checks is refused by every process.
    uncompilable = Bundle.load(broken)
    client = await connect(stack.endpoints["nats"], "test-policy", credentials=stack_admin(stack.endpoints))
    try:
        bucket = await key_value(client, POLICY_BUCKET, history=HISTORY)
        message = bundle_message(uncompilable, "someone", "skipped the checks", signer=operator(stack))
        await bucket.put(BUNDLE_KEY, message)
        deadline = time.monotonic() + 5
        while True:
            reports = {r["service"]: r for r in await statuses(client)}
            refusals = {n: r.get("refused") for n, r in reports.items() if n in policy_processes(stack)}
            assert set(refusals) == policy_processes(stack), sorted(refusals)
            if all(r and r.get("revision") == uncompilable.revision for r in refusals.values()):
                break
            assert time.monotonic() < deadline, refusals
            await asyncio.sleep(0.05)
    finally:
        await client.close()
    assert {n: r["revision"] for n, r in reports.items() if n in before} == before  # the old ones serve
    assert all("does not compile" in r["error"] for r in refusals.values() if r)
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    assert not (await call_mcp(stack, "mcp-sql", token, "query", {"sql": LONG_SQL})).is_error


async def _statuses(stack: Stack) -> list[dict[str, Any]]:
    client = await connect(stack.endpoints["nats"], "test-policy", credentials=stack_admin(stack.endpoints))
    try:
        return await statuses(client)
    finally:
        await client.close()


async def test_a_push_is_rolled_back_and_every_decision_is_in_the_log(
    stack: Stack, tmp_path: Path, restored: None
) -> None:
    installed = Bundle.load()
    client = await connect(stack.endpoints["nats"], "test-policy", credentials=stack_admin(stack.endpoints))
    try:
        await push(client, installed, "test", "the starting point", signer=operator(stack))
    finally:
        await client.close()

    def loosen(config: dict[str, Any]) -> None:
        config["tools"]["mcp-sql"]["query"]["max_sql_length"] = 4500

    edited = edited_bundle(tmp_path, loosen)
    pushed_cli = fleet("policy", "push", str(edited), "--data-dir", stack.data_dir, timeout=120)
    assert pushed_cli.returncode == 0, pushed_cli.stdout + pushed_cli.stderr

    rolled = fleet("policy", "rollback", "--data-dir", stack.data_dir, timeout=120)
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert f"rolled back to revision {installed.revision}" in rolled.stdout
    assert "enforced by" in rolled.stdout
    status = json.loads(fleet("policy", "status", "--data-dir", stack.data_dir, "--json", timeout=60).stdout)
    assert status["pushed"] == installed.revision
    assert {p["revision"] for p in status["processes"]} == {installed.revision}

    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    assert not (await call_mcp(stack, "mcp-sql", token, "query", {"sql": "SELECT 42 AS answer"})).is_error
    deadline = time.monotonic() + 10
    while True:  # the decision log is published in batches, within about 50 ms
        logged = fleet("policy", "log", "--data-dir", stack.data_dir, "--json", "--last", "200", timeout=60)
        assert logged.returncode == 0, logged.stderr
        records = [json.loads(line) for line in logged.stdout.splitlines()]
        tool_calls = [
            r for r in records
            if r["requested_by"] == "mcp-sql" and r["path"] == "fleet/tools/decision"
            and r["bundles"]["fleet"]["revision"] == installed.revision
        ]  # fmt: skip
        if tool_calls:
            break
        assert time.monotonic() < deadline, records[-3:]
        await asyncio.sleep(0.2)
    assert tool_calls[-1]["result"]["allow"] is True and len(tool_calls[-1]["input_sha256"]) == 64


async def handled_by_all(stack: Stack, client: Any, seq: int) -> dict[str, dict[str, Any]]:
    """The reports of the stack's deciding processes once each has handled push ``seq``."""
    deadline = time.monotonic() + 5
    while True:
        reports = {r["service"]: r for r in await statuses(client) if r["service"] in policy_processes(stack)}
        if set(reports) == policy_processes(stack) and all(r["seq"] >= seq for r in reports.values()):
            return reports
        assert time.monotonic() < deadline, reports
        await asyncio.sleep(0.05)


def allow_all() -> Bundle:
    """The installed bundle with every tool call allowed: what an attacker would push."""
    installed = Bundle.load()
    opened = tuple(
        (
            name,
            source.replace('"allow": count(deny) == 0,', '"allow": true,')
            if name == "tools.rego"
            else source,
        )
        for name, source in installed.modules
    )
    assert opened != installed.modules
    return installed.with_modules(opened, "attacker")


async def test_an_allow_all_bundle_written_into_the_bucket_is_enforced_by_no_process(
    stack: Stack, restored: None
) -> None:
    too_long = "SELECT " + ", ".join(f"{i} AS c{i}" for i in range(600))  # beyond the 4000 the rule allows
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    assert (
        "SQL is longer than 4000 characters"
        in (await call_mcp(stack, "mcp-sql", token, "query", {"sql": too_long})).content[0].text
    )
    forged = allow_all()
    # A bootstrap identity gone bad (the registry: the key the fleet trusts most after the operator's)
    # certifies itself and signs; then a plain attacker writes the bundle unsigned.
    registry_key = SigningKey.load_or_create(stack.layout.key_file("registry"))
    self_certified = PolicySigner.author_of(
        registry_key, certify_author(registry_key, "registry", registry_key.public_jwk())
    )
    # As the bootstrap admin (the one identity whose bus rights reach the policy bucket besides the
    # operator's): what it writes is still not believed.
    client = await connect(stack.endpoints["nats"], "attacker", credentials=stack_admin(stack.endpoints))
    try:
        bucket = await key_value(client, POLICY_BUCKET, history=HISTORY)
        for signer, reason in (
            (self_certified, "unauthorized"),
            (PolicySigner.operator(registry_key), "bad_signature"),
            (None, "unsigned"),
        ):
            message = bundle_message(forged, "operator:root", "open everything", signer=signer)
            seq = int(await bucket.put(BUNDLE_KEY, message))
            reports = await handled_by_all(stack, client, seq)
            assert {r["revision"] for r in reports.values()} == {Bundle.load().revision}
            assert {(r["refused"]["revision"], r["refused"]["reason"]) for r in reports.values()} == {
                (forged.revision, reason)
            }
    finally:
        await client.close()
    refused = await call_mcp(
        stack, "mcp-sql", token, "query", {"sql": too_long}
    )  # what the allow-all bundle would run
    assert refused.is_error and "SQL is longer than 4000 characters" in refused.content[0].text

    status = fleet("policy", "status", "--data-dir", stack.data_dir, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"REFUSED  the last push (#{seq}, {forged.revision}): the push is not signed" in status.stdout
    assert f"REFUSED {forged.revision}: the push is not signed" in status.stdout
    as_json = json.loads(fleet("policy", "status", "--data-dir", stack.data_dir, "--json", timeout=60).stdout)
    assert as_json["pushed"] != forged.revision
    assert as_json["refused_push"] == {
        "seq": seq,
        "revision": forged.revision,
        "error": "the push is not signed",
    }


async def test_a_push_signed_by_a_certified_author_is_enforced_and_one_by_an_uncertified_key_is_not(
    stack: Stack, tmp_path: Path, restored: None
) -> None:
    author_key = tmp_path / "alice.pem"
    SigningKey.load_or_create(author_key)
    certificate = tmp_path / "alice.cert"
    certified = fleet(
        "policy", "authorize", "alice", "--key", str(author_key), "--days", "1", "--data-dir", stack.data_dir,
        timeout=60,
    )  # fmt: skip
    assert certified.returncode == 0, certified.stderr
    certificate.write_text(certified.stdout)

    def loosen(config: dict[str, Any]) -> None:
        config["tools"]["mcp-sql"]["query"]["max_sql_length"] = 4400

    bundle_dir = edited_bundle(tmp_path, loosen)
    as_alice = ("--key", str(author_key), "--certificate", str(certificate), "--data-dir", stack.data_dir)
    result = fleet("policy", "push", str(bundle_dir), *as_alice, "--json", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["enforced"] is True
    reports = await _statuses(stack)
    assert {r["author"] for r in reports if r["service"] in policy_processes(stack)} == {"alice"}

    # The same key with a certificate the operator did not make: refused everywhere, exit 1.
    header, payload, _ = certified.stdout.strip().split(".")
    forged = tmp_path / "forged.cert"
    forged.write_text(f"{header}.{payload}.{'A' * 86}")

    def loosen_more(config: dict[str, Any]) -> None:
        config["tools"]["mcp-sql"]["query"]["max_sql_length"] = 4500

    again = edited_bundle(tmp_path / "again", loosen_more)
    as_forger = ("--key", str(author_key), "--certificate", str(forged), "--data-dir", stack.data_dir)
    result = fleet("policy", "push", str(again), *as_forger, timeout=120)
    assert result.returncode == 1 and "the author certificate does not verify" in result.stderr, result.stderr
