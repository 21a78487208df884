"""``fleet console``: a sign-in link to the running stack's console, for the operator identity.

The link carries a fresh access token addressed to the console in its fragment; it signs in once,
within the token's life (``ACCESS_TOKEN_TTL_S``), to a session of the console's own length.
"""

from __future__ import annotations

import httpx

from fleet import transport
from fleet.errors import ErrorCode, FleetError
from fleetctl.cli_common import EXIT_OK, emit, operator_token_client, report_error, running_endpoints
from fleetctl.console import SIGN_IN_SCOPES
from fleetctl.layout import StackLayout


async def sign_in_link(layout: StackLayout, tenant: str, *, as_json: bool) -> int:
    """Print the console's URL and a one-time sign-in link for ``tenant``."""
    try:
        endpoints = running_endpoints(layout)
        if "console" not in endpoints:
            raise FleetError(ErrorCode.STACK_NOT_RUNNING, f"the stack on {layout.home} runs no console")
        async with httpx.AsyncClient(event_hooks=transport.hooks()) as http:
            client = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
            token = await client.token("console", tenant, SIGN_IN_SCOPES)
    except FleetError as exc:
        return report_error(exc, as_json=as_json)
    url = str(endpoints["console"])
    link = f"{url}/login#token={token}"
    emit(
        {"console": url, "tenant": tenant, "sign_in": link},
        as_json=as_json,
        text=f"console: {url}\nsign in as operator of {tenant} (once, within 5 minutes):\n{link}",
    )
    return EXIT_OK
