"""The tool plane on a running stack: the SQL, sandbox and outbox MCP servers as a caller meets them,
over Streamable HTTP with real tokens."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import shutil
import uuid
from pathlib import Path

import pytest

from fleetctl.testing.e2e import Stack, start_stack, stop_stack
from fleetctl.testing.mcp import call, error_in, logged, ok
from tests.e2e.webhooks import SECRET, WebhookReceiver
from tests.memwatch import PeakGrowth

pytestmark = pytest.mark.e2e


def sandbox_token(stack: Stack, run_id: str, tenant: str = "acme") -> str:
    return stack.forge(
        aud="mcp-sandbox", scope="sandbox:run sandbox:list", tenant=tenant, run_id=run_id, sub="sql-analyst"
    )


async def test_the_sql_server_keeps_a_tenant_in_even_when_the_statement_sets_another(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    hostile = (
        "WITH s AS MATERIALIZED (SELECT set_config('fleet.tenant', 'globex', true))"
        " SELECT DISTINCT i.tenant_id FROM s, tenant_data.invoices i"
    )
    refused = await call(stack, "mcp-sql", token, "query", {"sql": hostile})
    assert (
        error_in(refused).code == "sql_refused"
        and "the statement uses function set_config" in error_in(refused).message
    )
    plain = "SELECT DISTINCT tenant_id FROM tenant_data.invoices"
    assert ok(await call(stack, "mcp-sql", token, "query", {"sql": plain}))["rows"] == [["acme"]]


async def test_the_sql_server_refuses_a_giant_value_before_it_reaches_its_process(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query",))
    ok(await call(stack, "mcp-sql", token, "query", {"sql": "SELECT 1"}))  # the tenant's pool is open
    with PeakGrowth(stack.endpoints["processes"]["mcp-sql"]) as growth:
        result = await call(stack, "mcp-sql", token, "query", {"sql": "SELECT repeat('x', 30000000) AS big"})
    assert error_in(result).code == "result_too_large", result.content
    assert growth.mib < 30, f"mcp-sql grew by {growth.mib} MiB"


async def test_the_sql_server_is_read_only_unless_the_operator_opens_a_table(stack: Stack) -> None:
    token = stack.token("mcp-sql", tenant="acme", scopes=("sql:query", "sql:write"))
    result = await call(
        stack,
        "mcp-sql",
        token,
        "execute",
        {"sql": "UPDATE tenant_data.invoices SET amount = 0", "idempotency_key": "k-" + uuid.uuid4().hex},
    )
    assert result.is_error and "permission denied" in result.content[0].text


async def test_a_file_written_by_one_call_is_there_for_the_next_call_of_the_run_only(stack: Stack) -> None:
    run, other = "run-" + uuid.uuid4().hex, "run-" + uuid.uuid4().hex
    first = ok(
        await call(
            stack,
            "mcp-sandbox",
            sandbox_token(stack, run),
            "run_python",
            {"code": "open('data.csv', 'w').write('a,b\\n1,2\\n'); print('written')"},
        )
    )
    assert first["stdout"] == "written\n" and first["exit_code"] == 0, first
    assert [f["path"] for f in first["files"]] == ["data.csv"]
    again = ok(
        await call(
            stack,
            "mcp-sandbox",
            sandbox_token(stack, run),
            "run_python",
            {"code": "print(open('data.csv').read().splitlines()[1])"},
        )
    )
    assert again["stdout"] == "1,2\n" and again["files"] == [], again
    elsewhere = ok(
        await call(
            stack,
            "mcp-sandbox",
            sandbox_token(stack, other),
            "run_python",
            {"code": "import os; print(os.listdir('.'))"},
        )
    )
    assert elsewhere["stdout"] == "[]\n", elsewhere
    same_run_other_tenant = ok(
        await call(
            stack,
            "mcp-sandbox",
            sandbox_token(stack, run, tenant="globex"),
            "run_python",
            {"code": "import os; print(os.listdir('.'))"},
        )
    )
    assert same_run_other_tenant["stdout"] == "[]\n"
    # The file came back as an artifact of the tenant, readable by the tenant only.
    artifact = first["files"][0]["artifact"]
    content = ok(
        await call(stack, "mcp-sandbox", sandbox_token(stack, run), "read_artifact", {"artifact": artifact})
    )
    assert content["text"] == "a,b\n1,2\n"
    refused = await call(
        stack,
        "mcp-sandbox",
        sandbox_token(stack, other, tenant="globex"),
        "read_artifact",
        {"artifact": artifact},
    )
    assert error_in(refused).code == "not_found"


async def test_long_output_comes_back_as_an_artifact(stack: Stack) -> None:
    token = sandbox_token(stack, "run-" + uuid.uuid4().hex)
    result = ok(await call(stack, "mcp-sandbox", token, "run_python", {"code": "print('x' * 100000)"}))
    assert len(result["stdout"]) < 100000 and result["stdout_artifact"], result
    whole = ok(
        await call(
            stack,
            "mcp-sandbox",
            token,
            "read_artifact",
            {"artifact": result["stdout_artifact"], "length": 200000},
        )
    )
    assert whole["size"] == 100001 and whole["text"] == "x" * 100000 + "\n"


async def test_the_sandbox_needs_its_scope(stack: Stack) -> None:
    token = stack.forge(aud="mcp-sandbox", scope="sql:query", run_id="r")
    result = await call(stack, "mcp-sandbox", token, "run_python", {"code": "print(1)"})
    assert result.is_error and "lacks scope sandbox:run" in result.content[0].text
    # Listing is a scope of its own: a lister (the coordinator, for a debug bundle) neither runs
    # code nor reads what a file holds, and a runner lists nothing without it.
    lister = stack.forge(aud="mcp-sandbox", scope="sandbox:list", run_id="r")
    ran = await call(stack, "mcp-sandbox", lister, "run_python", {"code": "print(1)"})
    assert ran.is_error and "lacks scope sandbox:run" in ran.content[0].text
    read = await call(
        stack, "mcp-sandbox", lister, "read_artifact", {"artifact": "artifact:sha256:" + "0" * 64}
    )
    assert read.is_error and "lacks scope sandbox:run" in read.content[0].text
    assert ok(await call(stack, "mcp-sandbox", lister, "workspace_files", {})) == []
    runner = stack.forge(aud="mcp-sandbox", scope="sandbox:run", run_id="r")
    listed = await call(stack, "mcp-sandbox", runner, "workspace_files", {})
    assert listed.is_error and "lacks scope sandbox:list" in listed.content[0].text


MEMORY_BOMB = """
import os, time
children = []
for _ in range(5):
    pid = os.fork()
    if pid == 0:
        blocks = [b"\\x01" * (10 * 1024 * 1024) for _ in range(30)]  # 300 MB each, every page touched
        time.sleep(3)  # all five hold theirs at once (a child that exits at once frees its share)
        os._exit(0)
    children.append(pid)
