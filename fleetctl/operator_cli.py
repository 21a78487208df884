"""Operator commands that talk to a running stack: ``down``, ``status``, ``token``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import httpx

from deploy.local_stack import OPERATOR_ID
from fleet import transport
from fleet.errors import ErrorCode, FleetError
from fleet.issuer_certs import certify_issuer_key
from fleet.keys import SigningKey
from fleetctl import stacklock
from fleetctl.cli_common import EXIT_FAILED as EXIT_FAILED  # re-exported: other commands use them
from fleetctl.cli_common import (
    EXIT_NO_OP,
    ServiceClient,
    emit,
    operator_bus_credentials,
    operator_client,
    operator_token_client,
    remote,
    running_endpoints,
    stack_running,
)
from fleetctl.cli_common import EXIT_NOT_RUNNING as EXIT_NOT_RUNNING
from fleetctl.cli_common import EXIT_OK as EXIT_OK
from fleetctl.cli_common import EXIT_USAGE as EXIT_USAGE
from fleetctl.layout import StackLayout

DOWN_TIMEOUT_S = 60.0


def down(layout: StackLayout, *, as_json: bool = False) -> int:
    """Ask the supervisor holding the data dir's lock to stop, and wait until it has."""
    if remote(layout):
        raise FleetError(
            ErrorCode.INVALID_REQUEST,
            f"{layout.home} names a deployment that runs elsewhere: stop it with its own tooling",
        )
    pid = stacklock.holder(layout.lock_file)
    if pid is None:
        text = f"fleet: no stack is running on {layout.home}"
        emit(
            {"data_dir": str(layout.home), "stopped": False, "was_running": False}, as_json=as_json, text=text
        )
        return EXIT_OK
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while stack_running(layout):
        if time.monotonic() > deadline:
            raise FleetError(ErrorCode.STACK_FAILED, f"the supervisor (pid {pid}) did not stop in time")
        time.sleep(0.1)
    text = f"fleet: stopped the stack on {layout.home}"
    emit({"data_dir": str(layout.home), "stopped": True, "was_running": True}, as_json=as_json, text=text)
    return EXIT_OK


def print_enrollment_token(
    layout: StackLayout,
    identity: str,
    kind: str,
    scopes: list[str],
    tenants: list[str],
    *,
    skills: Sequence[str] = (),
    external: bool,
    as_json: bool = False,
) -> int:
    """Print a one-time enrollment token for ``identity``, signed with the operator key of the data
    dir: whoever holds it may enroll one key under that id, with those scopes and tenants, and
    serve a card offering those ``skills`` (none: its card may offer none)."""
    from deploy.enrollment import enrollment_token
    from deploy.local_stack import ServiceKind, ServiceSpec

    key_file = layout.key_file(OPERATOR_ID)
    if not key_file.exists():
        raise FleetError(ErrorCode.STACK_NOT_RUNNING, f"no operator key in {layout.keys_dir} (fleet up)")
    if not tenants:
        raise FleetError(ErrorCode.INVALID_REQUEST, "name at least one --tenant (or '*')")
    if any(not skill.strip() for skill in skills):
        raise FleetError(ErrorCode.INVALID_REQUEST, "a --skill names a skill id")
    spec = ServiceSpec(
        identity,
        cast("ServiceKind", kind),
        "",
        scopes=tuple(scopes),
        tenants=tuple(tenants),
        skills=tuple(skills),
    )
    minted = enrollment_token(SigningKey.load_or_create(key_file), spec, external=external)
    emit(
        {"enrollment_token": minted, "identity": identity, "kind": kind, "skills": sorted(set(skills))},
        as_json=as_json,
        text=minted,
    )
    return EXIT_OK


async def token(
    layout: StackLayout, audience: str, tenant: str, scopes: list[str], *, as_json: bool = False
) -> int:
    """Print a short-lived access token for the operator identity (``fleet token``)."""
    endpoints = running_endpoints(layout)
    async with httpx.AsyncClient(event_hooks=transport.hooks()) as http:
        client = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
        bearer = await client.token(audience, tenant, scopes)
    emit(
        {"token": bearer, "audience": audience, "tenant": tenant, "scopes": scopes},
        as_json=as_json,
        text=bearer,
    )
    return EXIT_OK


def export_run(layout: StackLayout, run_id: str, out_dir: Path, tenant: str, *, as_json: bool = False) -> int:
    """Write the debug bundle of ``run_id`` into ``out_dir`` (``EXPLAIN.md`` first to read)."""
    body = asyncio.run(_fetch_debug_bundle(layout, run_id, tenant))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, content in body["files"].items():
        (out_dir / name).write_text(content)
    run = body["run"]
    files = sorted(body["files"])
    emit(
        {"run": run, "dir": str(out_dir), "files": files},
        as_json=as_json,
        text=f"run {run_id}: {run['state']}{' (' + run['reason'] + ')' if run['reason'] else ''}\n"
        f"wrote {', '.join(files)} to {out_dir}",
    )
    return EXIT_OK


