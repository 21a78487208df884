"""Governed tiered memory (episodic, semantic, procedural): every write passes PII detection and a
policy decision before it is committed. Nothing is implemented here yet; the package exists so that its
boundary (it imports no coordinator, specialist or MCP-server code) is enforced from the start."""

__all__: list[str] = []
