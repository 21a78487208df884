"""The outbox MCP server: external effects keyed by operation id."""
