"""Attacks on the bus (security review C1, M8, H3), against a real stack whose NATS authenticates
every connection: as an anonymous client, and with each kind of identity's own valid credentials
(a specialist, an MCP server, a worker, the console, a producer). Every attack is refused, nothing
it aimed at changes, and the fleet keeps serving (the last test).

A refused publish or subscription does not raise in the client: the server reports it as a
permissions violation, which :class:`Probe` collects."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import httpx2
import nats
import nats.errors
import nats.js.errors
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from nats.aio.client import Client as NATS

from fleet.keys import SigningKey
from fleet.natsconn import BUS_AUDIENCE, Credentials, connect, inbox_prefix
from fleet.natsjwt import PREFIX_USER, KeyPair
from fleet.tokens import client_assertion
from fleetctl.layout import stack_admin
from fleetctl.testing.e2e import TWO_STEPS, Stack, fleet, send, user_message
from fleetctl.testing.mcp import error_in
from tests.e2e.identities import Impostor

pytestmark = pytest.mark.e2e

VIOLATION_WAIT_S = 3.0


class Probe:
    """A connection made the way an attacker would, which records what the bus refused."""

    def __init__(self) -> None:
        self.errors: asyncio.Queue[str] = asyncio.Queue()
        self.client: NATS | None = None
        self.disconnected = asyncio.Event()

    async def open(self, url: str, **options: Any) -> NATS:
        async def on_error(exc: Exception) -> None:
            await self.errors.put(str(exc).lower())

        async def on_disconnect() -> None:
            self.disconnected.set()

        self.client = NATS()
        await self.client.connect(
            url,
            connect_timeout=5,
            max_reconnect_attempts=options.pop("max_reconnect_attempts", 0),
            allow_reconnect=options.pop("allow_reconnect", False),
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            **options,
        )
        return self.client

    async def refused(self, what: str) -> bool:
        """Whether the bus reported a permissions violation naming ``what`` (lower-cased)."""
        deadline = time.monotonic() + VIOLATION_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                error = await asyncio.wait_for(self.errors.get(), left)
            except TimeoutError:
                return False
            if "permissions violation" in error and what.lower() in error:
                return True
        return False

    async def close(self) -> None:
        if self.client is None:
            return
        if not self.client.is_closed:
            await self.client.close()
        transport = getattr(self.client, "_transport", None)
        if transport is not None:  # a refused connect leaves its socket to the caller
            with contextlib.suppress(Exception):
                transport.close()


def identity_options(principal: str, key: SigningKey) -> dict[str, Any]:
    return Credentials(principal, key=key).connect_options()


def key_of(stack: Stack, identity: str) -> SigningKey:
    return SigningKey.load_or_create(stack.layout.key_file(identity))


@pytest.fixture
async def probe() -> AsyncIterator[Probe]:
    made = Probe()
    yield made
    await made.close()


@pytest.fixture
async def admin(stack: Stack) -> AsyncIterator[NATS]:
    client = await connect(stack.endpoints["nats"], "test-admin", credentials=stack_admin(stack.endpoints))
    yield client
    await client.close()


async def connect_as(probe: Probe, stack: Stack, identity: str) -> NATS:
    return await probe.open(
        stack.endpoints["nats"],
        name=f"attacker-as-{identity}",
        **identity_options(identity, key_of(stack, identity)),
    )


async def refused_connection(stack: Stack, **options: Any) -> bool:
    probe = Probe()
    try:
        await probe.open(stack.endpoints["nats"], **options)
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        return "authorization violation" in str(exc).lower() or isinstance(exc, nats.errors.NoServersError)
    finally:
        await probe.close()
    return False


async def kv_value(admin: NATS, bucket: str, key: str) -> bytes | None:
    kv = await admin.jetstream().key_value(bucket)
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return entry.value


async def attempt(action: Callable[[], Any]) -> None:
    """Run a JetStream call the bus will refuse: it times out in the client (the refusal itself
    arrives as a permissions violation)."""
    with contextlib.suppress(nats.errors.Error, TimeoutError, nats.js.errors.Error):
        await asyncio.wait_for(action(), 2.0)


# ------------------------------------------------------------------------------ anonymous and forged
async def test_an_anonymous_connection_is_refused(stack: Stack) -> None:
    assert await refused_connection(stack, name="anonymous")


async def test_a_made_up_token_is_refused(stack: Stack) -> None:
    assert await refused_connection(stack, name="guess", token="let-me-in")


async def test_an_assertion_signed_by_a_key_nobody_enrolled_is_refused(stack: Stack) -> None:
    stranger = SigningKey.generate()
    assert await refused_connection(stack, name="stranger", **identity_options("worker-1", stranger))


async def test_a_replayed_assertion_is_refused(stack: Stack) -> None:
    key = key_of(stack, "stats")
    captured = Credentials("stats", key=key).assertion()
    first = Probe()
    options = identity_options("stats", key)
    options["token"] = lambda: captured
    await first.open(stack.endpoints["nats"], name="first-use", **options)
    await first.close()
    assert await refused_connection(stack, name="replay", **options)


async def test_an_assertion_without_the_key_that_signs_the_nonce_is_refused(stack: Stack) -> None:
    """A stolen assertion is worth nothing without the key: the server's nonce must be signed."""
    captured = Credentials("stats", key=key_of(stack, "stats")).assertion()
    thief = SigningKey.generate()

    def sign(nonce: str) -> bytes:
        return base64.b64encode(thief.private_key.sign(nonce.encode(), ec.ECDSA(hashes.SHA256())))

    assert await refused_connection(
        stack, name="thief", token=lambda: captured, signature_cb=sign, inbox_prefix=inbox_prefix("stats")
    )


