"""``fleet policy ...``: author, test, push and watch the fleet's Rego bundle.

- ``test [DIR]``: the bundle's Rego unit tests (every ``test_*`` rule), like ``opa test``;
  ``--coverage`` adds the lines of the policies the tests did not reach.
- ``eval QUERY [--input FILE] [--dir DIR]``: one decision, as the fleet would take it.
- ``push [DIR]``: compile and test the bundle, sign it, then make it the policy of every running
  process (each swaps it in only if its signature verifies and it compiles there too; see
  :mod:`policy.live`); waits until they do. Signed with the operator key of the data dir, or with
  ``--key PEM --certificate FILE``: an author's key and the operator's certificate for it.
- ``rollback``: push the revision before the current one again (signed again, as ``push``).
- ``authorize AUTHOR --key FILE``: the operator's certificate that AUTHOR may push with that key.
- ``status``: the revision each process enforces, what it refused, and whether the last push
  verifies.
- ``log [--follow]``: the decision log (``fleet.decisions.>``).
- ``serve [DIR]``: OPA's REST API over the embedded engine (:mod:`policy.rest_server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import getpass
import json
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from deploy.local_stack import OPERATOR_ID
from fleet.bodylimit import BodySizeLimit
from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.natsconn import connect, stream_replicas
from fleetctl.cli_common import emit, report_error
from fleetctl.layout import StackLayout
from policy import (
    DEFAULT_BUNDLE_DIR,
    Bundle,
    PolicyError,
    PolicyQueryError,
    PolicySigner,
    PushVerifier,
    RegorusEngine,
    certify_author,
    public_jwk_from_file,
)
from policy.formatting import format_module
from policy.live import DECISIONS_STREAM, last_push, push, pushed, rollback, statuses
from policy.testing import RegoTestResult, run_bundle_tests

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING = 0, 1, 2, 3
ENFORCED_WAIT_S = 10.0
SERVE_MAX_BODY_BYTES = 16 * 1024 * 1024  # `fleet policy serve`: a body over it (a module, data) is 413


def _load(directory: Path | None) -> Bundle:
    return Bundle.load(directory) if directory else Bundle.load()


def check(bundle: Bundle) -> list[RegoTestResult]:
    """What ``push`` requires of a bundle: it compiles, it has tests, and they all pass. The
    failures (empty when it may be pushed); ``PolicyError`` if it does not compile."""
    RegorusEngine(bundle)
    results, _ = run_bundle_tests(bundle)
    if not results:
        raise PolicyError(f"bundle {bundle.root} has no tests (rules named test_*)")
    return [r for r in results if r.outcome != "pass"]


def test(directory: Path | None, *, verbose: bool, coverage: bool, as_json: bool) -> int:
    try:
        bundle = _load(directory)
        results, covered = run_bundle_tests(bundle, coverage=coverage)
    except PolicyError as exc:
        report_error(exc, as_json=False)
        return EXIT_FAILED
    failed = [r for r in results if r.outcome != "pass"]
    if as_json:
        report: dict[str, Any] = {
            "revision": bundle.revision,
            "results": [
                {
                    "package": r.package,
                    "name": r.name,
                    "file": r.file,
                    "outcome": r.outcome,
                    "detail": r.detail,
                }
                for r in results
            ],
        }
        if coverage:
            report["coverage"] = covered
        print(json.dumps(report, indent=2))
    else:
        for r in results:
            if verbose or r.outcome != "pass":
                line = f"data.{r.package}.{r.name}: {r.outcome.upper()} ({r.duration_s * 1e6:.0f}µs)"
                print(line + (f"\n  {r.detail}" if r.detail else ""))
        print("-" * 80)
        for outcome in ("pass", "fail", "error"):
            count = sum(r.outcome == outcome for r in results)
            if count:
                print(f"{outcome.upper()}: {count}/{len(results)}")
        if coverage:
            for path, file in covered["files"].items():
                missed = ", ".join(map(str, file["not_covered"])) or "-"
                print(f"{path}: {file['coverage']}% of lines covered; not covered: {missed}")
            print(f"coverage: {covered['coverage']}%")
    return EXIT_FAILED if failed or not results else EXIT_OK


def format_bundle(directory: Path | None, *, check: bool, as_json: bool) -> int:
    """``fleet policy fmt``: lay out every ``*.rego`` under the bundle (:mod:`policy.formatting`),
    or with ``check`` only say which would change (exit 1 if any, for CI). A module whose syntax
    tree the layout would change is left as it is and named (``kept``); one that does not parse is
    ``policy_unavailable``, and nothing is written."""
    root = directory or DEFAULT_BUNDLE_DIR
    try:
        modules = [(path, path.read_text()) for path in sorted(root.rglob("*.rego"))]
        results = [(path, text, format_module(str(path.relative_to(root)), text)) for path, text in modules]
    except OSError as exc:
        return report_error(PolicyError(f"cannot read the bundle at {root}: {exc}"), as_json=as_json)
    except PolicyError as exc:
        return report_error(exc, as_json=as_json)
    changed = [path for path, text, done in results if done.text != text]
    kept = [path for path, _, done in results if done.kept]
    if not check:
        for path, text, done in results:
            if done.text != text:
                path.write_text(done.text)
    names = {
        "changed": [str(p.relative_to(root)) for p in changed],
        "kept": [str(p.relative_to(root)) for p in kept],
    }
    verb = "would change" if check else "formatted"
    emit(
        {**names, "modules": len(results), "check": check},
        as_json=as_json,
        text="\n".join(
            [*(f"{verb} {name}" for name in names["changed"])]
            + [f"left as it is (a change would alter its syntax tree): {name}" for name in names["kept"]]
            + [f"{len(results)} modules, {len(changed)} {verb}"]
        ),
    )
    return EXIT_FAILED if check and changed else EXIT_OK


_RULE_PATH = re.compile(r"data(\.[A-Za-z_][A-Za-z0-9_]*)+")


def evaluate(query: str, input_file: Path | None, directory: Path | None) -> int:
    """``fleet policy eval``: a rule's value (``data.fleet.tools.decision``: ``{"result": value}``),
    or any Rego query's results as ``opa eval`` gives them (``{"results": [{"expressions",
    "bindings"}, ...]}``: none if it holds no way). A query that does not parse is
    ``policy_query_invalid`` (exit 2); a bundle that cannot be evaluated, ``policy_unavailable``."""
    try:
        document = json.loads(input_file.read_text()) if input_file else {}
    except (OSError, ValueError) as exc:
        print(f"fleet: cannot read the input: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        engine = RegorusEngine(_load(directory))
        if _RULE_PATH.fullmatch(query.strip()):
            answer: dict[str, Any] = {
                "result": engine.evaluate(query.strip().removeprefix("data."), document)
            }
        else:
            answer = {"query": query, "results": engine.query(query, document)}
    except (PolicyError, PolicyQueryError) as exc:
        return report_error(exc, as_json=False)
    print(json.dumps({**answer, "revision": engine.revision}, indent=2))
    return EXIT_OK


@contextlib.asynccontextmanager
async def _broker(layout: StackLayout) -> AsyncIterator[NATS | None]:
    """A connection to the NATS of the stack on ``layout``; None (and why, on stderr) if none runs."""
    from fleetctl.cli_common import operator_bus_credentials, running_endpoints

    try:
        endpoints = running_endpoints(layout)
    except FleetError as exc:
        print(f"fleet: {exc.message}", file=sys.stderr)
        yield None
        return
    client = await connect(
        str(endpoints["nats"]),
        "fleet-policy",
        replicas=stream_replicas(endpoints),
        credentials=operator_bus_credentials(endpoints),
    )
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.close()


@dataclass(frozen=True, slots=True)
class Signing:
    """Who signs a push or rollback: the operator key of the data dir (both None), or an author's
    private key and the operator's certificate for it."""

    key_file: Path | None = None
    certificate_file: Path | None = None


