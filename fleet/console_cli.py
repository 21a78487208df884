"""``fleet console``: a sign-in link to the running stack's console, for the operator identity.

The link carries a fresh access token addressed to the console in its fragment; it signs in once,
within the token's life (``ACCESS_TOKEN_TTL_S``), to a session of the console's own length.
"""

from __future__ import annotations

import json
import sys

import httpx

from fleet.console import SIGN_IN_SCOPES
from fleet.errors import FleetError
from fleet.layout import StackLayout
from fleet.operator_cli import EXIT_NOT_RUNNING, EXIT_OK, operator_token_client, running_endpoints


async def sign_in_link(layout: StackLayout, tenant: str, *, as_json: bool) -> int:
    """Print the console's URL and a one-time sign-in link for ``tenant``."""
    try:
        endpoints = running_endpoints(layout)
        url = str(endpoints["console"])
    except (FleetError, KeyError):
        print(f"fleet: no stack with a console is running on {layout.home} (fleet up)", file=sys.stderr)
        return EXIT_NOT_RUNNING
    async with httpx.AsyncClient() as http:
        client = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
        token = await client.token("console", tenant, SIGN_IN_SCOPES)
    link = f"{url}/login#token={token}"
    if as_json:
        print(json.dumps({"console": url, "tenant": tenant, "sign_in": link}))
    else:
        print(f"console: {url}\nsign in as operator of {tenant} (once, within 5 minutes):\n{link}")
    return EXIT_OK
