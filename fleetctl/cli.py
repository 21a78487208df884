"""The ``fleet`` command: the parsers and their wiring; each command lives in its own module.

Exit codes scripts can rely on are one table, :mod:`fleetctl.cli_common` (0 done, 1 failed, 2 bad usage,
3 no stack, 4 a no-op signal, 5 not found, 6 refused, 7/8/9 the run ended failed/canceled/rejected,
130 interrupted).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deploy.manifest import MANIFEST_NAME, FleetManifest
from deploy.manifest import load as load_manifest
from fleet.errors import ErrorCode, FleetError
from fleet.settings import FleetSettings
from fleet.vocabulary import SignalAction
from fleetctl import logs_cli
from fleetctl.cli_common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, report_error
from fleetctl.detached import print_endpoints, up_detached
from fleetctl.help import with_examples
from fleetctl.layout import StackLayout
from fleetctl.serving import serve


def _with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--data-dir", type=Path, default=None, help="default: $FLEET_HOME or .fleet")
    return p


def _with_json(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--json", action="store_true", help="print one JSON document (errors too, on stderr)")
    return p


def _with_signing(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Who signs a policy push: the data dir's operator key, or an author's (both options)."""
    p.add_argument(
        "--key", type=Path, default=None, help="an author's private key (PEM); default: the operator's"
    )
    p.add_argument(
        "--certificate",
        type=Path,
        default=None,
        help="the operator's certificate for that key (policy authorize)",
    )
    return p