print([os.waitpid(pid, 0)[1] for pid in children])
open("after.txt", "w").write("bomb")
"""


async def test_a_memory_bomb_across_processes_fails_the_call_with_sandbox_oom(stack: Stack) -> None:
    run = "run-" + uuid.uuid4().hex
    token = sandbox_token(stack, run)
    ok(await call(stack, "mcp-sandbox", token, "run_python", {"code": "open('before.txt', 'w').write('x')"}))
    # 5 x 300 MB: each process is under its 512 MiB address space, together over the call's 1 GiB
    bomb = await call(stack, "mcp-sandbox", token, "run_python", {"code": MEMORY_BOMB, "timeout_s": 20})
    assert error_in(bomb).code == "sandbox_oom" and "the call used more than" in error_in(bomb).message, (
        bomb.content
    )
    await logged(stack, "mcp-sandbox", "sandbox call of acme/sql-analyst refused: sandbox_oom")
    after = ok(
        await call(stack, "mcp-sandbox", token, "run_python", {"code": "import os; print(os.listdir())"})
    )
    assert after["stdout"] == "['before.txt']\n", after  # the workspace as before the failed call


def outbox_token(stack: Stack, tenant: str = "acme") -> str:
    return stack.forge(aud="mcp-outbox", scope="outbox:write", tenant=tenant, sub="case-desk")


async def test_one_operation_id_makes_one_webhook_however_often_it_is_called(
    stack: Stack, webhooks: WebhookReceiver
) -> None:
    op = "op-" + uuid.uuid4().hex
    args = {"operation_id": op, "destination": "ops", "payload": {"report": "weekly", "n": 3}}
    first = ok(await call(stack, "mcp-outbox", outbox_token(stack), "post_webhook", args))
    assert (first["status"], first["replayed"]) == ("done", False), first
    repeats = await asyncio.gather(
        *(call(stack, "mcp-outbox", outbox_token(stack), "post_webhook", args) for _ in range(4))
    )
    assert all(ok(r)["replayed"] for r in repeats)
    sent = [d for d in webhooks.to("/ok/ops") if d.json["operation_id"] == op]
    assert len(sent) == 1
    delivery = sent[0]
    assert delivery.headers["Idempotency-Key"] == op and delivery.json["payload"] == args["payload"]
    expected = "sha256=" + hmac.new(SECRET.encode(), delivery.body, hashlib.sha256).hexdigest()
    assert delivery.headers["X-Fleet-Signature"] == expected
    status = ok(
        await call(stack, "mcp-outbox", outbox_token(stack), "operation_status", {"operation_id": op})
    )
    assert (status["status"], status["attempts"]) == ("done", 1)
    other_tenant = ok(
        await call(
            stack, "mcp-outbox", outbox_token(stack, "globex"), "operation_status", {"operation_id": op}
        )
    )
    assert other_tenant["status"] == "unknown"


async def test_concurrent_first_calls_of_one_operation_make_one_effect(
    stack: Stack, webhooks: WebhookReceiver
) -> None:
    op = "op-" + uuid.uuid4().hex
    args = {"operation_id": op, "destination": "ops", "payload": {"race": True}}
    results = [
        ok(r)
        for r in await asyncio.gather(
            *(call(stack, "mcp-outbox", outbox_token(stack), "post_webhook", args) for _ in range(6))
        )
    ]
    assert sorted(r["replayed"] for r in results) == [False] + [True] * 5
    assert len([d for d in webhooks.to("/ok/ops") if d.json["operation_id"] == op]) == 1
    ticket_args = {"operation_id": "t-" + uuid.uuid4().hex, "title": "Outlier", "body": "Invoice 9800"}
    tickets = [
        ok(r)
        for r in await asyncio.gather(
            *(call(stack, "mcp-outbox", outbox_token(stack), "open_ticket", ticket_args) for _ in range(4))
        )
    ]
    assert len({t["result"]["ticket_id"] for t in tickets}) == 1


async def test_an_operation_id_cannot_be_reused_for_another_request(stack: Stack) -> None:
    op = "op-" + uuid.uuid4().hex
    ok(
        await call(
            stack,
            "mcp-outbox",
            outbox_token(stack),
            "post_webhook",
            {"operation_id": op, "destination": "ops", "payload": {"v": 1}},
        )
    )
    reused = await call(
        stack,
        "mcp-outbox",
        outbox_token(stack),
        "post_webhook",
        {"operation_id": op, "destination": "ops", "payload": {"v": 2}},
    )
    assert error_in(reused).code == "conflict"


async def test_a_destination_that_needs_approval_waits_for_a_grant_and_a_self_asserted_one_does_nothing(
    stack: Stack, webhooks: WebhookReceiver
) -> None:
    op = "op-" + uuid.uuid4().hex
    args = {"operation_id": op, "destination": "customers", "payload": {"notice": "refund"}}
    token = stack.forge(
        aud="mcp-outbox", scope="outbox:write", tenant="acme", sub="case-desk", run_id="run-tp"
    )
    pending = ok(await call(stack, "mcp-outbox", token, "post_webhook", args))
    assert pending["status"] == "pending_approval"
    assert pending["approval_request"]["arguments"] == args
    assert [d for d in webhooks.to("/ok/customers") if d.json["operation_id"] == op] == []
    status = ok(await call(stack, "mcp-outbox", token, "operation_status", {"operation_id": op}))
    assert status["status"] == "pending_approval"
    # This used to send the webhook and record "alice" as the approver: a caller's own word for
    # its approval is no approval now (only the registry's grant for this very call is).
    asserted = await call(
        stack, "mcp-outbox", token, "post_webhook", {**args, "approval_id": "ap-1", "approved_by": "alice"}
    )
    assert asserted.is_error or ok(asserted)["status"] == "pending_approval"
    invented = await call(stack, "mcp-outbox", token, "post_webhook", {**args, "approval_grant": "ap-1"})
    assert error_in(invented).code == "approval_invalid"
    assert [d for d in webhooks.to("/ok/customers") if d.json["operation_id"] == op] == []
    status = ok(await call(stack, "mcp-outbox", token, "operation_status", {"operation_id": op}))
    assert status["status"] == "pending_approval"


async def test_a_destination_that_is_down_leaves_the_operation_pending_for_a_retry(stack: Stack) -> None:
    op = "op-" + uuid.uuid4().hex
    result = await call(
        stack,
        "mcp-outbox",
        outbox_token(stack),
        "post_webhook",
        {"operation_id": op, "destination": "down", "payload": {}},
    )
    assert result.is_error and "still pending" in result.content[0].text
    status = ok(
        await call(stack, "mcp-outbox", outbox_token(stack), "operation_status", {"operation_id": op})
    )
    assert status["status"] == "pending"
    refused = ok(
        await call(
            stack,
            "mcp-outbox",
            outbox_token(stack),
            "post_webhook",
            {"operation_id": "op-" + uuid.uuid4().hex, "destination": "refusing", "payload": {}},
        )
    )
    assert refused["status"] == "failed" and refused["result"]["http_status"] == 422
    unknown = await call(
        stack,
        "mcp-outbox",
        outbox_token(stack),
        "post_webhook",
        {"operation_id": op, "destination": "https://evil.example/steal", "payload": {}},
    )
    assert unknown.is_error and "no destination" in unknown.content[0].text


async def test_a_workspace_survives_a_restart_of_the_sandbox_server_and_its_local_state(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "fleet"
    stack = await asyncio.to_thread(start_stack, data_dir)
    run = "run-" + uuid.uuid4().hex
    try:
        written = ok(
            await call(
                stack,
                "mcp-sandbox",
                sandbox_token(stack, run),
                "run_python",
                {"code": "import os; os.makedirs('out'); open('out/model.txt', 'w').write('v1')"},
            )
        )
        assert written["exit_code"] == 0, written
    finally:
        await asyncio.to_thread(stop_stack, stack)
    # Another machine: none of the sandbox server's local state is left.
    shutil.rmtree(stack.layout.home / "state" / "mcp-sandbox", ignore_errors=True)
    stack = await asyncio.to_thread(start_stack, data_dir)
    try:
        read = ok(
            await call(
                stack,
                "mcp-sandbox",
                sandbox_token(stack, run),
                "run_python",
                {"code": "print(open('out/model.txt').read())"},
            )
        )
        assert read["stdout"] == "v1\n", read
        files = ok(await call(stack, "mcp-sandbox", sandbox_token(stack, run), "workspace_files", {}))
        assert [f["path"] for f in files] == ["out/model.txt"]
    finally:
        await asyncio.to_thread(stop_stack, stack)
