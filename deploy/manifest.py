"""A user's fleet manifest, ``fleet.toml``: the specialists and MCP servers of their own project, and
the policy they add, the way ``langgraph.json`` declares a project's graphs. ``fleet up`` runs them
beside the platform's core (the registry, the coordinator and its workers, the memory server and the
console), and beside the platform's demo agents too when the manifest asks for them; ``fleet deploy
render`` derives compose and Kubernetes files for the same roster. Each entry becomes one
:class:`~deploy.local_stack.ServiceSpec`, the record everything else is derived from::

    [fleet]
    name = "support-desk"
    policy = "policy"              # Rego and data.json added to the platform's bundle (optional)
    demo_agents = false            # also run the platform's invoice demo agents (default false)
    dependencies = ["acme-crm"]    # packages the project's image installs (``fleet deploy render``)

    [[specialists]]
    id = "triage"
    entry = "support.triage:main"  # module:function, the function the kit's ``serve`` is called from
    skills = ["triage-ticket"]
    scopes = ["tickets:write"]     # what its tokens may carry besides registry and memory access
    calls = ["mcp-tickets"]        # the MCP servers it calls
    internet = false               # whether it may reach outside the deployment (an LLM, say)

    [[mcp_servers]]
    id = "mcp-tickets"
    entry = "support.tickets:main"

    [[mcp_servers]]
    id = "mcp-crm"
    entry_point = "crm"            # an installed package's: its entry point "crm" of agent_fleet.mcp_servers

    [[workflows]]
    name = "handle-ticket"         # started by name: skill workflow:handle-ticket of the coordinator
    graph = "support.flow:build"   # a function returning the workflow's LangGraph StateGraph

Module paths are resolved against the manifest's folder first (it is put on ``PYTHONPATH`` of every
service), then against the installed packages. An installed package may publish its services and
workflows as entry points, in the groups ``agent_fleet.specialists``, ``agent_fleet.mcp_servers`` and
``agent_fleet.workflows`` (``[project.entry-points."agent_fleet.mcp_servers"] crm =
"acme_crm.server:main"``); a manifest names one with ``entry_point`` instead of ``entry`` (or
``graph``). What a service may do (its skills, scopes, calls and internet access) is still written
in the manifest: a package grants itself nothing. A manifest that names a missing module or function,
repeats a service id, names a skill or a server nobody offers, or has a key this module does not know
is refused before anything starts: a :class:`ManifestError` (``manifest_invalid``) with the file, the
line and a fix.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import shutil
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deploy.local_stack import (
    DEFAULT_WORKERS,
    KIND_RESOURCES,
    MEMORY,
    SERVICES,
    Resources,
    ServiceKind,
    ServiceSpec,
    stack_services,
)
from fleet.errors import ErrorCode, FleetError

MANIFEST_NAME = "fleet.toml"
# The platform's services every fleet runs; the rest of SERVICES are the invoice demo's agents.
CORE_KINDS = frozenset({"registry", "coordinator", "worker", "console"})
CORE_IDS = frozenset({"mcp-memory"})
# The platform's packages: a project's module or package of one of these names would be imported
# instead of the platform's (the project's folder comes first on the path).
PLATFORM_PACKAGES = frozenset(
    {
        "fleet",
        "fleetctl",
        "coordinator",
        "specialists",
        "mcp_servers",
        "registry",
        "policy",
        "memory",
        "deploy",
    }
)
RESERVED_IDS = frozenset({"operator", "enroll", "bootstrap", "keygen", "nats", "postgres", "qdrant", "opa"})
SERVICE_ID = re.compile(r"[a-z][a-z0-9-]{0,40}[a-z0-9]")
SKILL_ID = re.compile(r"[a-z][a-z0-9-]{0,62}")
SCOPE = re.compile(r"[a-z][a-z0-9_-]*:[a-z][a-z0-9_*-]*")
ENTRY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*)")
# What every service of a kind may ask the token service for (enrollment), besides its own scopes.
KIND_SCOPES: dict[str, tuple[str, ...]] = {
    "specialist": ("registry:read", "registry:write", *MEMORY),
    "mcp_server": ("registry:read", "registry:write"),
}
TABLES: dict[str, ServiceKind] = {"specialists": "specialist", "mcp_servers": "mcp_server"}
WORKFLOWS = "workflows"
WORKFLOW_KEYS = frozenset({"name", "graph", "entry_point"})
# The entry-point groups an installed package publishes its services and workflows in.
ENTRY_POINT_GROUPS = {
    "specialist": "agent_fleet.specialists",
    "mcp_server": "agent_fleet.mcp_servers",
    "workflow": "agent_fleet.workflows",
}
WORKFLOW_SKILL_PREFIX = "workflow:"  # a workflow's skill on the coordinator's card
FLEET_KEYS = frozenset({"name", "policy", "demo_agents", "dependencies"})
# A requirement as pip takes one (a name, extras, a version specifier): nothing a shell would read.
REQUIREMENT = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?([<>=!~]=?[A-Za-z0-9.*+!-]+(,[<>=!~]=?[A-Za-z0-9.*+!-]+)*)?"
)
SERVICE_KEYS: dict[str, frozenset[str]] = {
    "specialist": frozenset(
        {"id", "entry", "entry_point", "skills", "scopes", "calls", "internet", "resources", "env"}
    ),
    "mcp_server": frozenset(
        {"id", "entry", "entry_point", "scopes", "calls", "internet", "resources", "env"}
    ),
}
RESOURCE_KEYS = frozenset({"cpu", "memory", "cpu_limit", "memory_limit"})
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti)?")
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


class ManifestError(FleetError):
    """A manifest that cannot be run: where (file and line) and how to fix it are in ``details``."""

    def __init__(self, path: Path, line: int | None, problem: str, fix: str) -> None:
        where = f"{path}:{line}" if line else str(path)
        super().__init__(
            ErrorCode.MANIFEST_INVALID,
            f"{where}: {problem}; {fix}",
            details={"file": str(path), "line": line, "problem": problem, "fix": fix},
        )


@dataclass(frozen=True, slots=True)
class FleetManifest:
    """A loaded and checked manifest."""

    path: Path
    name: str
    services: tuple[ServiceSpec, ...]  # the project's own, in the manifest's order
    policy_dir: Path | None
    demo_agents: bool
    workflows: tuple[tuple[str, str], ...] = ()  # (name, module:function building its StateGraph)
    dependencies: tuple[str, ...] = ()  # installed into the project's image by ``fleet deploy render``

    @property
    def workflows_setting(self) -> str:
        """``FLEET_WORKFLOWS`` for the coordinator and the workers: the workflows as JSON."""
        return json.dumps(dict(self.workflows), sort_keys=True)

    @property
    def root(self) -> Path:
        """The project's folder: where its modules are found first."""
        return self.path.parent

    def roster(self, workers: int) -> tuple[ServiceSpec, ...]:
        """Every service of this fleet with ``workers`` workers: the platform's core (and its demo
        agents if asked for), then the project's own."""
        platform = tuple(
            self._running_workflows(spec)
            for spec in stack_services(workers)
            if self.demo_agents or _is_core(spec)
        )
        return (*platform, *self.services)

    def _running_workflows(self, spec: ServiceSpec) -> ServiceSpec:
        """The coordinator offers the workflows (its card's skills, which its enrollment names)
        and the workers run them (``FLEET_WORKFLOWS``, as both are deployed)."""
        if not self.workflows or spec.kind not in ("coordinator", "worker"):
            return spec
        env = (*spec.env, ("FLEET_WORKFLOWS", self.workflows_setting))
        if spec.kind == "worker":
            return replace(spec, env=env)
        skills = (*spec.skills, *(WORKFLOW_SKILL_PREFIX + name for name, _ in self.workflows))
        return replace(spec, env=env, skills=skills)


