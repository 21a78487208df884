"""The registry: enrolled identities and their keys, A2A agent records with verified cards, MCP-server
records, discovery by skill, and the token service (JWKS, short-lived access tokens).

Other services use :class:`RegistryClient`; the service itself is :func:`registry.server.main`.
"""

from registry._records import AgentRecord, IdentityRecord, McpServerRecord, SkillRecord
from registry.client import RegistryClient

__all__ = [
    "AgentRecord",
    "IdentityRecord",
    "McpServerRecord",
    "RegistryClient",
    "SkillRecord",
]
