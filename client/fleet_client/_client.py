"""Runs, from outside: started over A2A (``SendMessage`` on the JSON-RPC binding, or the HTTP+JSON
one), followed and answered through the coordinator's run API. (gRPC, A2A's third binding, needs
grpcio, which this client does not bring: use a2a-sdk's client for it.)"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from fleet_client._errors import FleetClientError
from fleet_client._tokens import TokenSource

RPC_PATH = "/a2a/jsonrpc"
REST_PATH = "/a2a/rest"
BINDINGS = ("JSONRPC", "HTTP+JSON")  # the A2A bindings this client speaks, as cards name them
A2A_VERSION = "1.0"
ENDED = frozenset({"completed", "failed", "canceled", "rejected"})
RECONNECTS = 8  # drops in a row without an event before the coordinator is taken to be gone


class FleetClient:
    """A client of one fleet's coordinator, acting in ``tenant`` with tokens from ``tokens``, over
    A2A's ``binding`` (``JSONRPC`` or ``HTTP+JSON``)."""

    def __init__(
        self,
        coordinator_url: str,
        tokens: TokenSource,
        *,
        tenant: str,
        scopes: tuple[str, ...] = ("agent:invoke",),
        http: httpx.AsyncClient | None = None,
        binding: str = "JSONRPC",
    ) -> None:
        if binding not in BINDINGS:
            raise FleetClientError(
                "invalid_request", f"binding {binding!r} is not one of {', '.join(BINDINGS)}"
            )
        self.binding = binding
        self.base_url = coordinator_url.rstrip("/")
        self.tenant = tenant
        self.scopes = scopes
        self._tokens = tokens
        self._own = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None))

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client (when this client made it)."""
        if self._own:
            await self._http.aclose()

    async def _headers(self) -> dict[str, str]:
        token = await self._tokens.token("coordinator", self.tenant, self.scopes)
        return {"Authorization": f"Bearer {token}", "A2A-Version": A2A_VERSION}

    # ---------------------------------------------------------------------- starting
    async def start(
        self,
        *,
        plan: dict[str, Any] | None = None,
        text: str = "",
        workflow: str | None = None,
        given: dict[str, Any] | None = None,
    ) -> str:
        """Start a run of ``plan`` (``{"steps": [...]}``), ``text`` (the coordinator plans it) or
        a registered ``workflow`` with input ``given``; its id, as soon as the coordinator
        accepted it."""
        if workflow is not None:
            plan = {"workflow": workflow, "input": given or {}}
        parts: list[dict[str, Any]] = ([{"text": text}] if text else []) + (
            [{"data": plan}] if plan is not None else []
        )
        if not parts:
            raise FleetClientError("invalid_request", "a run needs a plan or text")
        request = {
            "message": {"messageId": uuid.uuid4().hex, "role": "ROLE_USER", "parts": parts},
            "configuration": {"returnImmediately": True},
        }
        if self.binding == "HTTP+JSON":
            task = (await self._request("POST", f"{REST_PATH}/message:send", json=request)).json().get("task")
        else:
            task = await self._send_rpc(request)
        if not isinstance(task, dict) or not isinstance(task.get("id"), str):
            raise FleetClientError("internal", f"the coordinator answered no task: {task!r:.300}")
        return str(task["id"])

    async def _send_rpc(self, request: dict[str, Any]) -> Any:
        body = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": "SendMessage", "params": request}
        answer = (await self._request("POST", RPC_PATH, json=body)).json()
        if "error" in answer:
            error = answer["error"] if isinstance(answer["error"], dict) else {}
            raise FleetClientError.from_envelope(
                error.get("data"), "invalid_request", str(error.get("message", error))
            )
        return answer.get("result", {}).get("task")

    # ---------------------------------------------------------------------- reading
    async def get(self, run_id: str) -> dict[str, Any]:
        """The run's record (state, plan, what it waits for, result)."""
        return (await self._request("GET", f"/v1/runs/{run_id}")).json()  # type: ignore[no-any-return]

    async def events(self, run_id: str, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        """The run's events after seq ``after`` as they are written, until the run ends; a dropped
        stream is resumed from the last event seen (``Last-Event-ID``)."""
        cursor, failures = after, 0
        while True:
            try:
                async for event in self._stream(run_id, cursor):
                    cursor, failures = int(event["seq"]), 0
                    yield event
                if (await self.get(run_id))["state"] in ENDED:
                    return
            except httpx.TransportError:
                pass
            failures += 1
            if failures > RECONNECTS:
                raise FleetClientError(
                    "dependency_unavailable", f"lost the event stream of run {run_id}", retryable=True
                )
            await asyncio.sleep(min(5.0, 0.5 * 2 ** (failures - 1)))

    async def _stream(self, run_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        headers = {**await self._headers(), "Last-Event-ID": str(after)}
        url = f"{self.base_url}/v1/runs/{run_id}/events"
        async with self._http.stream("GET", url, headers=headers) as response:
            if response.status_code >= 400:
                await response.aread()
                raise FleetClientError.from_response(response)
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    yield json.loads(line.removeprefix("data: "))

    async def wait(self, run_id: str, states: frozenset[str] = ENDED | {"waiting"}) -> dict[str, Any]:
        """Follow the run until it is in one of ``states`` (by default: ended, or waiting for
        someone); its record then."""
        run = await self.get(run_id)
        if run["state"] in states:
            return run
        async for _ in self.events(run_id, int(run.get("last_seq", 0))):
            run = await self.get(run_id)
            if run["state"] in states:
                return run
        return await self.get(run_id)

    async def result(self, run_id: str) -> dict[str, Any]:
        """The run's result once it ended (its ``result`` artifact: ``{"text", "steps": {...}}``);
        a :class:`FleetClientError` with the run's own error if it did not complete."""
        run = await self.wait(run_id, ENDED)
        artifact: dict[str, Any] = {}
        ending: dict[str, Any] = {}
        async for event in self.events(run_id):
            if event["type"] == "artifact" and event["payload"].get("name") == "result":
                artifact = event["payload"]
            if event["type"] == f"run.{run['state']}":
                ending = event["payload"]
        if run["state"] != "completed":
            message = str(ending.get("text") or f"run {run_id} {run['state']}")
            raise FleetClientError.from_envelope(ending.get("error"), run["state"], message)
        return {"text": artifact.get("text", ""), "steps": artifact.get("steps", {})}

    # ---------------------------------------------------------------------- answering
    async def approve(self, run_id: str, *, note: str = "", awaited: str | None = None) -> dict[str, Any]:
        """Approve what the run waits for (policy decides whether this caller may)."""
        return await self.signal(run_id, "approve", note=note, awaited=awaited)

    async def reject(self, run_id: str, *, note: str = "", awaited: str | None = None) -> dict[str, Any]:
        """Reject what the run waits for: the run ends rejected."""
        return await self.signal(run_id, "reject", note=note, awaited=awaited)

    async def answer(self, run_id: str, given: dict[str, Any], *, note: str = "") -> dict[str, Any]:
        """Answer the question the run asks (input-required) with ``given``."""
        return await self.signal(run_id, "input", note=note, given=given)

    async def cancel(self, run_id: str, *, note: str = "") -> dict[str, Any]:
        """Cancel the run."""
        return await self.signal(run_id, "cancel", note=note)

    async def signal(
        self,
        run_id: str,
        action: str,
        *,
        note: str = "",
        awaited: str | None = None,
        given: dict[str, Any] | None = None,
        signal_id: str | None = None,
    ) -> dict[str, Any]:
        """Send a signal; what came of it (``applied``, or a no-op and why). The same
        ``signal_id`` sent twice is applied once."""
        body: dict[str, Any] = {"action": action, "note": note, "id": signal_id or uuid.uuid4().hex}
        if awaited is not None:
            body["awaited"] = awaited
        if given is not None:
            body["input"] = given
        return (await self._request("POST", f"/v1/runs/{run_id}/signals", json=body)).json()  # type: ignore[no-any-return]

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(
                method, self.base_url + path, headers=await self._headers(), **kwargs
            )
        except httpx.TransportError as exc:
            raise FleetClientError(
                "dependency_unavailable",
                f"cannot reach {self.base_url}: {type(exc).__name__}",
                retryable=True,
            ) from exc
        if response.status_code >= 400:
            raise FleetClientError.from_response(response)
        return response
