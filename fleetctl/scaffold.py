"""``fleet new specialist|mcp-server|workflow NAME``: a working, tested starting point in a project of
one's own. Each writes one module, one test of it and one manifest entry (and, in a folder with no
project yet, ``fleet.toml``, the package and a ``pyproject.toml`` that runs the tests), then checks the
manifest the way ``fleet up`` will."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from deploy.manifest import MANIFEST_NAME, PLATFORM_PACKAGES
from deploy.manifest import load as load_manifest
from fleet.errors import ErrorCode, FleetError

KINDS = ("specialist", "mcp-server", "workflow")
NAME = re.compile(r"[a-z][a-z0-9-]{0,40}[a-z0-9]")

SPECIALIST = '''\
"""{name}: a specialist of this fleet (the specialist kit: ``specialists.kit``)."""

from __future__ import annotations

from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, SkillError, serve_specialist


async def {function}(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    """What the skill does: replace this with yours. ``ctx`` has the caller (``ctx.tenant``), MCP
    tools through the fleet (``ctx.tools.call``), memory, progress and idempotency keys."""
    text = payload.get("text")
    if not isinstance(text, str):
        raise SkillError(ErrorCode.INVALID_REQUEST, 'input needs "text"')
    await ctx.progress("working on it")
    return {{"text": text, "tenant": ctx.tenant}}


SKILLS = [Skill("{skill}", "{title}", 'Input: {{"text": ...}}.', {function})]


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(settings, name="{title}", description="{title}.", version="0.1.0", skills=SKILLS)
'''

SPECIALIST_TEST = '''\
"""{name}'s skill, called in this process with a caller of its own."""

from __future__ import annotations

import pytest

from fleet.errors import FleetError
from fleet.mcp_inprocess import claims_for
from specialists.kit import SkillContext
from {package}.{module} import {function}


class NoTools:
    """The skill calls no MCP tool yet: any call is a mistake here."""

    async def available(self) -> list[object]:
        return []

    async def call(self, *args: object, **kwargs: object) -> dict[str, object]:
        raise AssertionError("no tool call expected")


async def progress(text: str) -> None:
    pass


def context() -> SkillContext:
    return SkillContext(claims_for("coordinator", "acme", ["agent:invoke"]), NoTools(), progress)


async def test_it_answers_for_its_caller_s_tenant() -> None:
    assert await {function}(context(), {{"text": "hello"}}) == {{"text": "hello", "tenant": "acme"}}


async def test_it_refuses_input_without_text() -> None:
    with pytest.raises(FleetError) as refused:
        await {function}(context(), {{}})
    assert refused.value.code == "invalid_request"
'''

SERVER = '''\
"""{name}: an MCP server of this fleet (the tool-server kit: ``mcp_servers.kit``)."""

from __future__ import annotations

from typing import Any

from fleet.settings import ServiceSettings
from mcp_servers.kit import READ_ONLY, ToolCall, ToolServer

server = ToolServer("{short}", instructions="{title}.")


@server.tool(scopes=["{scope}"], annotations=READ_ONLY)
async def lookup(call: ToolCall, key: str) -> dict[str, Any]:
    """Look ``key`` up for the caller's tenant: replace this with your tool."""
    return {{"key": key, "tenant": call.tenant}}


async def main(settings: ServiceSettings) -> None:
    await server.serve(settings)
'''

SERVER_TEST = '''\
"""{name}'s tools, called in this process through MCP, behind their gate and the fleet's policy."""

from __future__ import annotations

from fleet.mcp_errors import error_of
from {package}.{module} import server


async def test_a_caller_with_the_scope_gets_its_tenant_s_answer() -> None:
    async with server.test_client(["{scope}"], tenant="acme") as client:
        result = await client.call_tool("lookup", {{"key": "k1"}})
    assert not result.is_error and result.structured_content == {{"key": "k1", "tenant": "acme"}}


async def test_a_caller_without_the_scope_is_refused_by_policy() -> None:
    async with server.test_client([], tenant="acme") as client:
        result = await client.call_tool("lookup", {{"key": "k1"}})
    error = error_of(result)
    assert error is not None and error.code == "policy_denied"
'''

WORKFLOW = '''\
"""{name}: a workflow of this fleet, a LangGraph graph whose nodes call the fleet
(``coordinator.engine.workflows.delegate``; see the platform's "build your own fleet" guide)."""

from __future__ import annotations

from typing import Any, TypedDict

from langgraph.graph import END, START, StateGraph

from coordinator.engine.workflows import delegate


class State(TypedDict, total=False):
    text: str
    result: dict[str, Any]


async def work(state: State) -> dict[str, Any]:
    # Each delegate is a step of the run: recorded, sent once, and it may wait for a person.
    return {{"result": await delegate("{skill}", {{"text": state.get("text", "")}})}}


