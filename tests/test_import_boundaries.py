"""The package boundaries of the architecture, enforced on every import statement in the tree.

The packages stand in floors: each may import only packages below it, and none of its own floor
(a service never imports another service). The graph is drawn from every import statement,
function-level ones included, so a lazy import cannot hide an arrow that runs back up; and within
each package no two modules import each other, however far round.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each package, and the project packages it may import. Floor 0 is the kernel.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "fleet": frozenset(),
    "policy": frozenset({"fleet"}),
    "deploy": frozenset({"fleet", "policy"}),  # a project's bundle is the platform's plus its own
    "registry": frozenset({"fleet", "policy"}),
    "memory": frozenset({"fleet", "policy"}),
    "coordinator": frozenset({"fleet", "policy", "registry"}),
    "specialists": frozenset({"fleet", "policy", "registry"}),
    "mcp_servers": frozenset({"fleet", "policy", "registry", "memory"}),
    "fleetctl": frozenset({"fleet", "policy", "deploy", "registry", "memory"}),
}
PROJECT = frozenset(MAY_IMPORT) | {"bench", "tests"}


def imported_modules(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, at any depth of its code (a lazy import is an arrow too):
    for ``from a import b``, both ``a`` and ``a.b`` (``b`` may be a module or a name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", "") == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value


def imported_top_levels(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


# The slim client (client/, its own distribution): the standard library and what it declares.
CLIENT_MAY_IMPORT = frozenset({"httpx", "jwt", "cryptography", "nats", "nkeys", "fleet_client", "__future__"})


def test_the_slim_client_imports_only_the_standard_library_and_its_declared_dependencies() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "client").rglob("*.py"))
        for name in sorted(imported_top_levels(path) - CLIENT_MAY_IMPORT - set(sys.stdlib_module_names))
    ]
    assert violations == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_the_packages_below_it(package: str) -> None:
    allowed = MAY_IMPORT[package] | {package}
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(package)
        for name in sorted((imported_top_levels(path) & PROJECT) - allowed)
    ]
    assert violations == []


def test_the_floors_have_no_cycle() -> None:
    """The allowed arrows themselves only run down: no package may, through others, import itself."""

    def below(package: str, seen: frozenset[str]) -> None:
        for other in MAY_IMPORT[package]:
            assert other not in seen, f"{' -> '.join(seen)} -> {other}"
            below(other, seen | {other})

    for package in MAY_IMPORT:
        below(package, frozenset({package}))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _arrows(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports: ``from a import b`` is an arrow to ``a.b`` when that is
    a module, else to ``a`` (a package's ``__init__``, whose name ``b`` it takes)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = node.module
            names = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def module_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module of ``packages`` to the modules of the project it imports."""
    paths = [path for package in packages for path in sources(package)]
    known = {module_name(path) for path in paths}
    return {module_name(path): _arrows(path, known) - {module_name(path)} for path in paths}


def test_no_two_modules_import_each_other_even_lazily() -> None:
    assert _cycles(module_graph(tuple(MAY_IMPORT))) == []


def test_the_checks_see_a_violation_and_a_cycle(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\ndef f():\n    from coordinator.engine.graph import build_graph\nimport specialists.kit\n"
    )
    assert imported_top_levels(bad) == {"os", "coordinator", "specialists"}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert (_wing("coordinator.engine.graph"), _wing("coordinator"), _wing("fleet.errors")) == (
        "engine",
        None,
        None,
    )
    assert "control" not in COORDINATOR_WINGS["engine"]  # the engine may not reach up to control


def test_no_test_imports_another_test_or_a_conftest() -> None:
    """Tests and benchmarks share helpers through ``fleetctl.testing`` (and helper modules of
    their own folder), never by importing a test module or a ``conftest``."""
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in ("tests", "bench")
        for path in sources(folder)
        for name in sorted(set(imported_modules(path)))
        if name.split(".")[0] == "tests"
        and any(part.startswith("test_") or part == "conftest" for part in name.split(".")[1:])
    ]
    assert violations == []


def test_the_benchmarks_import_nothing_from_the_tests() -> None:
    """The benchmarks take what they share with the tests (a running stack, the pause scenario)
    from ``fleetctl.testing``, which ships with the project."""
    used = {
        name for path in sources("bench") for name in imported_modules(path) if name.split(".")[0] == "tests"
    }
    assert used == set(), used


# The coordinator's wings, in floors: each may import only the wings named here (and itself);
# ``coordinator.server``, the composition root of both processes, may import every wing, and no
# wing imports it.
COORDINATOR_WINGS: dict[str, frozenset[str]] = {
    "record": frozenset(),
    "planning": frozenset({"record"}),
    "engine": frozenset({"record", "planning"}),
    "control": frozenset({"record", "planning"}),
    "a2a_surface": frozenset({"record", "planning", "engine", "control"}),
}


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "coordinator" else None


def test_the_coordinator_is_wings_and_a_composition_root() -> None:
    """Nothing of the coordinator is left beside its wings but the server and the package."""
    flat = sorted(p.name for p in (ROOT / "coordinator").glob("*.py"))
    wings = sorted(p.name for p in (ROOT / "coordinator").iterdir() if (p / "__init__.py").exists())
    assert flat == ["__init__.py", "server.py"]
    assert wings == sorted(COORDINATOR_WINGS)


def test_a_coordinator_wing_imports_only_the_wings_below_it() -> None:
    violations = []
    for path in sources("coordinator"):
        wing = _wing(module_name(path))
        if wing not in COORDINATOR_WINGS:
            continue  # the server and the package itself
        for name in sorted(set(imported_modules(path))):
            other = _wing(name)
            if other is not None and other != wing and other not in COORDINATOR_WINGS[wing]:
                violations.append(f"{path.relative_to(ROOT)} imports {name}")
    assert violations == []


def test_the_wing_floors_have_no_cycle() -> None:
    def below(wing: str, seen: frozenset[str]) -> None:
        for other in COORDINATOR_WINGS[wing]:
            assert other not in seen, f"{' -> '.join(seen)} -> {other}"
            below(other, seen | {other})

    for wing in COORDINATOR_WINGS:
        below(wing, frozenset({wing}))