async def _fetch_debug_bundle(layout: StackLayout, run_id: str, tenant: str) -> dict[str, Any]:
    async with operator_client(layout, "coordinator", tenant, ("agent:invoke", "runs:admin")) as api:
        try:
            return await api.get(f"/v1/runs/{run_id}/debug-bundle")
        except FleetError as exc:
            if exc.code == ErrorCode.NOT_FOUND:
                raise FleetError(ErrorCode.NOT_FOUND, f"no run {run_id} for tenant {tenant}") from exc
            raise


async def resolve_operation(
    layout: StackLayout,
    run_id: str,
    op_id: str,
    verdict: str,
    result: str,
    note: str,
    tenant: str,
    *,
    as_json: bool = False,
) -> int:
    """Give a person's answer for an operation that needs one; the run then resumes."""
    try:
        parsed = json.loads(result)
    except json.JSONDecodeError as exc:
        raise FleetError(ErrorCode.INVALID_REQUEST, "--result must be JSON") from exc
    body = {"verdict": verdict, "result": parsed, "note": note}
    answer = await _post_for_run(layout, tenant, f"/v1/runs/{run_id}/operations/{op_id}/resolve", body)
    text = f"operation {op_id}: {answer['operation']['status']}; run {run_id} resumes"
    emit(answer, as_json=as_json, text=text)
    return EXIT_OK


async def decide(
    layout: StackLayout,
    run_id: str,
    decision: str,
    limits: dict[str, float],
    note: str,
    tenant: str,
    *,
    as_json: bool = False,
) -> int:
    """A person's decision for a run that waits on one (a spent budget); the run then resumes."""
    body: dict[str, Any] = {"decision": decision, "note": note, **({"limits": limits} if limits else {})}
    answer = await _post_for_run(layout, tenant, f"/v1/runs/{run_id}/decision", body)
    emit(answer, as_json=as_json, text=f"run {run_id}: {decision}; it resumes ({answer['run']['state']})")
    return EXIT_OK


async def keys(layout: StackLayout, command: str, kid: str, reason: str, *, as_json: bool = False) -> int:
    """``fleet keys revoke KID``, ``fleet keys rotate-registry``, ``fleet keys revoked``, as the
    operator (scope ``registry:admin``)."""
    async with operator_client(layout, "registry", "default", ("registry:admin", "registry:read")) as api:
        if command == "revoke":
            answer = await api.post(f"/v1/keys/{kid}/revoke", {"reason": reason})
        elif command == "rotate-registry":
            answer = await _rotate_registry_key(layout, api)
        else:
            answer = await api.get("/v1/revocations")
    emit(answer, as_json=as_json, text=_keys_text(command, answer))
    return EXIT_OK


async def _rotate_registry_key(layout: StackLayout, api: ServiceClient) -> dict[str, Any]:
    """The registry's two steps: it makes a pending key; the operator (the key of the data dir)
    certifies it; the registry signs with it from then on."""
    pending: dict[str, Any] = await api.post("/v1/issuer/rotate", {})
    operator = SigningKey.load_or_create(layout.key_file(OPERATOR_ID))
    cert = certify_issuer_key(operator, str(pending["issuer"]), pending["public_jwk"])
    answer: dict[str, Any] = await api.post("/v1/issuer/certificate", {"certificate": cert})
    return answer


def _keys_text(command: str, answer: dict[str, Any]) -> str:
    if command == "revoke":
        return f"revoked {answer['kid']} (of {answer['identity']}): every service refuses it from now on"
    if command == "rotate-registry":
        return f"the registry signs with {answer['kid']}; {', '.join(answer['retiring'])} verifies until its grace ends"
    return "\n".join(f"{r['kid']}  {r['identity']}  by {r['by']}  {r['reason']}" for r in answer["revoked"])


async def send_signal(
    layout: StackLayout, run_id: str, body: dict[str, Any], tenant: str, *, as_json: bool = False
) -> int:
    """Send a signal for a run as the operator (approve, reject, extend); exit 0 if it was
    applied (a repeat of a signal id gets its first answer again), 4 if it was a recorded no-op."""
    answer = await _post_for_run(
        layout,
        tenant,
        f"/v1/runs/{run_id}/signals",
        body,
        scopes=("agent:invoke", "runs:approve", "runs:admin"),
    )
    if answer["applied"]:
        again = " (this signal was received before: nothing new happened)" if answer["repeated"] else ""
        text = f"run {run_id}: {body['action']} applied to {answer['awaited'] or 'the run'}{again}"
        emit(answer, as_json=as_json, text=text)
        return EXIT_OK
    reasons = "; ".join(answer.get("reasons", []))
    text = f"run {run_id}: {body['action']} changed nothing ({answer['outcome']}: {reasons})"
    emit(answer, as_json=as_json, text=text)
    return EXIT_NO_OP