def _is_core(spec: ServiceSpec) -> bool:
    return spec.kind in CORE_KINDS or spec.id in CORE_IDS


def load(path: Path) -> FleetManifest:
    """Read and check the manifest at ``path`` (see the module's docstring); a
    :class:`ManifestError` says what is wrong, where, and how to fix it."""
    path = path.resolve()
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(path, None, f"cannot be read ({exc.strerror})", "check the path") from exc
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(path, None, f"is not valid TOML: {exc}", "fix the syntax there") from exc
    return _Checker(path, text).manifest(document)


class _Checker:
    """Checks one manifest's document, pointing at the lines of what it refuses."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    # ------------------------------------------------------------------ where things are
    def line_of(self, table: str, index: int | None = None, key: str | None = None) -> int | None:
        """The line of ``[table]`` (or the ``index``-th ``[[table]]``), or of ``key`` within it."""
        header = re.compile(rf"\s*\[\[?\s*{re.escape(table)}\s*\]\]?\s*(#.*)?$")
        starts = [n for n, line in enumerate(self.lines, 1) if header.match(line)]
        if not starts or (index is not None and index >= len(starts)):
            return None
        start = starts[index or 0]
        if key is None:
            return start
        assignment = re.compile(rf"\s*{re.escape(key)}\s*=")
        for n in range(start + 1, len(self.lines) + 1):
            line = self.lines[n - 1]
            if line.lstrip().startswith("["):
                break
            if assignment.match(line):
                return n
        return start

    def refuse(self, line: int | None, problem: str, fix: str) -> ManifestError:
        return ManifestError(self.path, line, problem, fix)

    # ------------------------------------------------------------------ the document
    def manifest(self, document: dict[str, Any]) -> FleetManifest:
        self.check_shadows()
        for key in document:
            if key != "fleet" and key != WORKFLOWS and key not in TABLES:
                raise self.refuse(
                    self.line_of(key),
                    f"unknown table [{key}]",
                    "use [fleet], [[specialists]], [[mcp_servers]] or [[workflows]]",
                )
        fleet = document.get("fleet", {})
        if not isinstance(fleet, dict):
            raise self.refuse(None, "fleet must be a table", "write it as [fleet]")
        self.known_keys(fleet, FLEET_KEYS, "fleet", None)
        name = fleet.get("name", self.path.parent.name)
        if not isinstance(name, str) or not name:
            raise self.refuse(
                self.line_of("fleet", None, "name"), "name must be a string", 'name = "my-fleet"'
            )
        demo_agents = fleet.get("demo_agents", False)
        if not isinstance(demo_agents, bool):
            raise self.refuse(
                self.line_of("fleet", None, "demo_agents"),
                "demo_agents must be true or false",
                "demo_agents = false",
            )
        services = [
            self.service(entry, table, kind, index)
            for table, kind in TABLES.items()
            for index, entry in enumerate(self.entries(document, table))
        ]
        platform = {spec.id for spec in stack_services(1)} | {spec.id for spec in SERVICES}
        self.check_ids(services, platform)
        roster = [spec for spec in SERVICES if demo_agents or _is_core(spec)] + services
        self.check_calls(services, roster)
        self.check_skills(services, roster)
        policy_dir = self.policy_dir(fleet.get("policy"))
        workflows = self.workflows(self.entries(document, WORKFLOWS))
        dependencies = self.names(
            fleet.get("dependencies", []),
            REQUIREMENT,
            self.line_of("fleet", None, "dependencies"),
            "dependencies",
            'dependencies = ["acme-crm>=1.2"]',
            like="requirements as pip takes them (a name, [extras], versions)",
        )
        return FleetManifest(
            self.path, name, tuple(services), policy_dir, demo_agents, workflows, dependencies
        )

    def workflows(self, entries: list[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
        found: dict[str, int | None] = {}
        out = []
        for index, entry in enumerate(entries):
            self.known_keys(entry, WORKFLOW_KEYS, WORKFLOWS, index)
            name = entry.get("name")
            line = self.line_of(WORKFLOWS, index, "name")
            if not isinstance(name, str) or not SKILL_ID.fullmatch(name):
                raise self.refuse(
                    line,
                    f"a workflow's name is lowercase letters, digits and dashes, not {name!r}",
                    'name = "handle-ticket"',
                )
            if name in found:
                raise self.refuse(
                    line,
                    f"workflow {name} is declared twice (first on line {found[name]})",
                    "give each workflow its own name",
                )
            found[name] = line
            graph = self.target(entry, "graph", "workflow", WORKFLOWS, index)
            graph_line = self.line_of(WORKFLOWS, index, "graph")
            out.append((name, self.entry_point(graph, graph_line, "def {}() -> StateGraph")))
        return tuple(out)

    def check_shadows(self) -> None:
        """Refuse a project module or package named like one of the platform's packages."""
        root = self.path.parent
        for name in sorted(PLATFORM_PACKAGES):
            if (root / f"{name}.py").is_file() or (root / name / "__init__.py").is_file():
                raise self.refuse(
                    None,
                    f"{root / name} has the name of the platform's package {name}, which it would hide",
                    f"rename it (for example my_{name})",
                )

    def entries(self, document: dict[str, Any], table: str) -> list[dict[str, Any]]:
        entries = document.get(table, [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise self.refuse(
                self.line_of(table), f"{table} must be an array of tables", f"write each as [[{table}]]"
            )
        return entries

    def known_keys(
        self, table: Mapping[str, Any], known: frozenset[str], name: str, index: int | None
    ) -> None:
        for key in table:
            if key not in known:
                raise self.refuse(
                    self.line_of(name, index, key),
                    f"unknown key {key!r} in {name}",
                    f"the keys are {', '.join(sorted(known))}",
                )

    def service(self, entry: dict[str, Any], table: str, kind: ServiceKind, index: int) -> ServiceSpec:
        self.known_keys(entry, SERVICE_KEYS[kind], table, index)

        def at(key: str | None = None) -> int | None:
            return self.line_of(table, index, key)

        service_id = entry.get("id")
        if not isinstance(service_id, str) or not SERVICE_ID.fullmatch(service_id):
            raise self.refuse(
                at("id"),
                f"a service id must be 2-42 lowercase letters, digits and dashes, not {service_id!r}",
                'for example id = "triage"',
            )
        if kind == "mcp_server" and not service_id.startswith("mcp-"):
            raise self.refuse(
                at("id"),
                f"an MCP server's id starts with mcp-, not {service_id!r}",
                f'id = "mcp-{service_id}"',
            )
        entry_point = self.entry_point(self.target(entry, "entry", kind, table, index), at("entry"))
        skills = self.names(
            entry.get("skills", []), SKILL_ID, at("skills"), "skills", 'skills = ["triage-ticket"]'
        )
        if kind == "specialist" and not skills:
            raise self.refuse(at(), f"specialist {service_id} offers no skill", 'add skills = ["a-skill"]')
        scopes = self.names(
            entry.get("scopes", []), SCOPE, at("scopes"), "scopes", 'scopes = ["tickets:write"]'
        )
        calls = self.names(
            entry.get("calls", []), SERVICE_ID, at("calls"), "calls", 'calls = ["mcp-tickets"]'
        )
        internet = entry.get("internet", False)
        if not isinstance(internet, bool):
            raise self.refuse(at("internet"), "internet must be true or false", "internet = false")
        return ServiceSpec(
            service_id,
            kind,
            entry_point,
            scopes=tuple(dict.fromkeys((*KIND_SCOPES[kind], *scopes))),
            mcp_path="/mcp" if kind == "mcp_server" else "",
            skills=skills,
            calls=calls,
            internet=internet,
            resources=self.resources(entry.get("resources"), kind, at("resources")),
            env=self.env(entry.get("env", {}), at("env")),
            origin=f"{self.path}:{at('id') or at()}",
        )

    def target(self, entry: Mapping[str, Any], key: str, kind: str, table: str, index: int) -> object:
        """What ``entry[key]`` names (``module:function``), or the value of the installed entry point
        ``entry["entry_point"]`` names in ``kind``'s group: one of the two, never both."""
        name = entry.get("entry_point")
        if name is None:
            return entry.get(key)
        line = self.line_of(table, index, "entry_point")
        if key in entry:
            raise self.refuse(line, f"both {key} and entry_point are given", "keep one of them")
        group = ENTRY_POINT_GROUPS[kind]
        if not isinstance(name, str) or not name:
            raise self.refuse(line, "entry_point must be a name", 'entry_point = "crm"')
        with _on_path(self.path.parent):
            found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
        publishers = sorted({ep.dist.name if ep.dist is not None else "?" for ep in found})
        if not found:
            raise self.refuse(
                line,
                f"no installed package publishes entry point {name!r} in {group}",
                f'install the package that does (pip install ...), or write {key} = "module:function"',
            )
        if len({ep.value for ep in found}) > 1:
            raise self.refuse(
                line,
                f"entry point {name!r} of {group} is published by {', '.join(publishers)}, differently",
                f'uninstall all but one, or write {key} = "module:function"',
            )
        return found[0].value

    def entry_point(self, value: object, line: int | None, signature: str = "async def {}(settings)") -> str:
        if not isinstance(value, str) or not ENTRY.fullmatch(value):
            raise self.refuse(
                line, f"entry must be module:function, not {value!r}", 'entry = "support.triage:main"'
            )
        module, function = value.split(":")
        source = self.module_source(module)
        if source is None:
            raise self.refuse(
                line,
                f"no module {module} in {self.path.parent} or the installed packages",
                f"create {module.replace('.', '/')}.py beside {self.path.name}, or install the package",
            )
        if source and not _defines(source, function):
            raise self.refuse(
                line,
                f"module {module} defines no function {function}",
                f"add `{signature.format(function)}` to it",
            )
        return value

    def module_source(self, module: str) -> str | None:
        """The module's source text ('' when it has none to read, such as a compiled module), or
        None when it cannot be found; the project's folder is searched first."""
        local = self.path.parent.joinpath(*module.split("."))
        for candidate in (local.with_suffix(".py"), local / "__init__.py"):
            if candidate.is_file():
                return candidate.read_text()
        with _on_path(self.path.parent):
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                return None
        if spec is None:
            return None
        origin = Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
        return origin.read_text() if origin is not None else ""

    def names(
        self,
        value: object,
        pattern: re.Pattern[str],
        line: int | None,
        key: str,
        example: str,
        like: str = "",
    ) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) and pattern.fullmatch(v) for v in value):
            raise self.refuse(
                line,
                f"{key} must be a list of {like or 'names like ' + pattern.pattern}, not {value!r}",
                example,
            )
        return tuple(dict.fromkeys(value))

    def resources(self, value: object, kind: str, line: int | None) -> Resources | None:
        if value is None:
            return None
        if not isinstance(value, dict) or set(value) - RESOURCE_KEYS:
            raise self.refuse(
                line,
                "resources takes cpu, memory, cpu_limit, memory_limit",
                'resources = { memory = "512Mi" }',
            )
        for key, quantity in value.items():
            if not isinstance(quantity, str) or not QUANTITY.fullmatch(quantity):
                raise self.refuse(
                    line, f"resources.{key} is not a quantity: {quantity!r}", 'for example "250m" or "1Gi"'
                )
        base = KIND_RESOURCES.get(kind, Resources())
        return Resources(
            value.get("cpu", base.cpu),
            value.get("memory", base.memory),
            value.get("cpu_limit", base.cpu_limit),
            value.get("memory_limit", base.memory_limit),
        )

    def env(self, value: object, line: int | None) -> tuple[tuple[str, str], ...]:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and ENV_NAME.fullmatch(k) and isinstance(v, str) for k, v in value.items()
        ):
            raise self.refuse(
                line, "env must map UPPER_CASE names to strings", 'env = { SUPPORT_QUEUE = "tier-1" }'
            )
        return tuple(sorted(value.items()))

    # ------------------------------------------------------------------ across entries
    def check_ids(self, services: Sequence[ServiceSpec], platform: set[str]) -> None:
        seen: dict[str, ServiceSpec] = {}
        for spec in services:
            line = _line(spec)
            if spec.id in platform or spec.id in RESERVED_IDS or re.fullmatch(r"worker-[0-9]+", spec.id):
                raise self.refuse(
                    line, f"{spec.id} is the name of one of the platform's services", "choose another id"
                )
            if spec.id in seen:
                raise self.refuse(
                    line,
                    f"service id {spec.id} is declared twice (first on line {_line(seen[spec.id])})",
                    "give each service its own id",
                )
            seen[spec.id] = spec

    def check_calls(self, services: Sequence[ServiceSpec], roster: Sequence[ServiceSpec]) -> None:
        servers = {spec.id for spec in roster if spec.kind == "mcp_server"}
        for spec in services:
            for target in spec.calls:
                if target not in servers:
                    raise self.refuse(
                        _line(spec),
                        f"{spec.id} calls {target}, which is no MCP server of this fleet",
                        f'declare [[mcp_servers]] id = "{target}", or remove it from calls'
                        f" (the fleet's are {', '.join(sorted(servers))})",
                    )

    def check_skills(self, services: Sequence[ServiceSpec], roster: Sequence[ServiceSpec]) -> None:
        """A project's skill may not be one the platform's own agents of this fleet offer: the
        coordinator would route the platform's steps to it."""
        platform = {
            skill: spec.id
            for spec in roster
            if not spec.origin
            for spec_skill in [spec.skills]
            for skill in spec_skill
        }
        for spec in services:
            for skill in spec.skills:
                if skill in platform:
                    raise self.refuse(
                        _line(spec),
                        f"skill {skill} of {spec.id} is the platform's own ({platform[skill]} offers it)",
                        "give your skill another name",
                    )

    def policy_dir(self, value: object) -> Path | None:
        if value is None:
            return None
        line = self.line_of("fleet", None, "policy")
        if not isinstance(value, str) or not value:
            raise self.refuse(line, "policy must be a folder name", 'policy = "policy"')
        folder = (self.path.parent / value).resolve()
        if not folder.is_dir():
            raise self.refuse(
                line, f"policy folder {folder} does not exist", "create it, or remove the policy key"
            )
        if not any(folder.rglob("*.rego")) and not any(folder.rglob("data.json")):
            raise self.refuse(
                line, f"policy folder {folder} has no .rego or data.json file", "add your rules there"
            )
        for data in sorted(folder.rglob("data.json")):
            try:
                document = json.loads(data.read_text())
            except ValueError as exc:
                raise self.refuse(line, f"{data} is not valid JSON ({exc})", "fix that file") from exc
            if not isinstance(document, dict):
                raise self.refuse(line, f"{data} is not a JSON object", "data.json holds an object")
        return folder