def _with_tenant(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--tenant", default="default", help="the tenant the run belongs to")
    return p


def _run_read_parsers(runs_sub: Any) -> None:
    """``fleet runs list|show|events|cancel`` (see :mod:`fleetctl.runs_cli`)."""
    listing = _with_json(_with_tenant(_with_dir(runs_sub.add_parser("list", help="the tenant's runs"))))
    listing.add_argument("--state", default=None, help="only runs in this state (e.g. waiting, failed)")
    listing.add_argument("--limit", type=int, default=50, help="at most this many, newest first (50; 500)")
    start = _with_json(
        _with_tenant(_with_dir(runs_sub.add_parser("start", help="start a run: a plan or words")))
    )
    start.add_argument("text", nargs="?", default="")
    start.add_argument(
        "--plan", type=Path, default=None, help='a plan file, JSON {"steps": [...]} (- reads stdin)'
    )
    start.add_argument(
        "--workflow", default=None, help="a registered workflow's name (fleet.toml [[workflows]])"
    )
    start.add_argument("--input", default=None, help="with --workflow: its input, a JSON object")
    start.add_argument("--follow", "-f", action="store_true", help="print its events until it ends")
    show = _with_json(_with_tenant(_with_dir(runs_sub.add_parser("show", help="one run in detail"))))
    show.add_argument("run_id")
    show.add_argument("--watch", action="store_true", help="follow it to its end (a bar for batches)")
    events = _with_json(_with_tenant(_with_dir(runs_sub.add_parser("events", help="a run's event log"))))
    events.add_argument("run_id")
    events.add_argument("--follow", "-f", action="store_true", help="keep streaming until the run ends")
    events.add_argument("--after", type=int, default=0, help="only events after this seq")
    cancel = _with_json(_with_tenant(_with_dir(runs_sub.add_parser("cancel", help="cancel a run"))))
    cancel.add_argument("run_id")
    cancel.add_argument("--reason", default="", help="recorded with your identity")


def _registry_parsers(sub: Any) -> None:
    """``fleet agents list|show`` and ``fleet mcp list`` (see :mod:`fleetctl.registry_cli`)."""
    agents = sub.add_parser("agents", help="the agents the registry knows")
    agents_sub = agents.add_subparsers(dest="agents_command", required=True)
    _with_json(_with_dir(agents_sub.add_parser("list", help="every registered agent")))
    show = _with_json(_with_dir(agents_sub.add_parser("show", help="one agent's record")))
    show.add_argument("agent_id")
    mcp = sub.add_parser("mcp", help="the MCP servers the registry knows")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", required=True)
    _with_json(_with_dir(mcp_sub.add_parser("list", help="every registered MCP server, its tools, health")))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleet", description="agent-fleet: run and operate a fleet")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--data-dir", type=Path, default=None, help="default: $FLEET_HOME or .fleet")
        return p

    up = with_dir(sub.add_parser("up", help="start the local stack"))
    up.add_argument("--detach", action="store_true", help="return once healthy; keep running")
    up.add_argument(
        "--tls", action="store_true", help="NATS and every service over TLS, on a CA made in the data dir"
    )
    up.add_argument(
        "--manifest",
        type=Path,
        default=None,
        help="a fleet manifest whose services to run (default: $FLEET_MANIFEST, or ./fleet.toml if there is one)",
    )
    up.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    _with_json(with_dir(sub.add_parser("down", help="stop the local stack")))
    logs = with_dir(sub.add_parser("logs", help="a service's log (the local stack's)"))
    logs.add_argument("service", nargs="?", default=None)
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing what it writes")
    logs.add_argument("--lines", "-n", type=int, default=50, help="how many of its last lines (50)")
    logs.add_argument("--list", action="store_true", help="the services that have a log")
    status = with_dir(sub.add_parser("status", help="health and what the registry knows"))
    status.add_argument("--json", action="store_true")
    token = _with_json(with_dir(sub.add_parser("token", help="print a short-lived access token")))
    token.add_argument("--audience", required=True, help="the service the token is for")
    token.add_argument("--tenant", default="default")
    token.add_argument("--scope", action="append", default=[], help="repeat for several scopes")
    console = with_dir(sub.add_parser("console", help="print a one-time sign-in link to the web console"))
    console.add_argument("--tenant", default="default", help="the tenant whose runs the console shows")
    console.add_argument("--json", action="store_true")
    demo = with_dir(sub.add_parser("demo", help="run the end-to-end demo as an outside agent"))
    demo.add_argument("--keep-running", action="store_true", help="leave a stack it started up")
    demo.add_argument(
        "--auto-approve", action="store_true", help="approve what waits for a person, as the operator"
    )
    demo.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    runs = sub.add_parser("runs", help="runs of the fleet")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    _run_read_parsers(runs_sub)
    export = with_dir(runs_sub.add_parser("export", help="write a run's debug bundle to a folder"))
    export.add_argument("run_id")
    export.add_argument("out_dir", nargs="?", type=Path, default=None, help="default: ./run-RUN_ID")
    export.add_argument("--tenant", default="default", help="the tenant the run belongs to")
    _with_json(export)
    resolve = with_dir(
        runs_sub.add_parser("resolve", help="say what became of an operation that needs a person")
    )
    resolve.add_argument("run_id")
    resolve.add_argument("op_id")
    resolve.add_argument("verdict", choices=["succeeded", "failed", "retry"])
    resolve.add_argument("--result", default="{}", help="the operation's result, as JSON (succeeded)")
    resolve.add_argument("--note", default="", help="why: recorded with your identity")
    resolve.add_argument("--tenant", default="default", help="the tenant the run belongs to")
    _with_json(resolve)
    decide = with_dir(
        runs_sub.add_parser("decide", help="decide for a run that waits on a person (a spent budget)")
    )
    decide.add_argument("run_id")
    decide.add_argument("decision", choices=["tranche", "close"])
    for limit in ("max-steps", "max-operations", "max-seconds"):
        decide.add_argument(f"--{limit}", type=float, default=None, help="for the new tranche")
    decide.add_argument("--note", default="", help="why: recorded with your identity")
    decide.add_argument("--tenant", default="default", help="the tenant the run belongs to")
    _with_json(decide)
    for verb, what in (
        ("approve", "approve what a run waits for"),
        ("reject", "reject what a run waits for"),
    ):
        answer = with_dir(sub.add_parser(verb, help=what))
        answer.add_argument("run_id")
        if verb == "approve":
            answer.add_argument("--input", default=None, help="input for the step, a JSON object")
        answer.add_argument("--note", default="", help="why: recorded with your identity")
        answer.add_argument(
            "--awaited", default=None, help="the wait to answer (default: the one it waits at)"
        )
        answer.add_argument("--id", default=None, help="a signal id: a repeat with the same id is a no-op")
        answer.add_argument("--tenant", default="default", help="the tenant the run belongs to")
        _with_json(answer)
    extend = with_dir(runs_sub.add_parser("extend", help="move the deadline of what a run waits for"))
    extend.add_argument("run_id")
    extend.add_argument("--seconds", type=float, required=True, help="how much later")
    extend.add_argument("--awaited", default=None)
    extend.add_argument("--tenant", default="default", help="the tenant the run belongs to")
    _with_json(extend)
    events = sub.add_parser("events", help="ambient events on NATS")
    events_sub = events.add_subparsers(dest="events_command", required=True)
    publish = _with_json(
        with_dir(
            events_sub.add_parser(
                "publish", help="publish an event (on fleet.events.<tenant>.<source>.<name>...)"
            )
        )
    )
    publish.add_argument(
        "subject", help="the logical subject, e.g. fleet.events.invoices.closed (no tenant or source)"
    )
    publish.add_argument("--data", default="{}", help="the event's data, a JSON object")
    publish.add_argument(
        "--id", default=None, help="the event id (default: a new one); a repeat starts nothing new"
    )
    publish.add_argument("--tenant", default="default", help="the subject's tenant token")
    publish.add_argument("--type", default=None, help="default: the subject after fleet.events.")
    publish.add_argument("--source", default="cli", help="the subject's source token")
    producers = sub.add_parser("producers", help="credentials for event producers outside the fleet")
    producers_sub = producers.add_subparsers(dest="producers_command", required=True)
    issue = _with_json(
        with_dir(producers_sub.add_parser("issue", help="issue a producer's nkey credentials"))
    )
    issue.add_argument("producer", help="the producer's id, e.g. billing-acme")
    issue.add_argument("--tenant", required=True, help="the one tenant it publishes for")
    issue.add_argument("--source", action="append", required=True, help="a source it publishes as (repeat)")
    issue.add_argument("--days", type=float, default=30.0, help="how long the credentials hold (default 30)")
    issue.add_argument("--out", type=Path, required=True, help="where to write its seed (mode 0600)")
    revoke_producer = _with_json(
        with_dir(producers_sub.add_parser("revoke", help="revoke a producer's credentials"))
    )
    revoke_producer.add_argument("producer")
    revoke_producer.add_argument("--reason", default="")
    _with_json(with_dir(producers_sub.add_parser("list", help="the producers and their credentials")))
    keys = sub.add_parser("keys", help="signing keys: revoke one, rotate the registry's, list revoked")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    revoke = with_dir(
        keys_sub.add_parser("revoke", help="revoke a key: every service refuses it within seconds")
    )
    revoke.add_argument("kid", help="the key id (an RFC 7638 thumbprint)")
    revoke.add_argument("--reason", default="", help="recorded with the revocation")
    _with_json(revoke)
    _with_json(
        with_dir(
            keys_sub.add_parser(
                "rotate-registry",
                help="the registry signs with a new key from now on (certified with the data dir's operator key)",
            )
        )
    )
    _with_json(with_dir(keys_sub.add_parser("revoked", help="list the revoked keys")))
    enroll = with_dir(
        keys_sub.add_parser(
            "enrollment-token",
            help="print a one-time token with which an identity enrolls its key (valid 10 minutes)",
        )
    )
    enroll.add_argument("identity", help="the identity's id, e.g. partner-fraud-check")
    enroll.add_argument("--kind", default="specialist", choices=["specialist", "mcp_server", "worker"])
    enroll.add_argument("--scope", action="append", default=[], help="a scope it may ask for (repeat)")
    enroll.add_argument("--tenant", action="append", default=[], help="a tenant it may act for (repeat)")
    enroll.add_argument(
        "--skill",
        action="append",
        default=[],
        help="a skill its agent card may offer (repeat; a card claiming another is refused)",
    )
    _with_json(enroll)
    enroll.add_argument(
        "--external",
        action="store_true",
        help="run by another organisation: calls to it pass the egress policy",
    )
    policy = sub.add_parser("policy", help="the fleet's Rego bundle: test, push, roll back, watch")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    ptest = policy_sub.add_parser("test", help="run the bundle's Rego unit tests (like opa test)")
    ptest.add_argument("dir", nargs="?", type=Path, default=None, help="default: the installed bundle")
    ptest.add_argument("-v", "--verbose", action="store_true", help="list every test, not only failures")
    ptest.add_argument("--coverage", action="store_true", help="the policies' lines the tests reach")
    ptest.add_argument("--json", action="store_true")
    pfmt = policy_sub.add_parser(
        "fmt", help="lay the bundle's Rego modules out uniformly (a subset of opa fmt)"
    )
    pfmt.add_argument("dir", nargs="?", type=Path, default=None, help="default: the installed bundle")
    pfmt.add_argument("--check", action="store_true", help="change nothing; exit 1 if a module would change")
    pfmt.add_argument("--json", action="store_true")
    peval = policy_sub.add_parser(
        "eval", help="a rule's value (data.fleet.tools.decision) or any Rego query's results, as opa eval"
    )
    peval.add_argument("query")
    peval.add_argument("--json", action="store_true", help="accepted for symmetry: eval always prints JSON")
    peval.add_argument("--input", type=Path, default=None, help="a JSON file: the input document")
    peval.add_argument("--dir", type=Path, default=None, help="the bundle (default: the installed one)")
    ppush = with_dir(policy_sub.add_parser("push", help="test the bundle and make it every process's policy"))
    ppush.add_argument("dir", nargs="?", type=Path, default=None, help="default: the installed bundle")
    ppush.add_argument("--note", default="", help="recorded with the push")
    ppush.add_argument("--wait", type=float, default=10.0, help="seconds to wait for every process (10)")
    _with_json(_with_signing(ppush))
    prollback = with_dir(policy_sub.add_parser("rollback", help="push the previous revision again"))
    prollback.add_argument("--wait", type=float, default=10.0)
    _with_json(_with_signing(prollback))
    pauthorize = with_dir(
        policy_sub.add_parser("authorize", help="certify, as the operator, that an author may push policy")
    )
    pauthorize.add_argument("author", help="the author's id, e.g. alice")
    pauthorize.add_argument("--key", type=Path, required=True, help="the author's public key (JWK or PEM)")
    pauthorize.add_argument("--days", type=float, default=90.0, help="how long the certificate lasts (90)")
    _with_json(pauthorize)
    pstatus = with_dir(policy_sub.add_parser("status", help="the revision each process enforces"))
    pstatus.add_argument("--json", action="store_true")
    plog = with_dir(policy_sub.add_parser("log", help="the decision log"))
    plog.add_argument("--follow", "-f", action="store_true")
    plog.add_argument("--json", action="store_true")
    plog.add_argument("--last", type=int, default=50, help="how many past decisions to show (50; 0: all)")
    pserve = policy_sub.add_parser("serve", help="serve OPA's REST API over the embedded engine")
    pserve.add_argument("dir", nargs="?", type=Path, default=None, help="a bundle to load first")
    pserve.add_argument("--host", default="127.0.0.1")
    pserve.add_argument("--port", type=int, default=8181)
    memory = sub.add_parser(
        "memory", help="a tenant's long-term memory: search, show, forget, approve, audit"
    )
    memory_sub = memory.add_subparsers(dest="memory_command", required=True)
    msearch = with_dir(memory_sub.add_parser("search", help="the memories nearest to a query"))
    msearch.add_argument("query")
    msearch.add_argument(
        "--tier", action="append", default=[], choices=["episodic", "semantic", "procedural"]
    )
    msearch.add_argument("--limit", type=int, default=10)
    mshow = with_dir(memory_sub.add_parser("show", help="memories by id, with their provenance"))
    mshow.add_argument("ids", nargs="+")
    mforget = with_dir(memory_sub.add_parser("forget", help="delete memories (audited)"))
    which = mforget.add_mutually_exclusive_group(required=True)
    which.add_argument("--id", dest="ids", action="append", default=[])
    which.add_argument("--run", default="", help="what one run wrote")
    which.add_argument("--all", action="store_true", help="all of the tenant's memory")
    mforget.add_argument("--reason", default="")
    mapprove = with_dir(memory_sub.add_parser("approve", help="approve a held procedural rule"))
    mapprove.add_argument("id")
    maudit = with_dir(memory_sub.add_parser("audit", help="the memory server's audit events"))
    maudit.add_argument("--last", type=int, default=50, help="how many (50; 0: all)")
    for command in (msearch, mshow, mforget, mapprove):
        command.add_argument("--tenant", required=True, help="whose memory")
    maudit.add_argument("--tenant", default=None, help="only this tenant's events")
    for command in (msearch, mshow, mforget, mapprove, maudit):
        command.add_argument("--json", action="store_true")
    _registry_parsers(sub)
    new = sub.add_parser("new", help="a new specialist, MCP server or workflow in a project, with its test")
    new.add_argument("kind", choices=["specialist", "mcp-server", "workflow"])
    new.add_argument("name")
    new.add_argument("--dir", type=Path, default=Path("."), help="the project's folder (default: here)")
    deploy = sub.add_parser("deploy", help="deployment files for a project's fleet")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True)
    render = deploy_sub.add_parser(
        "render",
        help="compose and Kubernetes files, and an image, for the fleet of ./fleet.toml",
        epilog="example: fleet deploy render && docker compose -f deployment/compose.yaml build",
    )
    render.add_argument(
        "--manifest", type=Path, default=None, help="default: $FLEET_MANIFEST or ./fleet.toml"
    )
    render.add_argument("--out", type=Path, default=None, help="default: the project's deployment/")
    render.add_argument("--check", action="store_true", help="only say whether the files are up to date")
    serve = sub.add_parser("serve", help="run one service in the foreground (used by fleet up)")
    serve.add_argument("service_id")
    return with_examples(parser)