def signer_of(layout: StackLayout, signing: Signing) -> PolicySigner:
    """The signer ``signing`` names; :class:`PolicyError` if its files are missing or unusable."""
    if (signing.key_file is None) != (signing.certificate_file is None):
        raise PolicyError("an author signs with both --key and --certificate")
    key_file = signing.key_file or layout.key_file(OPERATOR_ID)
    if not key_file.is_file():
        raise PolicyError(f"no signing key at {key_file}")
    try:
        key = SigningKey.load_or_create(key_file)
        certificate = signing.certificate_file.read_text().strip() if signing.certificate_file else None
    except (OSError, ValueError) as exc:
        raise PolicyError(f"cannot read the signing key or certificate: {exc}") from exc
    return PolicySigner.operator(key) if certificate is None else PolicySigner.author_of(key, certificate)


def verifier_of(layout: StackLayout) -> PushVerifier:
    """What every process checks pushes with: the operator's public key of the data dir."""
    if not layout.operator_jwk_file.is_file():
        raise PolicyError(f"no operator public key at {layout.operator_jwk_file}")
    return PushVerifier.from_file(layout.operator_jwk_file)


def _pushed_by(signer: PolicySigner) -> str:
    return f"{signer.author}:{getpass.getuser()}"


async def push_bundle(
    layout: StackLayout,
    directory: Path | None,
    note: str,
    wait_s: float,
    *,
    as_json: bool = False,
    signing: Signing = Signing(),
) -> int:
    """``fleet policy push``: compile and test the bundle here, sign and push it, wait until it is
    enforced."""
    try:
        bundle = _load(directory)
        failures = check(bundle)
    except PolicyError as exc:
        return _refused(f"refused: {exc.message}", as_json)
    if failures:
        for r in failures:
            print(f"data.{r.package}.{r.name}: {r.outcome.upper()} {r.detail}", file=sys.stderr)
        return _refused(f"refused: {len(failures)} test(s) of the bundle do not pass", as_json)
    try:
        signer = signer_of(layout, signing)
    except PolicyError as exc:
        return _refused(f"refused: {exc.message}", as_json)
    async with _broker(layout) as client:
        if client is None:
            return EXIT_NOT_RUNNING
        started = time.monotonic()
        seq = await push(client, bundle, _pushed_by(signer), note, signer=signer)
        if not as_json:
            print(f"pushed revision {bundle.revision}")
        return await _await_enforced(client, bundle.revision, seq, started, wait_s, as_json)


