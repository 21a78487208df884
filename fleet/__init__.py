"""The thin shared kernel of agent-fleet: settings, errors, identity primitives, service runner, CLI.

Every service package may import ``fleet``; ``fleet`` imports no service package statically (the CLI
resolves service entry points by name at run time).
"""

from fleet.errors import ErrorCode, FleetError

__all__ = ["ErrorCode", "FleetError"]