async def test_an_assertion_for_another_audience_is_refused(stack: Stack) -> None:
    key = key_of(stack, "stats")
    now = int(time.time())
    claims = {
        "iss": "stats",
        "sub": "stats",
        "aud": "coordinator",
        "iat": now,
        "exp": now + 60,
        "jti": uuid.uuid4().hex,
    }
    options = identity_options("stats", key)
    options["token"] = lambda: key.sign(claims, typ="bus-assertion+jwt")
    assert await refused_connection(stack, name="wrong-audience", **options)
    assert BUS_AUDIENCE != "coordinator"


# ------------------------------------------------------------------------------ a specialist's own credentials
async def test_a_specialist_cannot_add_a_key_to_the_registry_s_record(
    stack: Stack, probe: Probe, admin: NATS
) -> None:
    client = await connect_as(probe, stack, "stats")
    before = await kv_value(admin, "fleet-registry", "identity.registry")
    await client.publish("$KV.fleet-registry.identity.registry", b'{"forged": true}')
    assert await probe.refused("$kv.fleet-registry.identity.registry")
    assert await kv_value(admin, "fleet-registry", "identity.registry") == before


async def test_a_specialist_cannot_forge_a_revocation(stack: Stack, probe: Probe, admin: NATS) -> None:
    client = await connect_as(probe, stack, "stats")
    await client.publish("$KV.fleet-revocations.kid.forged", b'{"kid": "forged"}')
    assert await probe.refused("$kv.fleet-revocations.kid.forged")
    assert await kv_value(admin, "fleet-revocations", "kid.forged") is None


async def test_a_specialist_cannot_push_a_policy(stack: Stack, probe: Probe, admin: NATS) -> None:
    client = await connect_as(probe, stack, "researcher")
    before = await kv_value(admin, "fleet-policy", "bundle")
    await client.publish("$KV.fleet-policy.bundle", b'{"modules": [], "data": {}, "revision": "allow-all"}')
    assert await probe.refused("$kv.fleet-policy.bundle")
    assert await kv_value(admin, "fleet-policy", "bundle") == before


async def test_a_specialist_cannot_repoint_an_mcp_server(stack: Stack, probe: Probe, admin: NATS) -> None:
    client = await connect_as(probe, stack, "sql-analyst")
    before = await kv_value(admin, "fleet-registry", "mcp.mcp-sql")
    await client.publish("$KV.fleet-registry.mcp.mcp-sql", b'{"url": "http://attacker.example/mcp"}')
    assert await probe.refused("$kv.fleet-registry.mcp.mcp-sql")
    assert await kv_value(admin, "fleet-registry", "mcp.mcp-sql") == before


async def test_a_specialist_cannot_start_runs_by_publishing_events(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "publisher")
    await client.publish("fleet.events.globex.billing.invoice_settled", b'{"id": "forged"}')
    assert await probe.refused("fleet.events.globex.billing.invoice_settled")


async def test_a_specialist_cannot_read_the_signals_stream(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "case-desk")
    await attempt(lambda: client.jetstream().subscribe("fleet.signals.>", ordered_consumer=True))
    assert await probe.refused("$js.api.")


