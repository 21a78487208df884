"""What ``fleet up`` checks of a project's code before it starts anything, in a process of its own (the
project's folder first on its path, as the services will have it): that every entry's module imports
(a tool declared without scopes or annotations is refused there, by the tool-server kit) and that
every workflow's function builds a LangGraph ``StateGraph`` that compiles.

    python -m fleetctl.project_check FLEET_TOML
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from deploy.manifest import FleetManifest, ManifestError


def entries(manifest: FleetManifest) -> list[tuple[int | None, str, str]]:
    """(manifest line, module:function, kind) of every entry to check."""
    lines = manifest.path.read_text().splitlines()

    def line_of(entry: str) -> int | None:
        return next((n for n, text in enumerate(lines, 1) if f'"{entry}"' in text), None)

    found = [(line_of(spec.entry), spec.entry, "service") for spec in manifest.services]
    return found + [(line_of(entry), entry, "workflow") for _, entry in manifest.workflows]


def check(manifest: FleetManifest, timeout_s: float = 120.0) -> None:
    """Import and build the project's entries in a new process; a :class:`ManifestError` naming the
    entry's line and what went wrong if one does not."""
    path = os.pathsep.join([str(manifest.root), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, "-m", "fleetctl.project_check", str(manifest.path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=manifest.root,
        env={**os.environ, "PYTHONPATH": path},
    )
    if result.returncode == 0:
        return
    try:
        failed = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        failed = {"line": None, "entry": "?", "error": result.stderr.strip()[-500:]}
    raise ManifestError(
        manifest.path,
        failed["line"],
        f"{failed['entry']} does not load: {failed['error']}",
        "fix that module",
    )


def main(argv: list[str]) -> int:
    from langgraph.graph import StateGraph

    from deploy.manifest import load

    manifest = load(Path(argv[0]))
    sys.path.insert(0, str(manifest.root))
    for line, entry, kind in entries(manifest):
        module_name, _, function_name = entry.partition(":")
        try:
            found = getattr(importlib.import_module(module_name), function_name)
            if kind == "workflow":
                graph = found()
                if not isinstance(graph, StateGraph):
                    raise TypeError(f"it returned {type(graph).__name__}, not a StateGraph")
                graph.compile()
        except Exception as exc:
            print(json.dumps({"line": line, "entry": entry, "error": f"{type(exc).__name__}: {exc}"}))
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
