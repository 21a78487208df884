"""MCP servers: one sub-package per server. Each verifies a registry-issued JWT on every request,
takes the tenant from the token only, and asks policy before every tool call."""
