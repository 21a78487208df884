"""The package boundaries of the architecture, enforced on every import statement in the tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("coordinator", "specialists", "mcp_servers")
LIBRARIES = ("registry", "policy", "memory")
FORBIDDEN: dict[str, set[str]] = {
    **{pkg: {other for other in SERVICES if other != pkg} for pkg in SERVICES},
    **{pkg: set(SERVICES) for pkg in LIBRARIES},
    # The kernel and the stack definition name services by string only, never by import.
    "fleet": set(SERVICES) | {"memory"},
    "deploy": set(SERVICES) | set(LIBRARIES),
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_what_its_boundary_forbids(package: str) -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in sorted(imported_top_levels(path) & FORBIDDEN[package])
    ]
    assert violations == []


def test_boundary_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom coordinator.graph import build_graph\nimport specialists.kit\n")
    assert imported_top_levels(bad) == {"os", "coordinator", "specialists"}