def _refused(message: str, as_json: bool) -> int:
    """A push or rollback refused here (the bundle does not compile, its tests fail, nothing to roll
    back to): ``policy_unavailable``, which the one table maps to exit 1, the policy commands' one
    failure code (not ``invalid_request``: that is 2, bad usage)."""
    return report_error(FleetError(ErrorCode.POLICY_UNAVAILABLE, message), as_json=as_json)


async def _await_enforced(
    client: Any, revision: str, seq: int, started: float, wait_s: float, as_json: bool
) -> int:
    """Wait until every live process has handled push ``seq``: each enforces ``revision``, or one
    refused that push (exit 1, with its reason)."""
    while True:
        reports = await statuses(client)
        behind = [r for r in reports if r.get("seq", 0) < seq or r["revision"] != revision]
        refused = [r for r in behind if r.get("refused") and r["refused"].get("seq") == seq]
        if not reports or not behind or refused or time.monotonic() - started > wait_s:
            return _enforced_outcome(revision, reports, behind, refused, time.monotonic() - started, as_json)
        await asyncio.sleep(0.05)


def _enforced_outcome(
    revision: str,
    reports: list[dict[str, Any]],
    behind: list[dict[str, Any]],
    refused: list[dict[str, Any]],
    seconds: float,
    as_json: bool,
) -> int:
    code = EXIT_FAILED if behind else EXIT_OK
    if as_json:
        outcome = {
            "revision": revision,
            "enforced": code == EXIT_OK,
            "processes": len(reports),
            "behind": [
                {**r, "why": f"refused: {r['refused']['error']}" if r in refused else "not yet"}
                for r in behind
            ],
            "seconds": round(seconds, 3),
        }
        print(json.dumps(outcome, indent=2, default=str))
    elif not reports:
        print("no running process reports its policy: nothing to wait for", file=sys.stderr)
    elif not behind:
        print(f"enforced by {len(reports)} processes within {seconds:.2f} s")
    else:
        for r in behind:
            why = f"refused: {r['refused']['error']}" if r in refused else "not yet"
            print(f"  {r['service']}: still {r['revision']} ({why})", file=sys.stderr)
    return code


async def roll_back(
    layout: StackLayout, wait_s: float, *, as_json: bool = False, signing: Signing = Signing()
) -> int:
    """``fleet policy rollback``: push the revision in force before the current one again, signed
    by the one rolling back."""
    try:
        signer, verifier = signer_of(layout, signing), verifier_of(layout)
    except PolicyError as exc:
        return _refused(f"refused: {exc.message}", as_json)
    async with _broker(layout) as client:
        if client is None:
            return EXIT_NOT_RUNNING
        started = time.monotonic()
        try:
            seq, bundle = await rollback(client, _pushed_by(signer), signer=signer, verifier=verifier)
        except PolicyError as exc:
            return _refused(exc.message, as_json)
        if not as_json:
            print(f"rolled back to revision {bundle.revision}")
        return await _await_enforced(client, bundle.revision, seq, started, wait_s, as_json)


