"""``fleet agents list|show`` and ``fleet mcp list``: what the registry knows, as the operator.

Agents come from ``GET /v1/agents`` (id, version, skills, status: the registry's health of the
agent's card, endpoint). MCP servers come from ``GET /v1/records`` (every server with all its tools:
``/v1/mcp-servers`` lists only the tools the caller's scopes reach), with the health the server's
own ``/healthz`` reports now.
"""

from __future__ import annotations

from typing import Any

import httpx

from fleetctl.cli_common import EXIT_OK, emit, operator_client
from fleetctl.layout import StackLayout

READ_SCOPES = ("registry:read",)


def _agent_row(agent: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": agent["id"],
        "kind": agent.get("kind", ""),
        "version": agent.get("version", ""),
        "status": agent.get("status", ""),
        "status_reason": agent.get("status_reason", ""),
        "url": agent.get("url", ""),
        "external": agent.get("external", False),
        "skills": [skill["id"] for skill in agent.get("skills", [])],
    }


async def list_agents(layout: StackLayout, *, as_json: bool) -> int:
    """``fleet agents list``: one line per registered agent."""
    async with operator_client(layout, "registry", "default", READ_SCOPES) as registry:
        agents = [_agent_row(a) for a in (await registry.get("/v1/agents"))["agents"]]
    lines = [f"{'AGENT':<22} {'VERSION':<10} {'STATUS':<13} {'ENDPOINT':<36} SKILLS"]
    lines += [
        f"{a['id']:<22} {a['version']:<10} {a['status']:<13} {a['url']:<36} {', '.join(a['skills'])}"
        for a in agents
    ]
    emit({"agents": agents}, as_json=as_json, text="\n".join(lines))
    return EXIT_OK


async def show_agent(layout: StackLayout, agent_id: str, *, as_json: bool) -> int:
    """``fleet agents show ID``: the agent's record (its card included with ``--json``)."""
    async with operator_client(layout, "registry", "default", READ_SCOPES) as registry:
        agent = await registry.get(f"/v1/agents/{agent_id}")
    row = _agent_row(agent)
    lines = [
        f"agent {row['id']} ({row['kind']}) version {row['version']}",
        f"  status    {row['status']}{' (' + row['status_reason'] + ')' if row['status_reason'] else ''}",
        f"  endpoint  {row['url']}",
        f"  card      {agent.get('card_url', '')}",
        f"  external  {'yes' if row['external'] else 'no'}",
        "  skills",
        *(f"    {s['id']:<20} {s.get('description', '')}" for s in agent.get("skills", [])),
    ]
    emit(agent, as_json=as_json, text="\n".join(lines))
    return EXIT_OK


async def list_mcp_servers(layout: StackLayout, *, as_json: bool) -> int:
    """``fleet mcp list``: every registered MCP server, its tools and whether it answers now."""
    from fleetctl.cli_common import running_endpoints

    health_urls: dict[str, str] = running_endpoints(layout).get("services", {})
    async with operator_client(layout, "registry", "default", READ_SCOPES) as registry:
        servers = (await registry.get("/v1/records"))["mcp_servers"]
        rows = [await _mcp_row(registry.http, s, health_urls.get(s["id"])) for s in servers]
    lines = [f"{'SERVER':<16} {'HEALTH':<8} {'ENDPOINT':<36} TOOLS"]
    lines += [f"{r['id']:<16} {r['health']:<8} {r['url']:<36} {', '.join(r['tools'])}" for r in rows]
    emit({"mcp_servers": rows}, as_json=as_json, text="\n".join(lines))
    return EXIT_OK


async def _mcp_row(http: httpx.AsyncClient, server: dict[str, Any], health_url: str | None) -> dict[str, Any]:
    return {
        "id": server["id"],
        "url": server["url"],
        "audience": server.get("audience", ""),
        "tools": [tool["name"] for tool in server.get("tools", [])],
        "health": await _health(http, health_url),
    }


async def _health(http: httpx.AsyncClient, base_url: str | None) -> str:
    """``up``, ``down`` or ``unknown`` (a server this stack does not run, e.g. registered by hand)."""
    if base_url is None:
        return "unknown"
    try:
        response = await http.get(base_url + "/healthz", timeout=3.0)
    except httpx.HTTPError:
        return "down"
    return "up" if response.status_code == 200 else "down"
