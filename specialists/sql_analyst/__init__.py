"""The SQL analyst: answers questions about a tenant's data by querying it through the SQL MCP server."""
