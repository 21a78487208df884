"""The policy plane: what a decision costs on each engine, and how soon a push is enforced.

- Decisions (target: embedded p50 <= 0.5 ms): ``LivePolicy.decide`` (what every service calls: the
  engine, the timeout, the decision log record) on a mix of the fleet's decisions, one at a time,
  with the embedded engine and with the OPA REST backend (``opa-python-client`` against ``fleet
  policy serve`` in its own process). Each input is new (the embedded engine's memo never answers),
  and, for the embedded engine, also the same inputs repeated (as services repeat them). Baselines
  in the same run: regorus evaluating the same rule bare (the embedded engine's floor), and
  ``GET /health`` to the same server through the same client (the REST backend's floor).
- Push to enforced (target <= 2 s, across processes): ``FOLLOWERS`` processes, each a LivePolicy on
  its own NATS connection; the time from a push to the moment the last of them has the new revision
  in force, per push. Baseline: the time from the push to its arrival in the slowest process (the
  broker's part).

Run: ``.venv/bin/python -m bench policy_plane``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx

from fleet.keys import SigningKey
from fleet.natsconn import connect
from fleetctl.testing.nats import embedded_nats, free_port
from policy import Bundle, PolicySigner, RegorusEngine
from policy.live import LivePolicy, push, statuses
from policy.opa_rest import OpaRestEngine

EMBEDDED_TARGET_P50_MS = 0.5
ENFORCED_TARGET_S = 2.0
FOLLOWERS = 4
PUSHES = 10


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 4),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000, 4),
        "per_s": round(len(ordered) / sum(ordered)),
        "n": len(ordered),
    }


def _inputs(n: int) -> list[tuple[str, dict[str, Any]]]:
    """A mix of the fleet's decisions, each input distinct (``i`` in an argument or the tenant)."""
    mix: list[tuple[str, dict[str, Any]]] = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            mix.append(("fleet.tools.decision", {"server": "mcp-sql", "tool": "query", "tenant": "acme",
                        "subject": "sql-analyst", "agent": "sql-analyst", "actors": [], "scopes": ["sql:query"],
                        "declared_scopes": [], "arguments": {"sql_length": i}}))  # fmt: skip
        elif kind == 1:
            mix.append(("fleet.tools.decision", {"server": "mcp-outbox", "tool": "post_webhook", "tenant": "acme",
                        "subject": "publisher", "agent": "publisher", "actors": [], "scopes": ["outbox:write"],
                        "declared_scopes": [], "arguments": {"destination": "customers", "n": i}}))  # fmt: skip
        elif kind == 2:
            mix.append(
                ("fleet.routing.decision", {"text": f"any outlier in the invoices? #{i}", "tenant": "acme"})
            )
        else:
            mix.append(("fleet.budgets.decision", {"tenant": f"tenant-{i}"}))
    return mix


async def _timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


@contextlib.contextmanager
def _decision_point() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetctl", "policy", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(10)