async def test_a_specialist_cannot_subscribe_to_everything(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "stats")
    await client.subscribe(">")
    assert await probe.refused('">"')


async def test_a_specialist_cannot_read_another_identity_s_inbox(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "stats")
    await client.subscribe("_INBOX.worker-1.>")
    assert await probe.refused("_inbox.worker-1.>")


async def test_only_a_worker_follows_the_work_subjects(stack: Stack, probe: Probe) -> None:
    """The workers' doorbell (a core subscription to the work subjects) is theirs alone: run ids of
    every tenant are not for the other roles."""
    client = await connect_as(probe, stack, "stats")
    await client.subscribe("fleet.work.run.*")
    assert await probe.refused("fleet.work.run.*")


async def test_a_specialist_cannot_delete_a_stream(stack: Stack, probe: Probe, admin: NATS) -> None:
    client = await connect_as(probe, stack, "stats")
    await attempt(lambda: client.jetstream().delete_stream("FLEET_WORK"))
    assert await probe.refused("$js.api.stream.delete.fleet_work")
    assert (await admin.jetstream().stream_info("FLEET_WORK")).config.name == "FLEET_WORK"


# ------------------------------------------------------------------------------ an MCP server's own credentials
async def test_an_mcp_server_cannot_read_the_artifacts(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "mcp-sql")
    await attempt(lambda: client.jetstream().object_store("fleet_artifacts"))
    assert await probe.refused("$js.api.stream.info.obj_fleet_artifacts")


async def test_an_mcp_server_cannot_plant_a_sandbox_workspace(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "mcp-cases")
    await client.publish("$KV.fleet_sandbox_workspaces." + "0" * 64, b'{"sha256": "planted"}')
    assert await probe.refused("$kv.fleet_sandbox_workspaces.")


async def test_an_mcp_server_cannot_write_another_server_s_audit(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "mcp-sql")
    await client.publish("fleet.audit.tools.mcp-outbox", b'{"forged": true}')
    assert await probe.refused("fleet.audit.tools.mcp-outbox")


async def test_a_process_cannot_publish_another_s_metrics(stack: Stack, probe: Probe) -> None:
    # The console's charts read fleet.metrics.<process>: a process that forged the coordinator's
    # snapshot could draw any run counts; each publishes under its own name only.
    client = await connect_as(probe, stack, "mcp-sql")
    await client.publish("fleet.metrics.coordinator", b'{"source": "coordinator", "runs": {"failed": 1e9}}')
    assert await probe.refused("fleet.metrics.coordinator")


async def test_a_specialist_publishes_no_metrics_at_all(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "stats")  # enforces no policy: nothing of its is charted
    await client.publish("fleet.metrics.stats", b'{"source": "stats"}')
    assert await probe.refused("fleet.metrics.stats")


# ------------------------------------------------------------------------------ a worker's, the console's
async def test_a_worker_cannot_purge_the_events(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "worker-1")
    await attempt(lambda: client.jetstream().purge_stream("FLEET_EVENTS"))
    assert await probe.refused("$js.api.stream.purge.fleet_events")


async def test_a_worker_cannot_answer_a_gate_with_a_signal(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "worker-2")
    await client.publish(f"fleet.signals.{uuid.uuid4()}", b'{"action": "approve"}')
    assert await probe.refused("fleet.signals.")


async def test_the_console_cannot_submit_work(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "console")
    await client.publish("fleet.work.run", str(uuid.uuid4()).encode())
    assert await probe.refused("fleet.work.run")


async def test_the_console_cannot_reset_run_call_counters(stack: Stack, probe: Probe) -> None:
    client = await connect_as(probe, stack, "console")
    await client.publish("$KV.fleet-run-tool-calls." + "0" * 64, b"0")
    assert await probe.refused("$kv.fleet-run-tool-calls.")


