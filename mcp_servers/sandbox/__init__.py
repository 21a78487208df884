"""The sandbox MCP server: untrusted Python in bubblewrap, a workspace per run."""