def authorize(layout: StackLayout, author: str, key_file: Path, days: float, *, as_json: bool) -> int:
    """``fleet policy authorize``: print the operator's certificate that ``author``, holding the key
    in ``key_file`` (a public JWK or PEM), may push policy for ``days``."""
    operator_key = layout.key_file(OPERATOR_ID)
    try:
        if not operator_key.is_file():
            raise PolicyError(f"no operator key at {operator_key}")
        jwk = public_jwk_from_file(key_file)
        certificate = certify_author(
            SigningKey.load_or_create(operator_key), author, jwk, lifetime_s=days * 86400
        )
    except (OSError, ValueError) as exc:
        return report_error(FleetError(ErrorCode.INVALID_REQUEST, f"{key_file}: {exc}"), as_json=as_json)
    except PolicyError as exc:
        return _refused(exc.message, as_json)
    if as_json:
        print(json.dumps({"author": author, "kid": jwk["kid"], "days": days, "certificate": certificate}))
    else:
        print(certificate)
    return EXIT_OK


async def status(layout: StackLayout, *, as_json: bool) -> int:
    try:
        verifier = verifier_of(layout)
    except PolicyError as exc:
        return _refused(exc.message, as_json)
    async with _broker(layout) as client:
        if client is None:
            return EXIT_NOT_RUNNING
        history = await pushed(client, verifier)
        last = await last_push(client, verifier)
        reports = await statuses(client)
    current = history[-1][1].revision if history else None
    refused_push = (
        {"seq": last[0], "revision": last[1], "error": last[2]} if last is not None and last[2] else None
    )
    if as_json:
        print(json.dumps({"pushed": current, "refused_push": refused_push, "processes": reports}, indent=2))
        return EXIT_OK
    print(f"pushed   {current or '(nothing valid pushed: each process enforces the bundle it started with)'}")
    if refused_push:
        print(
            f"REFUSED  the last push (#{refused_push['seq']}, {refused_push['revision']}): {refused_push['error']}"
        )
    for r in reports:
        refused = (
            f"  REFUSED {r['refused'].get('revision', '?')}: {r['refused']['error']}"
            if r.get("refused")
            else ""
        )
        mark = "" if current is None or r["revision"] == current else "  (behind)"
        print(f"{r['service']:<18} {r['engine']:<9} {r['revision']}{mark}{refused}")
    return EXIT_OK


def _clock_time(timestamp: Any) -> str:
    """The local time of day of a decision's ``timestamp`` (RFC 3339; epoch seconds in records
    written before it was), or ``?`` if it says neither."""
    try:
        if isinstance(timestamp, int | float):
            moment = dt.datetime.fromtimestamp(float(timestamp), dt.UTC)
        else:
            moment = dt.datetime.fromisoformat(str(timestamp).replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        return "?"
    return moment.astimezone().strftime("%H:%M:%S")


async def decision_log(layout: StackLayout, *, follow: bool, as_json: bool, limit: int) -> int:
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    def show(record: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(record), flush=True)
            return
        allow = record.get("result", {}).get("allow") if isinstance(record.get("result"), dict) else None
        when = _clock_time(record.get("timestamp"))
        print(
            f"{when} {record['requested_by']:<16} {record['path']:<28} allow={allow} "
            f"{record['decision_id']} rev={record['bundles']['fleet']['revision']}",
            flush=True,
        )

    async with _broker(layout) as client:
        if client is None:
            return EXIT_NOT_RUNNING
        js = client.jetstream()
        try:
            info = await js.stream_info(DECISIONS_STREAM)
        except NotFoundError:
            print("no decision has been recorded yet", file=sys.stderr)
            return EXIT_OK
        # A message holds one or more decisions: the last ``limit`` messages hold the last ``limit``.
        start = max(1, info.state.last_seq - limit + 1) if limit else 1
        subscription = await js.subscribe(
            "fleet.decisions.>",
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        past: list[dict[str, Any]] = []  # read before catching up: only the last ``limit`` are shown
        caught_up = False
        while True:
            try:
                msg = await subscription.next_msg(timeout=3600 if caught_up else 1.0)
            except TimeoutError:
                msg = None
            records = [json.loads(line) for line in msg.data.split(b"\n")] if msg is not None else []
            if caught_up:
                for record in records:
                    show(record)
                continue
            past += records
            if msg is None or msg.metadata.num_pending == 0:
                caught_up = True
                for record in past[-limit:] if limit else past:
                    show(record)
                if not follow:
                    return EXIT_OK


def serve(directory: Path | None, host: str, port: int) -> int:
    import uvicorn

    from policy.rest_server import DecisionPoint, build_app

    token = os.environ.get("FLEET_OPA_TOKEN") or None
    if token is None and host not in ("127.0.0.1", "::1", "localhost"):
        print(
            "fleet: set FLEET_OPA_TOKEN to serve beyond loopback (writes change every decision)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        point = DecisionPoint(_load(directory) if directory else None)
    except PolicyError as exc:
        report_error(exc, as_json=False)
        return EXIT_FAILED
    app = BodySizeLimit(build_app(point, token), SERVE_MAX_BODY_BYTES)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return EXIT_OK
