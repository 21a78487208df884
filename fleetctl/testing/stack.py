"""A local stack for benchmarks that need real services: ``fleet up --detach`` on a fresh data dir,
``fleet down`` afterwards (even when the benchmark fails).

The benchmarks of capacity (runs per second, pauses, delegation, ...) send one tenant's work, and the
shipped policy lets one tenant have only 4 runs in flight, 2 while another tenant has work
(``config.limits.fair.work``: a share between tenants, not a capacity limit). Their stack runs the
shipped bundle with those caps raised to :data:`CAPACITY_MAX_IN_FLIGHT`, as an operator sizes them
for a fleet that serves one tenant; the
abuse benchmark, which measures the share, keeps the shipped policy (``shipped_policy=True``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleetctl.layout import StackLayout
from policy import DEFAULT_BUNDLE_DIR

CAPACITY_MAX_IN_FLIGHT = 64


def capacity_bundle(bundle: Path, source: Path = DEFAULT_BUNDLE_DIR) -> Path:
    """A copy of the bundle at ``source`` in ``bundle`` (a new directory) whose per-tenant caps of
    runs in flight (alone and shared) are :data:`CAPACITY_MAX_IN_FLIGHT`."""
    shutil.copytree(source, bundle)
    data = json.loads((bundle / "data.json").read_text())
    work = data["config"]["limits"]["fair"]["work"]["default"]
    work["max_in_flight"] = work["shared_in_flight"] = CAPACITY_MAX_IN_FLIGHT
    (bundle / "data.json").write_text(json.dumps(data, indent=2))
    return bundle


def _fleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetctl", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@contextmanager
def running_stack(data_dir: Path, **settings: str) -> Iterator[tuple[StackLayout, dict[str, Any]]]:
    """A stack on ``data_dir`` with ``settings`` (``FLEET_*`` variables) on top of a clean environment,
    its policy bundle (``FLEET_POLICY_DIR``, or the shipped one) with the capacity cap of runs in
    flight."""
    source = Path(settings.get("FLEET_POLICY_DIR", DEFAULT_BUNDLE_DIR))
    bundle = capacity_bundle(data_dir.with_name(data_dir.name + "-policy"), source)
    with running_shipped_stack(data_dir, **(settings | {"FLEET_POLICY_DIR": str(bundle)})) as running:
        yield running


@contextmanager
def running_shipped_stack(data_dir: Path, **settings: str) -> Iterator[tuple[StackLayout, dict[str, Any]]]:
    """A stack on ``data_dir`` with ``settings`` (``FLEET_*`` variables) on top of a clean environment,
    and the policy they name (the shipped bundle unless ``FLEET_POLICY_DIR``) as it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")} | settings
    up = _fleet("up", "--data-dir", str(data_dir), "--detach", env=env)
    if up.returncode != 0:
        raise RuntimeError(f"fleet up failed:\n{up.stdout}\n{up.stderr}")
    layout = StackLayout.at(data_dir)
    try:
        yield layout, json.loads(layout.endpoints_file.read_text())
    finally:
        _fleet("down", "--data-dir", str(data_dir), env=env)
