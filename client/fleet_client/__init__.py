"""The slim client of an agent-fleet: what its outside callers need, without the platform.

- :class:`FleetClient`: start runs over A2A, follow their event log (resumed after a drop), answer
  them (approve, reject, input, cancel) and read their result, through the coordinator's run API.
- :class:`ClientCredentials` / :class:`StaticToken`: where the bearer tokens come from.
- :func:`publish_event`: an event as a producer on the fleet's bus.

Errors are :class:`FleetClientError` with the fleet's stable ``code`` (``policy_denied``,
``not_found``, ...), its message and whether a retry may help, read from the fleet's error
envelope (RFC 9457 problem details, or A2A JSON-RPC error data).
"""

from fleet_client._client import FleetClient
from fleet_client._errors import FleetClientError
from fleet_client._events import event_envelope, publish_event
from fleet_client._tokens import ClientCredentials, StaticToken, TokenSource

__all__ = [
    "ClientCredentials",
    "FleetClient",
    "FleetClientError",
    "StaticToken",
    "TokenSource",
    "event_envelope",
    "publish_event",
]
