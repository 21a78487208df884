"""The SQL MCP server: read-only queries over tenant data in Postgres, isolated by row-level security
keyed by the tenant of the caller's token."""