def _version() -> str:
    try:
        return importlib.metadata.version("agent-fleet")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = FleetSettings()
    data_dir = getattr(args, "data_dir", None) or settings.home
    layout = StackLayout.at(data_dir)
    _trust_stack_ca(layout)
    try:
        return _dispatch(args, settings, layout)
    except FleetError as exc:
        return report_error(exc, as_json=bool(getattr(args, "json", False)))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _trust_stack_ca(layout: StackLayout) -> None:
    """A stack started with ``--tls`` serves HTTPS with certificates of its own CA: this process's
    HTTP clients trust it (set here, at the entry point, once)."""
    endpoints = layout.read_endpoints() or {}
    trust = endpoints.get("tls_trust")
    if isinstance(trust, str) and not endpoints.get("stopped"):
        os.environ["SSL_CERT_FILE"] = trust  # the stack's CA and the public roots


# A command's handler: the parsed arguments, the settings, the data dir; its exit code.
Handler = Callable[[argparse.Namespace, FleetSettings, StackLayout], int]


def _dispatch(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    """Run the command ``args`` names (``runs`` and ``keys`` by their subcommand)."""
    command: str = args.command
    if command == "runs":
        handler = _RUNS.get(args.runs_command, _usage)
    elif command == "keys":
        handler = _keys_token if args.keys_command == "enrollment-token" else _keys
    else:
        handler = _COMMANDS.get(command, _usage)
    return handler(args, settings, layout)


def _usage(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    return EXIT_USAGE


def _up(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    if args.tls:
        settings = settings.model_copy(update={"tls": True})
    # checked before anything starts (once: not again by the supervisor it starts in the background)
    manifest = project_manifest(args.manifest or settings.manifest, check_code=args.ready_fd is None)
    if args.detach:
        return up_detached(layout, tls=settings.tls, manifest=manifest.path if manifest else None)
    return asyncio.run(up_foreground(settings, layout, args.ready_fd, manifest))


def _new(args: argparse.Namespace) -> int:
    """``fleet new KIND NAME``: :func:`fleetctl.scaffold.new`, and what it wrote."""
    from fleetctl import scaffold

    for path in scaffold.new(args.kind, args.name, args.dir):
        print(f"wrote {path}")
    print("fleet: run its test with `python -m pytest`, and it with `fleet up`", flush=True)
    return EXIT_OK


def _deploy_render(args: argparse.Namespace, settings: FleetSettings) -> int:
    """``fleet deploy render``: :mod:`deploy.render` for the project's manifest."""
    from deploy import render

    manifest = project_manifest(args.manifest or settings.manifest)
    if manifest is None:
        raise FleetError(
            ErrorCode.MANIFEST_INVALID,
            f"no {MANIFEST_NAME} here: run it in a project's folder, or name one with --manifest",
        )
    argv = ["--manifest", str(manifest.path), *(["--out", str(args.out)] if args.out else [])]
    return render.main([*argv, *(["--check"] if args.check else [])])


def _workflow_request(name: str, given: str | None) -> dict[str, Any]:
    """The data part that starts workflow ``name`` with the JSON object ``given``."""
    try:
        payload = json.loads(given) if given else {}
    except ValueError as exc:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"--input is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise FleetError(ErrorCode.INVALID_REQUEST, "--input is a JSON object")
    return {"workflow": name, "input": payload}


def _plan_file(path: Path | None) -> dict[str, Any] | None:
    """The plan in ``path`` (``-``: standard input): a JSON object, or ``invalid_request``."""
    if path is None:
        return None
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
        plan = json.loads(text)
    except OSError as exc:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"cannot read the plan {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"the plan {path} is not JSON: {exc}") from exc
    if not isinstance(plan, dict):
        raise FleetError(
            ErrorCode.INVALID_REQUEST, f'the plan {path} is not a JSON object ({{"steps": [...]}})'
        )
    return plan


def project_manifest(path: Path | None, *, check_code: bool = False) -> FleetManifest | None:
    """The manifest ``path`` names, or ``./fleet.toml`` if there is one; loaded and checked (with
    ``check_code``: its modules imported and its workflows compiled, in a process of their own)."""
    if path is None:
        found = Path.cwd() / MANIFEST_NAME
        path = found if found.is_file() else None
    if path is None:
        return None
    manifest = load_manifest(path)
    if check_code:
        from fleetctl.project_check import check

        check(manifest)
    return manifest


def _down(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    return operator_cli.down(layout, as_json=args.json)


def _status(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    return asyncio.run(operator_cli.status(layout, as_json=args.json))


def _token(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    return asyncio.run(operator_cli.token(layout, args.audience, args.tenant, args.scope, as_json=args.json))


def _console(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl.console_cli import sign_in_link

    return asyncio.run(sign_in_link(layout, args.tenant, as_json=args.json))


def _demo(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import demo

    return demo.run(
        layout, keep_running=args.keep_running, auto_approve=args.auto_approve, timeout_s=args.timeout
    )


def _runs_read(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    return asyncio.run(_runs(args, layout))


def _runs_resolve(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    return asyncio.run(
        operator_cli.resolve_operation(
            layout,
            args.run_id,
            args.op_id,
            args.verdict,
            args.result,
            args.note,
            args.tenant,
            as_json=args.json,
        )
    )


def _runs_decide(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    limits = {
        key: value
        for key in ("max_steps", "max_operations", "max_seconds")
        if (value := getattr(args, key)) is not None
    }
    return asyncio.run(
        operator_cli.decide(
            layout, args.run_id, args.decision, limits, args.note, args.tenant, as_json=args.json
        )
    )


def _runs_extend(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    body: dict[str, Any] = {"action": SignalAction.EXTEND, "extend_s": args.seconds}
    if args.awaited is not None:
        body["awaited"] = args.awaited
    return _send_signal(args, layout, body)


def _runs_export(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    out_dir = args.out_dir or Path(f"run-{args.run_id}")
    return operator_cli.export_run(layout, args.run_id, out_dir, args.tenant, as_json=args.json)


def _answer(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    """``fleet approve`` and ``fleet reject``."""
    body: dict[str, Any] = {"action": SignalAction(args.command), "note": args.note}
    if getattr(args, "input", None) is not None:
        try:
            body["input"] = json.loads(args.input)
        except json.JSONDecodeError as exc:
            raise FleetError(ErrorCode.INVALID_REQUEST, "--input must be JSON") from exc
    body.update({k: v for k in ("awaited", "id") if (v := getattr(args, k)) is not None})
    return _send_signal(args, layout, body)


def _send_signal(args: argparse.Namespace, layout: StackLayout, body: dict[str, Any]) -> int:
    from fleetctl import operator_cli

    return asyncio.run(operator_cli.send_signal(layout, args.run_id, body, args.tenant, as_json=args.json))


def _events(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    type_ = args.type or args.subject.removeprefix("fleet.events.")
    return asyncio.run(
        operator_cli.publish_event(
            layout, args.subject, args.data, args.id, args.tenant, type_, args.source, as_json=args.json
        )
    )


def _keys_token(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    return operator_cli.print_enrollment_token(
        layout,
        args.identity,
        args.kind,
        args.scope,
        args.tenant,
        skills=args.skill,
        external=args.external,
        as_json=args.json,
    )


def _keys(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    from fleetctl import operator_cli

    kid, reason = getattr(args, "kid", ""), getattr(args, "reason", "")
    return asyncio.run(operator_cli.keys(layout, args.keys_command, kid, reason, as_json=args.json))


def _registry_read(args: argparse.Namespace, settings: FleetSettings, layout: StackLayout) -> int:
    return asyncio.run(_registry(args, layout))


async def _runs(args: argparse.Namespace, layout: StackLayout) -> int:
    from fleetctl import runs_cli

    which: str = args.runs_command
    if which == "start":
        plan = _workflow_request(args.workflow, args.input) if args.workflow else _plan_file(args.plan)
        message = runs_cli.plan_message(plan, args.text)
        return await runs_cli.start(layout, args.tenant, message, follow=args.follow, as_json=args.json)
    if which == "list":
        return await runs_cli.list_runs(layout, args.tenant, args.state, args.limit, as_json=args.json)
    if which == "show":
        return await runs_cli.show(layout, args.run_id, args.tenant, watch=args.watch, as_json=args.json)
    if which == "events":
        return await runs_cli.events(
            layout, args.run_id, args.tenant, args.after, follow=args.follow, as_json=args.json
        )
    return await runs_cli.cancel(layout, args.run_id, args.tenant, args.reason, as_json=args.json)


async def _registry(args: argparse.Namespace, layout: StackLayout) -> int:
    from fleetctl import registry_cli

    if args.command == "mcp":
        return await registry_cli.list_mcp_servers(layout, as_json=args.json)
    if args.agents_command == "show":
        return await registry_cli.show_agent(layout, args.agent_id, as_json=args.json)
    return await registry_cli.list_agents(layout, as_json=args.json)


def _memory(args: argparse.Namespace, layout: StackLayout) -> int:
    from fleetctl import memory_cli

    which: str = args.memory_command
    if which == "search":
        return asyncio.run(
            memory_cli.search(layout, args.tenant, args.query, args.tier, args.limit, as_json=args.json)
        )
    if which == "show":
        return asyncio.run(memory_cli.show(layout, args.tenant, args.ids, as_json=args.json))
    if which == "forget":
        return asyncio.run(
            memory_cli.forget(
                layout,
                args.tenant,
                ids=args.ids,
                run_id=args.run,
                everything=args.all,
                reason=args.reason,
                as_json=args.json,
            )
        )
    if which == "approve":
        return asyncio.run(memory_cli.approve(layout, args.tenant, args.id, as_json=args.json))
    if which == "audit":
        return asyncio.run(memory_cli.audit(layout, args.tenant, args.last, as_json=args.json))
    return EXIT_USAGE


def _policy(args: argparse.Namespace, layout: StackLayout) -> int:
    from fleetctl import policy_cli

    which: str = args.policy_command
    if which == "test":
        return policy_cli.test(args.dir, verbose=args.verbose, coverage=args.coverage, as_json=args.json)
    if which == "eval":
        return policy_cli.evaluate(args.query, args.input, args.dir)
    if which == "fmt":
        return policy_cli.format_bundle(args.dir, check=args.check, as_json=args.json)
    if which in ("push", "rollback"):
        signing = policy_cli.Signing(args.key, args.certificate)
        if which == "rollback":
            return asyncio.run(policy_cli.roll_back(layout, args.wait, as_json=args.json, signing=signing))
        return asyncio.run(
            policy_cli.push_bundle(layout, args.dir, args.note, args.wait, as_json=args.json, signing=signing)
        )
    if which == "authorize":
        return policy_cli.authorize(layout, args.author, args.key, args.days, as_json=args.json)
    if which == "status":
        return asyncio.run(policy_cli.status(layout, as_json=args.json))
    if which == "serve":
        return policy_cli.serve(args.dir, args.host, args.port)
    if which == "log":
        return asyncio.run(
            policy_cli.decision_log(layout, follow=args.follow, as_json=args.json, limit=args.last)
        )
    return EXIT_USAGE


async def up_foreground(
    settings: FleetSettings, layout: StackLayout, ready_fd: int | None, manifest: FleetManifest | None = None
) -> int:
    from fleetctl.supervisor import Supervisor

    def progress(line: str) -> None:
        print(f"fleet: {line}", flush=True)
        _notify(ready_fd, {"progress": line}, last=False)

    supervisor = Supervisor(settings, layout, manifest, progress=progress)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(supervisor.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        interrupted = FleetError(ErrorCode.STACK_FAILED, "interrupted while starting")
        _notify(ready_fd, {"ok": False, "error": interrupted.to_dict()})
        return EXIT_INTERRUPTED
    stopping.cancel()
    try:
        endpoints = starting.result()
    except FleetError as exc:
        _notify(ready_fd, {"ok": False, "error": exc.to_dict()})
        raise
    print_endpoints(endpoints)
    _notify(ready_fd, {"ok": True, "endpoints": endpoints})
    print("fleet: stack is up; Ctrl-C stops it", flush=True)
    await supervisor.wait(stop)
    print("fleet: stopping", flush=True)
    await supervisor.stop()
    print("fleet: stopped", flush=True)
    return EXIT_OK


def _notify(ready_fd: int | None, report: dict[str, Any], *, last: bool = True) -> None:
    """Tell the process that started us in the background (``fleet up --detach``) how the start
    goes: a line of progress, or (``last``) the outcome, after which the pipe is closed."""
    if ready_fd is None:
        return
    try:
        os.write(ready_fd, (json.dumps(report) + "\n").encode())
        if last:
            os.close(ready_fd)
    except OSError:
        pass


def _producers(args: argparse.Namespace, layout: StackLayout) -> int:
    from fleetctl import producers_cli

    if args.producers_command == "issue":
        return asyncio.run(
            producers_cli.issue(
                layout,
                args.producer,
                args.tenant,
                args.source,
                args.days * 86400,
                args.out,
                as_json=args.json,
            )
        )
    if args.producers_command == "revoke":
        return asyncio.run(producers_cli.revoke(layout, args.producer, args.reason, as_json=args.json))
    return asyncio.run(producers_cli.listing(layout, as_json=args.json))


_RUNS: dict[str, Handler] = {
    "start": _runs_read,
    "list": _runs_read,
    "show": _runs_read,
    "events": _runs_read,
    "cancel": _runs_read,
    "resolve": _runs_resolve,
    "decide": _runs_decide,
    "extend": _runs_extend,
    "export": _runs_export,
}
_COMMANDS: dict[str, Handler] = {
    "up": _up,
    "down": _down,
    "status": _status,
    "token": _token,
    "console": _console,
    "demo": _demo,
    "agents": _registry_read,
    "mcp": _registry_read,
    "approve": _answer,
    "reject": _answer,
    "events": _events,
    "producers": lambda args, settings, layout: _producers(args, layout),
    "policy": lambda args, settings, layout: _policy(args, layout),
    "memory": lambda args, settings, layout: _memory(args, layout),
    "serve": lambda args, settings, layout: serve(args.service_id),
    "deploy": lambda args, settings, layout: _deploy_render(args, settings),
    "new": lambda args, settings, layout: _new(args),
    "logs": lambda args, settings, layout: logs_cli.logs(
        layout, args.service, lines=args.lines, follow=args.follow, list_only=args.list
    ),
}