async def decisions(n: int = 4000) -> dict[str, Any]:
    bundle = Bundle.load()

    async def embedded_factory(b: Bundle) -> RegorusEngine:
        return RegorusEngine(b)

    embedded = LivePolicy("bench", embedded_factory, RegorusEngine(bundle))
    bare = RegorusEngine(bundle).raw_engine()
    fresh, repeated = _inputs(n), _inputs(40)
    result: dict[str, Any] = {}

    async def bare_eval(path: str, document: dict[str, Any]) -> None:
        bare.set_input_json(json.dumps(document))
        bare.eval_rule_as_json(f"data.{path}")

    for path, document in fresh[:200]:  # warm both
        await embedded.decide(path, document)
        await bare_eval(path, document)
    samples: dict[str, list[float]] = {"embedded": [], "embedded_repeated": [], "regorus_bare": []}
    for i, (path, document) in enumerate(fresh):
        samples["embedded"].append(await _timed(functools.partial(embedded.decide, path, document)))
        samples["regorus_bare"].append(await _timed(functools.partial(bare_eval, path, document)))
        again = repeated[i % len(repeated)]
        samples["embedded_repeated"].append(await _timed(functools.partial(embedded.decide, *again)))
    for name, values in samples.items():
        result[name] = _summary(values)
    result["embedded_target_p50_ms"] = EMBEDDED_TARGET_P50_MS

    with _decision_point() as url:
        rest = await OpaRestEngine.load(url, bundle)
        try:
            remote = LivePolicy("bench", lambda b: OpaRestEngine.load(url, b), rest, engine_name="opa")
            for path, document in fresh[:200]:
                await remote.decide(path, document)
                assert await rest.healthy()
            rest_samples, floor = [], []
            for path, document in fresh[: n // 4]:
                rest_samples.append(await _timed(functools.partial(remote.decide, path, document)))
                floor.append(await _timed(rest.healthy))
        finally:
            await rest.aclose()
    result["opa_rest"] = _summary(rest_samples)
    result["http_floor"] = _summary(floor)
    return result


FOLLOWER = """
import asyncio, json, sys
from fleet.keys import SigningKey
from fleet.natsconn import connect
from policy import Bundle, PushVerifier, RegorusEngine
from policy.live import LivePolicy, enforcing

async def main(url, name, operator_jwk):
    async def factory(bundle):
        return RegorusEngine(bundle)
    client = await connect(url, name)
    verifier = PushVerifier(json.loads(operator_jwk))
    async with enforcing(LivePolicy(name, factory, RegorusEngine(Bundle.load()), verifier=verifier), client):
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


async def push_to_enforced(nats_url: str) -> dict[str, Any]:
    operator = SigningKey.generate()  # the followers verify every push with its public key
    followers = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            FOLLOWER,
            nats_url,
            f"follower-{i}",
            json.dumps(operator.public_jwk()),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        for i in range(FOLLOWERS)
    ]
    client = await connect(nats_url, "bench-pusher")
    enforced, arrived = [], []
    try:
        for process in followers:
            assert process.stdout is not None and (await process.stdout.readline()).strip() == b"ready"
        base = Bundle.load()
        for k in range(PUSHES):
            config = json.loads(json.dumps(base.data["config"]))
            config["tools"]["mcp-sql"]["query"]["max_sql_length"] = 1000 + k
            bundle = base.with_data({**base.data, "config": config}, f"bench-{k}")
            pushed_at = time.time()
            await push(client, bundle, "bench", signer=PolicySigner.operator(operator))
            deadline = time.monotonic() + 10
            while True:
                reports = [r for r in await statuses(client) if r["service"].startswith("follower-")]
                if len(reports) == FOLLOWERS and all(r["revision"] == bundle.revision for r in reports):
                    break
                assert time.monotonic() < deadline, reports
                await asyncio.sleep(0.01)
            enforced.append(max(r["since"] for r in reports) - pushed_at)
            arrived.append(max(r["received_at"] for r in reports) - pushed_at)
            await asyncio.sleep(0.2)
    finally:
        await client.close()
        for process in followers:
            process.terminate()
            await process.wait()
    return {
        "followers": FOLLOWERS,
        "pushes": PUSHES,
        "enforced": {
            "p50_ms": round(statistics.median(enforced) * 1000, 1),
            "max_ms": round(max(enforced) * 1000, 1),
        },
        "arrived": {
            "p50_ms": round(statistics.median(arrived) * 1000, 1),
            "max_ms": round(max(arrived) * 1000, 1),
        },
        "enforced_target_s": ENFORCED_TARGET_S,
    }


def main() -> dict[str, Any]:
    result: dict[str, Any] = {"benchmark": "policy_plane"}
    result.update(asyncio.run(decisions()))
    with embedded_nats() as url:
        result["push"] = asyncio.run(push_to_enforced(url))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