# ------------------------------------------------------------------------------ a producer's
def issue_producer(stack: Stack, tmp_path: Path, name: str, tenant: str, source: str) -> KeyPair:
    seed_file = tmp_path / f"{name}.nk"
    result = fleet(
        "producers", "issue", name, "--tenant", tenant, "--source", source, "--out", str(seed_file),
        "--data-dir", stack.data_dir, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    key = KeyPair.from_seed(seed_file.read_text())
    assert key.prefix == PREFIX_USER
    return key


async def connect_producer(probe: Probe, stack: Stack, name: str, key: KeyPair) -> NATS:
    return await probe.open(
        stack.endpoints["nats"], name=name, nkeys_seed_str=key.seed, inbox_prefix=inbox_prefix(name)
    )


async def test_a_producer_cannot_publish_another_tenant_s_events(
    stack: Stack, probe: Probe, tmp_path: Path
) -> None:
    name = f"billing-{uuid.uuid4().hex[:6]}"
    client = await connect_producer(
        probe, stack, name, issue_producer(stack, tmp_path, name, "acme", "billing")
    )
    await client.publish("fleet.events.globex.billing.invoice_settled", b"{}")
    assert await probe.refused("fleet.events.globex.billing.invoice_settled")


async def test_a_producer_cannot_publish_as_another_source(
    stack: Stack, probe: Probe, tmp_path: Path
) -> None:
    name = f"billing-{uuid.uuid4().hex[:6]}"
    client = await connect_producer(
        probe, stack, name, issue_producer(stack, tmp_path, name, "acme", "billing")
    )
    await client.publish("fleet.events.acme.erp.invoice_settled", b"{}")
    assert await probe.refused("fleet.events.acme.erp.invoice_settled")


async def test_a_producer_cannot_read_the_events(stack: Stack, probe: Probe, tmp_path: Path) -> None:
    name = f"billing-{uuid.uuid4().hex[:6]}"
    client = await connect_producer(
        probe, stack, name, issue_producer(stack, tmp_path, name, "acme", "billing")
    )
    await attempt(lambda: client.jetstream().subscribe("fleet.events.>", ordered_consumer=True))
    assert await probe.refused("$js.api.")


async def test_a_producer_key_nobody_issued_is_refused(stack: Stack) -> None:
    stranger = KeyPair.generate(PREFIX_USER)
    assert await refused_connection(stack, name="stranger", nkeys_seed_str=stranger.seed)


async def test_a_producer_publishes_its_own_tenant_s_events(
    stack: Stack, probe: Probe, tmp_path: Path
) -> None:
    """The same credentials do what they are for (so the refusals above are not a broken bus)."""
    name = f"billing-{uuid.uuid4().hex[:6]}"
    client = await connect_producer(
        probe, stack, name, issue_producer(stack, tmp_path, name, "acme", "billing")
    )
    ack = await client.jetstream().publish(f"fleet.events.acme.billing.probe_{uuid.uuid4().hex[:6]}", b"{}")
    assert ack.stream == "FLEET_EVENTS"
    assert probe.errors.empty()


# ------------------------------------------------------------------------------ revocation
async def revoked_within_two_seconds(stack: Stack, probe: Probe, revocation: str, **credentials: Any) -> None:
    """Connect with ``credentials``, revoke them (``POST revocation`` as the operator): the bus
    closes the connection within 2 s of the request, and the same credentials are refused after."""
    client = await probe.open(
        stack.endpoints["nats"], allow_reconnect=True, max_reconnect_attempts=-1, **credentials
    )
    assert client.is_connected
    token = stack.token("registry", "default", ("registry:admin",))
    async with httpx.AsyncClient(timeout=10.0) as http:
        sent = time.monotonic()
        response = await http.post(
            stack.endpoints["registry"] + revocation,
            json={"reason": "test"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 200, response.text
    await asyncio.wait_for(probe.disconnected.wait(), 5.0)
    assert time.monotonic() - sent < 2.0
    assert await refused_connection(stack, **credentials)


async def test_a_revoked_producer_is_disconnected_within_two_seconds_and_kept_out(
    stack: Stack, probe: Probe, tmp_path: Path
) -> None:
    name = f"revoked-{uuid.uuid4().hex[:6]}"
    key = issue_producer(stack, tmp_path, name, "acme", "billing")
    await revoked_within_two_seconds(
        stack,
        probe,
        f"/v1/producers/{name}/revoke",
        name=name,
        nkeys_seed_str=key.seed,
        inbox_prefix=inbox_prefix(name),
    )


async def test_a_revoked_identity_is_disconnected_within_two_seconds_and_kept_out(
    stack: Stack, probe: Probe, impostor: Impostor
) -> None:
    await revoked_within_two_seconds(
        stack,
        probe,
        f"/v1/keys/{impostor.key.kid}/revoke",
        name=impostor.id,
        **identity_options(impostor.id, impostor.key),
    )


# ------------------------------------------------------------------------------ a service key is no tenant's key
async def own_token(stack: Stack, identity: str, audience: str, tenant: str, scope: str) -> httpx.Response:
    """A client-credentials token request with ``identity``'s own key, for a tenant it chooses."""
    token_url = stack.endpoints["registry"] + "/oauth/token"
    form = {
        "grant_type": "client_credentials",
        "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        "client_assertion": client_assertion(key_of(stack, identity), identity, token_url),
        "audience": audience,
        "tenant": tenant,
        "scope": scope,
    }
    async with httpx.AsyncClient(timeout=10.0) as http:
        return await http.post(token_url, data=form)


@pytest.mark.parametrize(
    ("identity", "audience", "scope"),
    [
        ("researcher", "mcp-memory", "memory:read"),
        ("sql-analyst", "mcp-sql", "sql:query"),
        ("case-desk", "mcp-cases", "cases:write"),
    ],
)
async def test_a_specialist_s_key_gets_no_token_for_a_tenant_of_its_choosing(
    stack: Stack, identity: str, audience: str, scope: str
) -> None:
    response = await own_token(stack, identity, audience, "globex", scope)
    assert response.status_code in (400, 401, 403), response.text
    assert "acts only for its callers" in response.text


async def test_the_console_s_key_gets_no_token_for_the_coordinator(stack: Stack) -> None:
    response = await own_token(stack, "console", "coordinator", "globex", "agent:invoke")
    assert response.status_code in (400, 401, 403), response.text
    assert "acts only for its callers" in response.text


async def test_no_token_is_issued_for_every_tenant(stack: Stack) -> None:
    response = await own_token(stack, "operator", "coordinator", "*", "agent:invoke")
    assert response.status_code in (400, 401, 403), response.text
    assert "never for every tenant" in response.text


# ------------------------------------------------------------------------------ artifacts and workspaces
# The bus lets mcp-sandbox read and write the artifacts bucket and the workspace heads, and
# mcp-outbox read any message of the bucket (a direct get): for every tenant. What makes another
# tenant's artifacts and runs safe from those rights is the tenant key (fleet.tenant_keys), which
# the registry gives a server only with a caller's token of that tenant. Before tenant keys, every
# test here read the plaintext or planted the files.
async def call_tool(stack: Stack, server: str, token: str, tool: str, arguments: dict[str, Any]) -> Any:
    url = stack.endpoints["mcp_servers"][server]
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        return await client.call_tool(tool, arguments)


def structured(result: Any) -> Any:
    assert not result.is_error, result.content
    content: dict[str, Any] = result.structured_content
    return content["result"] if set(content) == {"result"} else content


def victim_token(stack: Stack, run_id: str, tenant: str = "globex") -> str:
    return stack.forge(
        aud="mcp-sandbox", scope="sandbox:run sandbox:list", tenant=tenant, run_id=run_id, sub="sql-analyst"
    )


async def last_seq(client: NATS, stream: str) -> int:
    return int((await client.jetstream().stream_info(stream)).state.last_seq)


async def messages_after(client: NATS, stream: str, after: int) -> list[Any]:
    """Every message of ``stream`` after sequence ``after``, each read by a direct get (``STREAM.MSG.GET``)."""
    js, found = client.jetstream(), []
    for seq in range(after + 1, await last_seq(client, stream) + 1):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            found.append(await js.get_msg(stream, seq))
    return found


@pytest.mark.parametrize("identity", ["mcp-outbox", "mcp-sandbox"])
async def test_an_artifact_server_s_bus_rights_read_only_ciphertext_of_another_tenant(
    stack: Stack, probe: Probe, admin: NATS, identity: str
) -> None:
    secret = f"globex-ledger-{uuid.uuid4().hex}"
    before = await last_seq(admin, "OBJ_fleet_artifacts")
    run = f"run-{uuid.uuid4().hex}"
    code = f"open('ledger.txt', 'w').write({secret!r} * 4); print({secret!r} * 2000)"
    result = structured(
        await call_tool(stack, "mcp-sandbox", victim_token(stack, run), "run_python", {"code": code})
    )
    hashes = {
        uri.removeprefix("artifact:sha256:")
        for uri in (result["files"][0]["artifact"], result["workspace"], result["stdout_artifact"])
    }
    client = await connect_as(probe, stack, identity)
    stolen = await messages_after(client, "OBJ_fleet_artifacts", before)
    assert probe.errors.empty()  # the bus let it read every message: only the seal protects them
    names = [m.subject for m in stolen if ".M." in m.subject]
    assert len(names) >= 3 and len(stolen) > len(names)  # metadata and chunks, all read
    everything = b"".join(m.subject.encode() + (m.data or b"") for m in stolen)
    assert secret.encode() not in everything
    assert not any(digest.encode() in everything for digest in hashes)
    assert b"globex/" in everything  # the tenant's space is named; what is in it is not


def planted_workspace() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        content = b"import os; os.system('curl evil')"
        member = tarfile.TarInfo("planted.py")
        member.size = len(content)
        archive.addfile(member, io.BytesIO(content))
    return buffer.getvalue()


async def new_head(admin: NATS, before: int) -> Any:
    [written] = [m for m in await messages_after(admin, "KV_fleet_sandbox_workspaces", before)]
    return written


async def test_bus_rights_on_the_workspaces_cannot_plant_a_file_in_another_tenant_s_run(
    stack: Stack, probe: Probe, admin: NATS
) -> None:
    run = f"run-{uuid.uuid4().hex}"
    before = await last_seq(admin, "KV_fleet_sandbox_workspaces")
    code = "open('mine.txt', 'w').write('mine')"
    structured(await call_tool(stack, "mcp-sandbox", victim_token(stack, run), "run_python", {"code": code}))
    head = (await new_head(admin, before)).subject.removeprefix("$KV.fleet_sandbox_workspaces.")
    # With mcp-sandbox's own bus credentials: a workspace of its own making, stored as the server
    # stores artifacts without a key, and the run's head (the one just written, and where it was
    # kept before tenant keys) moved to it.
    client = await connect_as(probe, stack, "mcp-sandbox")
    js = client.jetstream()
    tar = planted_workspace()
    digest = hashlib.sha256(tar).hexdigest()
    await (await js.object_store("fleet_artifacts")).put(f"globex/{digest}", tar)
    forged = json.dumps({"sha256": digest, "size": len(tar), "run_id": run, "at": time.time()}).encode()
    heads = await js.key_value("fleet_sandbox_workspaces")
    for key in {head, hashlib.sha256(f"globex\x00{run}".encode()).hexdigest()}:
        await heads.put(key, forged)
    assert probe.errors.empty()
    # The run's next calls do not start from it: they are refused, and nothing planted runs.
    listed = await call_tool(stack, "mcp-sandbox", victim_token(stack, run), "workspace_files", {})
    ran = await call_tool(
        stack,
        "mcp-sandbox",
        victim_token(stack, run),
        "run_python",
        {"code": "import os; print(os.listdir())"},
    )
    for answer in (listed, ran):
        assert "planted" not in str(answer.content)  # before tenant keys: planted.py was there
        assert error_in(answer).code == "integrity_failed", answer.content


async def test_a_sealed_head_copied_to_another_run_of_the_tenant_is_refused(
    stack: Stack, probe: Probe, admin: NATS
) -> None:
    runs, heads = [f"run-{uuid.uuid4().hex}" for _ in range(2)], []
    for run, name in zip(runs, ("first.txt", "second.txt"), strict=True):
        before = await last_seq(admin, "KV_fleet_sandbox_workspaces")
        code = f"open({name!r}, 'w').write('x')"
        structured(
            await call_tool(stack, "mcp-sandbox", victim_token(stack, run), "run_python", {"code": code})
        )
        heads.append(await new_head(admin, before))
    client = await connect_as(probe, stack, "mcp-sandbox")
    bucket = await client.jetstream().key_value("fleet_sandbox_workspaces")
    await bucket.put(heads[1].subject.removeprefix("$KV.fleet_sandbox_workspaces."), heads[0].data)
    listed = await call_tool(stack, "mcp-sandbox", victim_token(stack, runs[1]), "workspace_files", {})
    assert "first.txt" not in str(listed.content)  # before tenant keys: the first run's files
    assert error_in(listed).code == "integrity_failed", listed.content
    # The first run is untouched.
    first = await call_tool(stack, "mcp-sandbox", victim_token(stack, runs[0]), "workspace_files", {})
    assert [f["path"] for f in structured(first)] == ["first.txt"]


# ------------------------------------------------------------------------------ and the fleet still serves
async def test_the_fleet_keeps_serving_after_the_attacks(stack: Stack) -> None:
    outcome = await send(stack, user_message(data=TWO_STEPS), token=stack.token("coordinator"))
    assert outcome.state_name == "TASK_STATE_COMPLETED", outcome
