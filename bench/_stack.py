"""A local stack for benchmarks that need real services: ``fleet up --detach`` on a fresh data dir,
``fleet down`` afterwards (even when the benchmark fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fleet.layout import StackLayout


def _fleet(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@contextmanager
def running_stack(data_dir: Path, **settings: str) -> Iterator[tuple[StackLayout, dict[str, Any]]]:
    """A stack on ``data_dir`` with ``settings`` (``FLEET_*`` variables) on top of a clean environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")} | settings
    up = _fleet("up", "--data-dir", str(data_dir), "--detach", env=env)
    if up.returncode != 0:
        raise RuntimeError(f"fleet up failed:\n{up.stdout}\n{up.stderr}")
    layout = StackLayout.at(data_dir)
    try:
        yield layout, json.loads(layout.endpoints_file.read_text())
    finally:
        _fleet("down", "--data-dir", str(data_dir), env=env)