async def _post_for_run(
    layout: StackLayout,
    tenant: str,
    path: str,
    body: dict[str, Any],
    scopes: tuple[str, ...] = ("agent:invoke", "runs:resolve", "runs:admin"),
) -> dict[str, Any]:
    """POST ``body`` to the coordinator's run API as the operator (with ``scopes``): the answer;
    the service's refusal is raised as FleetError."""
    async with operator_client(layout, "coordinator", tenant, scopes) as api:
        return await api.post(path, body)


async def publish_event(
    layout: StackLayout,
    subject: str,
    data: str,
    event_id: str | None,
    tenant: str,
    type_: str,
    source: str,
    *,
    as_json: bool = False,
) -> int:
    """Publish an event on the stack's NATS (``fleet events publish``): on the logical ``subject``
    (``fleet.events.<name>...``), sent on ``fleet.events.<tenant>.<source>.<name>...``."""
    from fleet.events import event_message, publish_message
    from fleet.natsconn import connect, stream_replicas

    endpoints = running_endpoints(layout)
    try:
        parsed = json.loads(data)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "--data must be a JSON object")
    message = event_message(
        subject, tenant=tenant, source=source, type_=type_, data=parsed, event_id=event_id
    )
    client = await connect(
        endpoints["nats"],
        "fleet-cli",
        replicas=stream_replicas(endpoints),
        credentials=operator_bus_credentials(endpoints),
    )
    try:
        kept = await publish_message(client, message)
    finally:
        await client.drain()
    text = f"event {message.id} on {message.subject}: {'published' if kept else 'a duplicate (dropped by the stream)'}"
    emit(
        {"event_id": message.id, "subject": subject, "nats_subject": message.subject, "published": kept},
        as_json=as_json,
        text=text,
    )
    return EXIT_OK


async def status(layout: StackLayout, *, as_json: bool) -> int:
    endpoints = layout.read_endpoints()
    running = endpoints is not None and stack_running(layout)
    report: dict[str, Any] = {"data_dir": str(layout.home), "running": running, "services": {}}
    if not running or endpoints is None:
        _print_status(report, as_json)
        return EXIT_NOT_RUNNING
    async with httpx.AsyncClient(timeout=3.0) as http:
        checks = await asyncio.gather(*(_health(http, url) for url in endpoints["services"].values()))
        report["services"] = dict(zip(endpoints["services"], checks, strict=True))
        report["endpoints"] = endpoints
        report["registry"] = await _registry_view(layout, endpoints["registry"], http)
    healthy = all(check["healthy"] for check in report["services"].values())
    report["healthy"] = healthy
    _print_status(report, as_json)
    return EXIT_OK if healthy else EXIT_FAILED


async def _health(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    try:
        response = await http.get(url + "/healthz")
    except httpx.HTTPError as exc:
        return {"url": url, "healthy": False, "detail": type(exc).__name__}
    return {"url": url, "healthy": response.status_code == 200, "detail": response.json().get("status")}


async def _registry_view(layout: StackLayout, registry_url: str, http: httpx.AsyncClient) -> dict[str, Any]:
    try:
        client = operator_token_client(layout, registry_url + "/oauth/token", http)
        bearer = await client.token("registry", "default", ["registry:read"])
        response = await http.get(registry_url + "/v1/records", headers={"Authorization": f"Bearer {bearer}"})
        response.raise_for_status()
    except (httpx.HTTPError, FleetError) as exc:
        return {"error": str(exc)}
    view: dict[str, Any] = response.json()
    return view


def _print_status(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2))
        return
    if not report["running"]:
        print(f"no stack is running on {report['data_dir']}")
        return
    print(f"stack on {report['data_dir']}: {'healthy' if report['healthy'] else 'DEGRADED'}")
    for name, check in report["services"].items():
        mark = "up  " if check["healthy"] else "DOWN"
        print(f"  {mark} {name:<14} {check['url']}")
    registry = report.get("registry", {})
    if "error" in registry:
        print(f"  registry: {registry['error']}")
        return
    for agent in registry.get("agents", []):
        skills = ", ".join(s["id"] for s in agent.get("skills", []))
        print(f"  agent {agent['id']:<14} {agent.get('kind', ''):<12} {agent.get('status', '')} {skills}")
    for server in registry.get("mcp_servers", []):
        print(f"  mcp   {server['id']:<14} {server['url']}")
