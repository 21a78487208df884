"""What every ``fleet`` command shares: the exit code table, output (text or ``--json``), errors,
and an operator's HTTP client for one service of the running stack.

Exit codes (one table for every command, so scripts can branch on them):

==== ==========================================================================================
code meaning
==== ==========================================================================================
0    done (for ``runs events --follow`` and ``runs show --watch``: the run completed)
1    the operation failed (a service cannot be reached, or answered with an error that has no row)
2    bad usage (arguments, JSON that does not parse, an invalid request)
3    no stack is running on the data dir
4    a signal changed nothing (answered already, nothing awaited, the run has ended)
5    not found (no such run, agent, key, memory, for that tenant)
6    refused (forbidden by policy or scope, unauthenticated)
7    the run ended ``failed``
8    the run ended ``canceled``
9    the run ended ``rejected``
130  interrupted (Ctrl-C; the run goes on)
==== ==========================================================================================
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from deploy.local_stack import OPERATOR_ID
from fleet import transport
from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.natsconn import Credentials
from fleet.tokens import TokenClient
from fleetctl import stacklock
from fleetctl.layout import StackLayout

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_NO_OP = 4
EXIT_NOT_FOUND = 5
EXIT_REFUSED = 6
EXIT_RUN_FAILED = 7
EXIT_RUN_CANCELED = 8
EXIT_RUN_REJECTED = 9
EXIT_INTERRUPTED = 130

_EXIT_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.STACK_NOT_RUNNING: EXIT_NOT_RUNNING,
    ErrorCode.NOT_FOUND: EXIT_NOT_FOUND,
    ErrorCode.NO_SPECIALIST: EXIT_NOT_FOUND,
    ErrorCode.FORBIDDEN: EXIT_REFUSED,
    ErrorCode.POLICY_DENIED: EXIT_REFUSED,
    ErrorCode.UNAUTHENTICATED: EXIT_REFUSED,
    ErrorCode.INVALID_REQUEST: EXIT_USAGE,
    ErrorCode.MANIFEST_INVALID: EXIT_USAGE,
    ErrorCode.POLICY_QUERY_INVALID: EXIT_USAGE,
}

# How a run's end state maps to the exit code of a command that waited for it.
EXIT_BY_END_STATE: dict[str, int] = {
    "completed": EXIT_OK,
    "failed": EXIT_RUN_FAILED,
    "canceled": EXIT_RUN_CANCELED,
    "rejected": EXIT_RUN_REJECTED,
}


def exit_code(exc: FleetError) -> int:
    """The exit code of a command that stopped on ``exc``."""
    return _EXIT_BY_CODE.get(exc.code, EXIT_FAILED)


def report_error(exc: FleetError, *, as_json: bool) -> int:
    """Print ``exc`` on stderr (``fleet: <message> [<code>]``, or a JSON error object) and return
    its exit code."""
    code = exit_code(exc)
    if as_json:
        print(json.dumps({"error": {**exc.to_dict(), "exit_code": code}}), file=sys.stderr)
    else:
        print(f"fleet: {exc.message} [{exc.code}]", file=sys.stderr)
    return code


def emit(document: Any, *, as_json: bool, text: str | None = None) -> None:
    """One result: ``document`` as one JSON document on stdout with ``--json``, else ``text``."""
    if as_json:
        print(json.dumps(document, indent=2, default=str))
    elif text is not None:
        print(text)


def emit_line(document: Any) -> None:
    """One JSON Lines record (for streams: ``--follow``), flushed at once."""
    print(json.dumps(document, default=str), flush=True)


def error_of(response: httpx.Response) -> FleetError:
    """The FleetError a service answered with (its problem details' envelope; from the status
    alone for an answer that is not a fleet service's)."""
    return FleetError.from_response(response)


@dataclass(frozen=True, slots=True)
class OperatorAuth:
    """Where a :class:`ServiceClient` gets the operator's bearer token for each request: the
    ``TokenClient`` reuses one until shortly before it expires, then fetches another, so a command
    that runs longer than a token lives (``runs events --follow``) keeps a valid one."""

    tokens: TokenClient
    audience: str
    tenant: str
    scopes: tuple[str, ...]

    async def headers(self) -> dict[str, str]:
        """The ``Authorization`` header for one request (or one reconnect of a stream)."""
        bearer = await self.tokens.token(self.audience, self.tenant, list(self.scopes))
        return {"Authorization": f"Bearer {bearer}"}


@dataclass(frozen=True, slots=True)
class ServiceClient:
    """An operator's authenticated client for one service of the stack (its base URL); ``auth``
    None: requests go without a token."""

    http: httpx.AsyncClient
    base_url: str
    auth: OperatorAuth | None = None

    async def headers(self) -> dict[str, str]:
        """The headers of one request: a bearer token valid now."""
        return {} if self.auth is None else await self.auth.headers()

    async def get(self, path: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """GET ``path``: the JSON answer, or the service's error raised as FleetError."""
        return self._answer(await self._call("GET", path, params=params))

    async def post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path``: the JSON answer, or the service's error raised as FleetError."""
        return self._answer(await self._call("POST", path, json=dict(body)))

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = await self.headers()
        try:
            return await self.http.request(method, self.base_url + path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, f"cannot reach {self.base_url}: {type(exc).__name__}"
            ) from exc

    @staticmethod
    def _answer(response: httpx.Response) -> dict[str, Any]:
        if response.status_code >= 400:
            raise error_of(response)
        body: dict[str, Any] = response.json()
        return body


def stack_running(layout: StackLayout) -> bool:
    """True while a supervisor holds the data dir's lock (asked without taking it), or when the
    data dir names a deployment elsewhere (:func:`remote`)."""
    return remote(layout) or stacklock.holder(layout.lock_file) is not None


def remote(layout: StackLayout) -> bool:
    """Whether the data dir names a deployment that runs elsewhere (compose, Kubernetes, other
    hosts): its ``endpoints.json`` says ``"remote": true`` and gives the deployment's URLs, the CA
    its certificates chain to, and the operator's key beside it (``keys/operator.pem``, the
    deployment's root key, which its registry enrolls as the operator). The CLI reaches it over the
    network; nothing here starts or stops it."""
    endpoints = layout.read_endpoints()
    return bool(endpoints and endpoints.get("remote") is True)


def operator_bus_credentials(endpoints: dict[str, Any]) -> Credentials:
    """The operator's credentials on a running stack's bus: its identity and key in the data dir."""
    layout = StackLayout.at(Path(str(endpoints["data_dir"])))
    ca = endpoints.get("tls_ca")
    return Credentials(
        OPERATOR_ID,
        key=SigningKey.load_or_create(layout.key_file(OPERATOR_ID)),
        tls_ca=Path(ca) if isinstance(ca, str) else None,
    )


def running_endpoints(layout: StackLayout) -> dict[str, Any]:
    endpoints = layout.read_endpoints()
    if endpoints is None or not stack_running(layout) or endpoints.get("stopped"):
        raise FleetError(ErrorCode.STACK_NOT_RUNNING, f"no stack is running on {layout.home} (fleet up)")
    return endpoints


def operator_token_client(layout: StackLayout, token_url: str, http: httpx.AsyncClient) -> TokenClient:
    """Tokens for the operator identity of the data dir, from the token endpoint at ``token_url``
    (an unreachable endpoint raises ``dependency_unavailable``)."""
    key_file = layout.key_file(OPERATOR_ID)
    if not key_file.exists():
        raise FleetError(ErrorCode.NOT_FOUND, f"no operator key in {layout.keys_dir}")
    return TokenClient(
        token_url=token_url,
        client_id=OPERATOR_ID,
        key=SigningKey.load_or_create(key_file),
        http=http,
        failover_patience_s=0,  # a person at a command line is told at once
    )


@contextlib.asynccontextmanager
async def operator_client(
    layout: StackLayout, service: str, tenant: str, scopes: tuple[str, ...], connect_s: float = 60.0
) -> AsyncIterator[ServiceClient]:
    """A client for ``service`` (``coordinator`` or ``registry``) of the running stack, with
    short-lived operator tokens for ``tenant`` and ``scopes`` (a fresh one whenever the last nears
    its expiry). Raises ``stack_not_running``, or ``dependency_unavailable`` when the registry
    cannot be reached."""
    endpoints = running_endpoints(layout)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(connect_s, read=None), event_hooks=transport.hooks()
    ) as http:
        tokens = operator_token_client(layout, endpoints["registry"] + "/oauth/token", http)
        auth = OperatorAuth(tokens, service, tenant, scopes)
        await auth.headers()  # fail here, before any output, if the token is refused
        yield ServiceClient(http, endpoints[service], auth)
