"""The kits a user builds on, pinned: what each exports (a name removed or renamed breaks users'
code, so it changes here, on purpose, with the docs), and a docstring on every exported name."""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC: dict[str, set[str]] = {
    "specialists.kit": {
        "MEMORY_SERVER",
        "Brain",
        "BudgetMeter",
        "InputRequired",
        "LoopPolicy",
        "MemoryTools",
        "OutcomeUnknown",
        "Price",
        "Skill",
        "SkillContext",
        "SkillError",
        "SkillExecutor",
        "SkillFunction",
        "TaskBudget",
        "ToolCatalog",
        "Toolbox",
        "Tools",
        "build_specialist_app",
        "mcp_http_client",
        "serve_specialist",
    },
    "mcp_servers.kit": {"KEYED_WRITE", "READ_ONLY", "ToolCall", "ToolDeclaration", "ToolServer", "summary"},
    "deploy.manifest": {
        "MANIFEST_NAME",
        "FleetManifest",
        "ManifestError",
        "compose_bundle",
        "deployment_roster",
        "load",
    },
}
# Constants and type aliases carry no docstring of their own: the module's says what they are.
NOT_DOCUMENTED_ITSELF = {"MEMORY_SERVER", "SkillFunction", "KEYED_WRITE", "READ_ONLY", "MANIFEST_NAME"}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_a_kit_exports_exactly_its_public_names(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert set(module.__all__) == PUBLIC[module_name]
    assert len(module.__all__) == len(set(module.__all__))
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.{name} is exported but not defined"
    assert module.__doc__ and len(module.__doc__) > 200, f"{module_name} has no guide in its docstring"


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_every_exported_name_is_documented(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in sorted(PUBLIC[module_name] - NOT_DOCUMENTED_ITSELF):
        value = getattr(module, name)
        assert inspect.getdoc(value), f"{module_name}.{name} has no docstring"
        if inspect.isclass(value):
            for member, attribute in vars(value).items():
                if not member.startswith("_") and (
                    inspect.isfunction(attribute) or isinstance(attribute, property)
                ):
                    assert inspect.getdoc(attribute), f"{module_name}.{name}.{member} has no docstring"
