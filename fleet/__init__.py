"""The shared kernel of agent-fleet: settings, errors, keys and tokens, NATS and Postgres
connections, telemetry, the service runner and the pieces every service shares.

Every package of the project may import ``fleet``; ``fleet`` imports no other package of the
project (``tests/test_import_boundaries.py`` checks it). The operator's application (the CLI, the
supervisor, the demo, the console) is ``fleetctl``.
"""

from fleet.errors import ErrorCode, FleetError

__all__ = ["ErrorCode", "FleetError"]