def build() -> StateGraph[State, Any, Any, Any]:
    graph: StateGraph[State, Any, Any, Any] = StateGraph(State)
    graph.add_node("work", work)
    graph.add_edge(START, "work")
    graph.add_edge("work", END)
    return graph
'''

WORKFLOW_TEST = '''\
"""{name}'s graph: it compiles, and its nodes are the ones the fleet will run."""

from __future__ import annotations

import pytest

from fleet.errors import FleetError
from {package}.{module} import build


def test_it_compiles_with_its_nodes() -> None:
    assert set(build().compile().get_graph().nodes) == {{"__start__", "work", "__end__"}}


async def test_its_nodes_call_the_fleet_only_inside_a_run() -> None:
    with pytest.raises(FleetError, match="delegate"):
        await build().compile().ainvoke({{"text": "hello"}})
'''

PYPROJECT = """\
[project]
name = "{name}"
version = "0.1.0"
requires-python = ">=3.11"

[tool.pytest.ini_options]
asyncio_mode = "auto"
asyncio_default_fixture_loop_scope = "function"
testpaths = ["tests"]
pythonpath = ["."]
"""


def new(kind: str, name: str, folder: Path) -> list[Path]:
    """Write a new ``kind`` called ``name`` into the project at ``folder``; the files written."""
    if kind not in KINDS:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"fleet new makes a {', '.join(KINDS)}, not {kind!r}")
    if not NAME.fullmatch(name):
        raise FleetError(
            ErrorCode.INVALID_REQUEST, f"a name is lowercase letters, digits and dashes, not {name!r}"
        )
    if kind == "mcp-server" and not name.startswith("mcp-"):
        name = f"mcp-{name}"
    folder = folder.resolve()
    package = _package_name(folder)
    written = _project(folder, package)
    module = name.removeprefix("mcp-").replace("-", "_")
    source, test = folder / package / f"{module}.py", folder / "tests" / f"test_{module}.py"
    for path in (source, test):
        if path.exists():
            raise FleetError(ErrorCode.CONFLICT, f"{path} exists already; choose another name")
    manifest = folder / MANIFEST_NAME
    if re.search(rf'^(id|name) = "{re.escape(name)}"$', manifest.read_text(), re.MULTILINE):
        raise FleetError(ErrorCode.CONFLICT, f"{manifest} has a {name} already; choose another name")
    values = {
        "name": name,
        "title": name.replace("-", " ").capitalize(),
        "package": package,
        "module": module,
        "function": module,
        "skill": f"{name}-task" if kind != "workflow" else f"{name}-step",
        "short": name.removeprefix("mcp-"),
        "scope": f"{name.removeprefix('mcp-')}:read",
    }
    templates = {"specialist": (SPECIALIST, SPECIALIST_TEST), "mcp-server": (SERVER, SERVER_TEST)}
    code, check = templates.get(kind, (WORKFLOW, WORKFLOW_TEST))
    source.write_text(code.format(**values))
    test.write_text(check.format(**values))
    with manifest.open("a") as out:
        out.write(_entry(kind, name, package, module, values))
    load_manifest(manifest)  # what fleet up checks, now
    return [*written, source, test, manifest]


def _package_name(folder: Path) -> str:
    package = re.sub(r"[^a-z0-9_]", "_", folder.name.lower()).strip("_") or "my_fleet"
    if package[0].isdigit():
        package = f"fleet_{package}"
    return f"my_{package}" if package in PLATFORM_PACKAGES else package


def _project(folder: Path, package: str) -> list[Path]:
    """The project's skeleton, where it is missing: manifest, package, tests, pyproject."""
    written = []
    files = {
        folder / MANIFEST_NAME: f'[fleet]\nname = "{folder.name}"\n',
        folder / package / "__init__.py": f'"""{folder.name}: a fleet of its own, on agent-fleet."""\n',
        folder / "tests" / "__init__.py": "",
        folder / "pyproject.toml": PYPROJECT.format(name=folder.name),
    }
    for path, text in files.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def _entry(kind: str, name: str, package: str, module: str, values: dict[str, str]) -> str:
    entry = f"{package}.{module}"
    if kind == "workflow":
        return f'\n[[workflows]]\nname = "{name}"\ngraph = "{entry}:build"\n'
    if kind == "mcp-server":
        return f'\n[[mcp_servers]]\nid = "{name}"\nentry = "{entry}:main"\n'
    return textwrap.dedent(f"""
        [[specialists]]
        id = "{name}"
        entry = "{entry}:main"
        skills = ["{values["skill"]}"]
        """)


__all__ = ["KINDS", "new"]
