"""Specialist agents: one sub-package per agent, each its own A2A server and process, built on
:mod:`specialists.kit`. Specialists never import the coordinator or the MCP servers."""