def _line(spec: ServiceSpec) -> int | None:
    tail = spec.origin.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _defines(source: str, name: str) -> bool:
    """Whether module ``source`` binds ``name`` at its top level (a def, an assignment or an import)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (alias.asname or alias.name.split(".")[0]) == name for alias in node.names
        ):
            return True
    return False


@contextmanager
def _on_path(folder: Path) -> Iterator[None]:
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))


def deployment_roster(manifest: Path | None) -> tuple[ServiceSpec, ...]:
    """The services a deployment runs: those of ``manifest`` (a project's image names it in
    ``FLEET_MANIFEST``), else the platform's."""
    return load(manifest).roster(DEFAULT_WORKERS) if manifest is not None else SERVICES


# ---------------------------------------------------------------------- the stack's policy bundle
def compose_bundle(platform: Path, overlay: Path, into: Path) -> Path:
    """The platform's bundle with a project's policy added: ``overlay``'s files are copied over a
    copy of ``platform`` (a module at the same path replaces the platform's), and each ``data.json``
    is merged into the platform's at the same path (the project's values win). Written to ``into``,
    replacing what was there; returns ``into``."""
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(platform, into)
    for source in sorted(overlay.rglob("*")):
        if not source.is_file():
            continue
        target = into / source.relative_to(overlay)
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.name == "data.json" and target.exists():
            merged = _merged(json.loads(target.read_text()), json.loads(source.read_text()))
            target.write_text(json.dumps(merged, indent=2, sort_keys=True))
        else:
            shutil.copyfile(source, target)
    return into


def _merged(base: Any, top: Any) -> Any:
    if isinstance(base, dict) and isinstance(top, dict):
        return {**base, **{key: _merged(base.get(key), value) for key, value in top.items()}}
    return top


__all__ = ["MANIFEST_NAME", "FleetManifest", "ManifestError", "compose_bundle", "deployment_roster", "load"]
