"""The slim client as an outside caller gets it: installed into an empty virtual environment (no
server dependency comes with it), then, from that environment, a run started, its pause for a
person answered, and its result read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from fleetctl.testing.e2e import Stack

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# What the platform needs and an outside caller must not be made to install.
SERVER_PACKAGES = (
    "a2a",
    "mcp",
    "langgraph",
    "psycopg",
    "presidio_analyzer",
    "onnxruntime",
    "starlette",
    "uvicorn",
    "fleet",
)
MAX_INSTALLED_MB = 40  # measured: about 28 MB (16 of them cryptography's); the platform's environment: 1.4 GB
MAX_DOWNLOAD_MB = 10  # measured: 7.1 MB of wheels (4.8 of them cryptography's, 1.4 PyNaCl's)
VENV_TOOLS = ("pip", "setuptools", "pkg_resources", "_distutils_hack")  # every new venv's, not the client's

DRIVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from fleet_client import ClientCredentials, FleetClient, FleetClientError

    coordinator, key_file, tenant, binding = sys.argv[1:5]
    plan = {"steps": [{"id": "refund", "skill": "issue-refund", "input": {"subject": "Contoso", "amount_cents": 25000}}]}

    async def main():
        tokens = await ClientCredentials.from_card(coordinator, "operator", key_file)
        scopes = ("agent:invoke", "runs:approve")
        async with FleetClient(coordinator, tokens, tenant=tenant, scopes=scopes, binding=binding) as fleet:
            run_id = await fleet.start(plan=plan)
            waiting = await fleet.wait(run_id)
            answer = await fleet.approve(run_id, note="checked", awaited=waiting["wait"]["awaited"])
            result = await fleet.result(run_id)
            seen = [event["type"] async for event in fleet.events(run_id)]
            try:
                await fleet.get("no-such-run")
                missing = None
            except FleetClientError as exc:
                missing = exc.code
        print(json.dumps({"run_id": run_id, "waiting": waiting, "approve": answer, "result": result,
                          "events": seen, "missing": missing}))

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def client_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("client") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT / "client")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=outside_env(),
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def outside_env() -> dict[str, str]:
    """The environment of a process outside the platform: none of its settings, none of its paths."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FLEET_") and k != "PYTHONPATH"}


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def test_it_installs_alone_and_small(client_env: Path) -> None:
    probe = "import importlib.util, json; import fleet_client; print(json.dumps([m for m in %r if importlib.util.find_spec(m)]))"
    found = subprocess.run(
        [str(client_env / "bin" / "python"), "-c", probe % (SERVER_PACKAGES,)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=client_env,  # not the repository: its packages must not be found from here
        env=outside_env(),
    )
    assert json.loads(found.stdout) == []
    root = site_packages(client_env)
    size = sum(
        path.stat().st_size
        for path in root.rglob("*")
        if path.is_file() and not path.relative_to(root).parts[0].startswith(VENV_TOOLS)
    )
    assert size < MAX_INSTALLED_MB * 2**20, f"{size / 2**20:.1f} MB installed"


def test_what_it_downloads_is_a_few_mb(client_env: Path, tmp_path: Path) -> None:
    """What ``pip install agent-fleet-client`` fetches: its dependencies' wheels, as pip picks them
    for this interpreter."""
    fetched = subprocess.run(
        [
            str(client_env / "bin" / "python"),
            "-m",
            "pip",
            "download",
            "--quiet",
            "-d",
            str(tmp_path),
            str(ROOT / "client"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=outside_env(),
    )
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    files = {path.name: path.stat().st_size for path in tmp_path.iterdir() if path.is_file()}
    assert any(name.startswith("httpx-") for name in files), files
    assert not any(name.lower().startswith(("langgraph", "mcp-", "psycopg", "presidio")) for name in files), (
        files
    )
    assert sum(files.values()) < MAX_DOWNLOAD_MB * 2**20, files


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
def test_it_drives_a_run_from_start_to_approval_to_result(
    client_env: Path, stack: Stack, binding: str
) -> None:
    tenant = f"t{uuid.uuid4().hex[:10]}"
    env = outside_env()
    if stack.endpoints.get("tls_trust"):
        env["SSL_CERT_FILE"] = stack.endpoints["tls_trust"]
    driven = subprocess.run(
        [
            str(client_env / "bin" / "python"),
            "-c",
            DRIVER,
            stack.endpoints["coordinator"],
            str(stack.layout.key_file("operator")),
            tenant,
            binding,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=client_env,
        env=env,
    )
    assert driven.returncode == 0, driven.stderr
    report = json.loads(driven.stdout)
    assert report["waiting"]["state"] == "waiting" and report["waiting"]["wait"]["type"] == "approval"
    assert report["approve"]["applied"]
    refund = report["result"]["steps"]["refund"]
    assert (refund["status"], refund["amount_cents"], refund["approved_by"]) == (
        "refunded",
        25000,
        "operator",
    )
    assert report["events"][0] == "run.submitted" and report["events"][-1] == "run.completed"
    waited = report["events"].index("run.waiting")
    assert report["events"][waited + 1] == "approval.granted"  # the client's approval, recorded
    assert report["missing"] == "not_found"
