"""Delegating a step to a specialist: discovery by skill in the registry, a token for that
specialist, and one A2A streaming call.

**Whose authority a step carries.** A run outlives its caller's token (an access token lives five
minutes; a run may wait days for a person). So when a caller's request creates a run, the
coordinator exchanges the caller's token at the registry for the run's **grant** (see
``registry._token_service``): the caller as subject, the coordinator as actor, bound to the run.
It is kept in ``fleet_runs.run_grants``, never in the event log, the run's record or an API answer;
a copy alone is worth nothing, since only the coordinator and its workers, each authenticating with
its own key, can redeem it. Every step the run sends to a specialist goes with a token exchanged
from the grant for that specialist: ``sub`` is the caller, and ``act`` names the worker and the
coordinator. The specialist exchanges that token in turn for each
MCP server it calls (``specialists.kit.Toolbox``), so a tool sees the whole chain. Revoking the
caller's key stops the run's next exchange: its step fails ``forbidden``. (Asking a specialist
about an operation, or cancelling one, is the fleet's own supervision: it goes in the worker's name.)

A run no caller started (a trigger's) has no grant: its calls go in the worker's own name (a
client-credentials token for the run's tenant).

**Agents outside the fleet.** An agent whose identity was enrolled as external (another
organisation runs it) is called differently:

* its token comes from its card: the OAuth 2 client-credentials scheme of its security schemes
  names the token endpoint and the scopes (card-driven auth: no per-agent client configuration).
  The worker authenticates there with its own key (``private_key_jwt``; the assertion is addressed
  to that endpoint, so it is worth nothing anywhere else), asking for the scheme's scopes with the
  agent's URL as ``resource`` and ``audience``. The caller's grant never leaves the fleet: the
  outside agent sees the worker, not who asked.
* it gets a step only if the plan names it (the step's ``agent``) or the tenant's routing policy
  does (``fleet.routing.outside``), and no agent of the fleet's own offers the skill: a card's
  claim never draws work out of the fleet (see :meth:`Delegator.assign`);
* what is sent passes the egress policy (``fleet.egress.decision``), which is deny by default: the
  step leaves only if a grant names its tenant, the agent and the skill, and then only with the
  input paths it names, at any depth (:mod:`coordinator.engine.egress`); secrets are redacted from those
  whatever it says. Each decision is logged with its id.
* its answer passes ``fleet.egress.answer``: it may refuse it (e.g. too large), and says whether
  later steps may act on it; one they may not is kept, marked :data:`~coordinator.planning.plan.UNTRUSTED`,
  and a later step that takes input from it fails ``policy_denied``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import jsonschema
from a2a.client import (
    A2AClientError,
    A2AClientTimeoutError,
    Client,
    ClientCallContext,
    ClientConfig,
    ClientFactory,
)
from a2a.helpers import get_data_parts, get_text_parts, new_data_part
from a2a.types import AgentCard, Message, Role, SendMessageRequest, TaskState
from a2a.utils.errors import A2AError
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from opentelemetry.trace import SpanKind

from coordinator.engine.egress import MAX_PATHS, keep_paths, leaf_paths
from coordinator.planning.plan import UNTRUSTED
from fleet import telemetry
from fleet.approvals import ApprovalBinding, ApprovalRequest
from fleet.errors import DependencyUnavailable, ErrorCode, FleetError
from fleet.operation_ext import (
    BUDGET_METADATA_KEY,
    LAST_REQUEST_METADATA_KEY,
    LOOP_METADATA_KEY,
    MAX_WAIT_S,
    OPERATION_METADATA_KEY,
    PROGRESS_METADATA_KEY,
    USAGE_METADATA_KEY,
    cancel_url,
    skill_traits,
    status_url,
)
from fleet.redact import redact_async
from fleet.tokens import RUN_GRANT_TYPE, Claims, TokenClient
from policy import Decision, PolicyEngine
from registry import AgentRecord, RegistryClient

log = logging.getLogger(__name__)

INVOKE_SCOPE = "agent:invoke"
SUSPECT_FOR_S = 60.0  # an agent that could not be reached or answered garbage is tried last this long
DISCOVERY_TTL_S = 5.0  # how stale a skill's list of specialists may be (a registry change shows within it)
FAILED_STATES = {
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_REJECTED,
    TaskState.TASK_STATE_CANCELED,
}

# States in which an agent asks for something before it can go on (see graph.gate_of).
ASKING_STATES = {
    TaskState.TASK_STATE_INPUT_REQUIRED: "input_required",
    TaskState.TASK_STATE_AUTH_REQUIRED: "auth_required",
}

Progress = Callable[[str], Awaitable[None]]
Activity = Callable[[], None]
Usage = Callable[[dict[str, Any]], None]  # what a task says it spent, as it ends
Notes = Callable[[dict[str, Any]], Awaitable[None]]  # a task's progress notes, as it saves them
GrantLookup = Callable[[str], Awaitable[str | None]]  # a run's grant, by run id
GRANTS_CACHED = 4096
# States a stream may end in only because it was cut short: the agent may still be at it.
UNFINISHED_STATES = {
    TaskState.TASK_STATE_UNSPECIFIED,
    TaskState.TASK_STATE_SUBMITTED,
    TaskState.TASK_STATE_WORKING,
}


@dataclass(frozen=True, slots=True)
class Assignment:
    agent_id: str
    url: str


class Delegator:
    """Finds specialists and calls them."""

    def __init__(
        self,
        registry: RegistryClient,
        http: httpx.AsyncClient,
        grants: GrantLookup | None = None,
        engine: PolicyEngine | None = None,
        outbound: httpx.AsyncClient | None = None,
    ) -> None:
        """``engine``: the policy that steps to agents outside the fleet pass (without one, such
        steps are refused: closed). ``outbound``: the guarded client (:mod:`fleet.outbound`,
        purpose ``token_endpoint``) for the token endpoints their cards name (without one, none is
        asked: closed)."""
        self._registry = registry
        self._http = http
        self._outbound = outbound
        self._grants = grants
        self._engine = engine
        self._grant_of: dict[str, str | None] = {}  # by run id; a run's grant never changes
        self._factory = ClientFactory(ClientConfig(streaming=True, httpx_client=http))
        self._known: dict[str, AgentRecord] = {}
        self._found: dict[str, tuple[float, list[AgentRecord]]] = {}  # by skill: (when, agents)
        self._clients: dict[str, tuple[AgentRecord, Client]] = {}  # by agent id: the record it was made for
        self._suspect: dict[str, float] = {}  # agent id -> until when it is tried last (monotonic)

    async def discover(self, skill: str) -> list[AgentRecord]:
        """Specialists offering ``skill``, as the registry said at most ``DISCOVERY_TTL_S`` ago."""
        now = time.monotonic()
        cached = self._found.get(skill)
        if cached is not None and now - cached[0] < DISCOVERY_TTL_S:
            return cached[1]
        found = [a for a in await self._registry.agents_with_skill(skill) if a.kind == "specialist"]
        self._known.update((a.id, a) for a in found)
        self._found[skill] = (now, found)
        return found

    def _client(self, agent: AgentRecord) -> Client:
        """The A2A client for ``agent``'s card, made once per card (it holds no connection of its
        own: the HTTP client is shared)."""
        cached = self._clients.get(agent.id)
        if cached is None or (cached[0] is not agent and cached[0] != agent):
            cached = (agent, self._factory.create(_card(agent)))
            self._clients[agent.id] = cached
        return cached[1]

    async def agent(self, agent_id: str) -> AgentRecord:
        """The record of an agent chosen earlier (checkpoints keep only its id)."""
        known = self._known.get(agent_id)
        if known is None:
            known = await self._registry.agent(agent_id)
            self._known[agent_id] = known
        return known

    async def moved(self, agent: AgentRecord) -> AgentRecord | None:
        """``agent``'s record as the registry has it now, if it is at another address than
        ``agent`` (it restarted elsewhere: a new pod, a new port); else None. What was cached of it
        is dropped either way, so the next discovery asks the registry again."""
        self._known.pop(agent.id, None)
        for skill, (_, agents) in list(self._found.items()):
            if any(a.id == agent.id for a in agents):
                del self._found[skill]
        try:
            now = await self._registry.agent(agent.id)
        except FleetError:
            return None
        self._known[agent.id] = now
        return now if now.url != agent.url else None

    def suspect(self, agent_id: str, why: str) -> None:
        """Try ``agent_id`` last for a while (it could not be reached, or answered garbage)."""
        log.warning("%s is tried last for %.0fs: %s", agent_id, SUSPECT_FOR_S, why)
        self._suspect[agent_id] = time.monotonic() + SUSPECT_FOR_S

    def _ranked(self, candidates: list[AgentRecord]) -> list[AgentRecord]:
        """Candidates in the registry's order, those under suspicion last."""
        now = time.monotonic()
        return sorted(candidates, key=lambda a: self._suspect.get(a.id, 0.0) > now)

    async def assign(self, skill: str, *, tenant: str, named: str | None = None) -> AgentRecord:
        """The agent a step of ``skill`` for ``tenant`` goes to, or ``no_specialist_for_skill``.

        ``named``: the agent the plan names, which must offer the skill (an agent outside the fleet
        too: egress still decides what, if anything, it gets). Otherwise the fleet's own agents come
        first, in the registry's order (those under suspicion last); only when none offers the skill
        may an agent outside the fleet get it, and only one the tenant's routing policy names
        (``fleet.routing.outside``), in the policy's order. Which agent claims a skill on its card
        never decides this by itself."""
        found = await self.discover(skill)
        if named is not None:
            chosen = next((a for a in found if a.id == named), None)
            if chosen is None:
                raise FleetError(
                    ErrorCode.NO_SPECIALIST,
                    f"the plan names {named} for skill {skill!r}, and discovery does not offer it for that skill",
                )
            return chosen
        inside = self._ranked([a for a in found if not a.external])
        if inside:
            return inside[0]
        outside = [a for a in found if a.external]
        if not outside:
            raise FleetError(ErrorCode.NO_SPECIALIST, f"no specialist offers skill {skill!r}")
        return await self._outside_for(skill, tenant, outside)

    async def _outside_for(self, skill: str, tenant: str, outside: list[AgentRecord]) -> AgentRecord:
        """The outside agent the tenant's routing policy names first for ``skill``."""
        if self._engine is None:
            raise FleetError(
                ErrorCode.NO_SPECIALIST,
                f"no agent of the fleet offers skill {skill!r}, and no routing policy here names one outside it",
            )
        decision = await self._engine.decide(
            "fleet.routing.outside", {"tenant": tenant, "skill": skill, "agents": [a.id for a in outside]}
        )
        by_id = {a.id: a for a in outside}
        named = [by_id[str(i)] for i in decision.result.get("agents", []) if str(i) in by_id]
        if not decision.allow or not named:
            raise FleetError(
                ErrorCode.NO_SPECIALIST,
                f"no agent of the fleet offers skill {skill!r}: {'; '.join(decision.reasons)}"
                f" (decision {decision.decision_id})",
            )
        chosen = self._ranked(named)[0]
        log.info(
            "skill %s for tenant %s goes outside the fleet to %s, as routing policy names it (decision %s)",
            skill,
            tenant,
            chosen.id,
            decision.decision_id,
        )
        return chosen

    async def alternatives(self, skill: str, tried: set[str]) -> list[AgentRecord]:
        """Other agents of the fleet offering ``skill`` that a step may move to (never one outside
        the fleet: a crash inside must not send the work out), best first."""
        found = await self.discover(skill)
        return self._ranked([a for a in found if a.id not in tried and not a.external])

    async def call(
        self,
        agent: AgentRecord,
        skill: str,
        payload: dict[str, Any],
        *,
        tenant: str,
        progress: Progress,
        operation_id: str | None = None,
        activity: Activity | None = None,
        run_id: str = "",
        step: str = "",
        limits: TaskLimits | None = None,
        usage: Usage | None = None,
        notes: Notes | None = None,
        resume: dict[str, Any] | None = None,
        last_request: Notes | None = None,
    ) -> dict[str, Any]:
        """Run ``skill`` on ``agent``; return its result data or raise a step failure.

        With an ``operation_id`` the agent runs the step at most once under that id. A call that
        never reached the agent raises ``specialist_unavailable``; one whose fate is open raises
        :class:`CallInterrupted` (the agent may have it, and may still be running it): cut off
        after it was sent, answered by a server error (5xx), a broken or unreadable stream, or a
        stream that ended before the task did. A refusal (4xx, a JSON-RPC error) and a task that
        failed are step failures. ``activity`` is called on every event the agent sends (its
        heartbeats included). The call carries the authority of ``run_id``'s caller, if it has one
        (see the module's doc). ``limits``: the task's budget and loop policy, sent to a fleet
        agent (an outside agent is told none of it); ``usage`` hears what the task says it spent;
        ``notes`` hears the progress notes its agent loop saves, and ``resume`` sends back the notes it
        saved before (an operation sent again to the agent that wrote them)."""
        sent = await self._egress(agent, skill, payload, tenant, progress) if agent.external else payload
        message = Message(
            role=Role.ROLE_USER,
            message_id=uuid.uuid4().hex,
            parts=[new_data_part({"skill": skill, "input": sent})],
        )
        if operation_id is not None:
            message.metadata.update({OPERATION_METADATA_KEY: operation_id})
        if limits is not None and not agent.external:
            message.metadata.update({BUDGET_METADATA_KEY: limits.budget, LOOP_METADATA_KEY: limits.loop})
        if resume is not None and not agent.external:
            message.metadata.update({PROGRESS_METADATA_KEY: resume})
        span = telemetry.invoke_agent_span(
            agent.id,
            kind=SpanKind.CLIENT,
            agent_id=agent.id,
            skill=skill,
            run_id=run_id,
            operation_id=operation_id,
            tenant=tenant,
            step=step,
        )
        with span:
            said = _Said(usage, notes, last_request) if not agent.external else _Said(usage)
            return await self._send(agent, skill, message, tenant, progress, activity, run_id, said)

    async def _send(
        self,
        agent: AgentRecord,
        skill: str,
        message: Message,
        tenant: str,
        progress: Progress,
        activity: Activity | None,
        run_id: str,
        said: _Said | None = None,
    ) -> dict[str, Any]:
        client = self._client(agent)
        try:
            for attempt in (1, 2):
                token = await self._agent_token(agent, tenant, run_id)
                # The trace context rides in the headers: the specialist's span becomes a child of ours.
                headers = telemetry.inject({"Authorization": f"Bearer {token}"})
                context = ClientCallContext(service_parameters=dict(headers))
                stream = client.send_message(SendMessageRequest(message=message), context=context)
                try:
                    result = await _collect(stream, agent.id, progress, activity or _idle, said or _Said())
                    check_answer(agent, skill, result)
                    return await self._answer(agent, skill, tenant, result) if agent.external else result
                except A2AClientError as exc:
                    if attempt == 2 or not _unauthenticated(exc):
                        raise
                    # Refused before it was read (a 401): the token went stale in the cache (a
                    # revocation, a rotation). Once more with a new one, which says why if it can't.
                    self._token_client(agent).discard(token)
            raise AssertionError("unreachable")
        except A2AClientError as exc:
            cause = exc.__cause__
            if isinstance(cause, httpx.ConnectError):
                raise FleetError(
                    ErrorCode.SPECIALIST_UNAVAILABLE,
                    f"cannot reach {agent.id} at {agent.url}",
                    retryable=True,
                ) from exc
            if _fate_open(exc):
                raise CallInterrupted(agent.id) from exc
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} refused the step: {exc}") from exc
        except A2AError as exc:
            raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} refused the step: {exc}") from exc

    async def prepare(self, agent: AgentRecord, tenant: str, run_id: str) -> None:
        """Get (and cache) the token a call to ``agent`` for the run will carry, before the call is
        recorded: a control plane that cannot issue it then fails the call before anything exists
        that a later attempt would have to reconcile. Any other refusal (a policy that denies the
        call, an outside agent's token endpoint that fails) is left to the call itself, which
        records it and may reroute as it always did. An agent outside the fleet is not contacted
        here: nothing, not even a token request, reaches it before egress policy allows the step."""
        if agent.external:
            return
        try:
            await self._agent_token(agent, tenant, run_id)
        except DependencyUnavailable:
            raise
        except FleetError:
            pass

    async def run_grant(self, caller: Claims, run_id: str) -> str:
        """The grant of the run ``caller`` starts: its token exchanged at the registry."""
        return await self._registry.tokens.exchange(
            caller.token, requested_type=RUN_GRANT_TYPE, run_id=run_id
        )

    async def policy_approval(
        self, tenant: str, run_id: str, op_id: str, request: ApprovalRequest, facts: dict[str, Any]
    ) -> tuple[str, Decision] | None:
        """Policy's approval of one gated tool call (``fleet.approvals.auto``, on ``facts`` the run
        computed) and the registry's grant for exactly that call, in this worker's name; None if
        policy leaves it to a person (or there is no policy here: closed)."""
        if self._engine is None:
            return None
        decision = await self._engine.decide(
            "fleet.approvals.auto",
            {
                "tenant": tenant,
                "server": request.server,
                "tool": request.tool,
                "arguments": request.arguments,
                "facts": facts,
            },
        )
        if not decision.allow:
            return None
        binding = ApprovalBinding(
            run_id, op_id, request.server, request.tool, request.args_sha256, decision.decision_id
        )
        return await self._registry.tokens.approval_grant(binding, tenant, facts=facts), decision

    def _token_client(self, agent: AgentRecord) -> TokenClient:
        """Where tokens for ``agent`` come from: the fleet's registry, or (an agent outside the
        fleet) the token endpoint its card names."""
        if not agent.external:
            return self._registry.tokens
        token_url, _ = _card_oauth(agent)
        if token_url == self._registry.token_url:
            return self._registry.tokens
        if self._outbound is None:
            raise FleetError(ErrorCode.FETCH_REFUSED, "this process asks no token endpoint outside the fleet")
        return self._registry.tokens_at(token_url, self._outbound)

    async def _agent_token(self, agent: AgentRecord, tenant: str, run_id: str) -> str:
        """A token for a call to ``agent`` for the run: from its grant if a caller started it; for
        an agent outside the fleet, from the token endpoint its card names."""
        if agent.external:
            _, scopes = _card_oauth(agent)
            return await self._token_client(agent).token(agent.url, tenant, scopes, resource=agent.url)
        grant = await self._grant(run_id) if run_id else None
        if grant is None:
            return await self._registry.tokens.token(agent.id, tenant, [INVOKE_SCOPE], run_id=run_id)
        return await self._registry.tokens.exchange(
            grant, agent.id, [INVOKE_SCOPE], subject_type=RUN_GRANT_TYPE
        )

    async def _egress(
        self, agent: AgentRecord, skill: str, payload: dict[str, Any], tenant: str, progress: Progress
    ) -> dict[str, Any]:
        """What of ``payload`` may leave for ``agent`` (see the module's doc), or ``policy_denied``:
        only the paths the decision's ``send`` names; every other part stays behind."""
        paths, unnameable = leaf_paths(payload)
        if len(paths) > MAX_PATHS:
            raise FleetError(
                ErrorCode.TOO_LARGE,
                f"egress to {agent.id} refused: the input has more than {MAX_PATHS} distinct fields",
            )
        decision = await self._egress_decision(
            "fleet.egress.decision",
            f"egress to {agent.id} refused",
            agent,
            skill,
            tenant,
            fields=sorted(str(k) for k in payload),
            paths=sorted(paths),
        )
        send = {str(p) for p in decision.result.get("send", [])} & paths
        withheld = sorted((paths - send) | unnameable)
        log.info(
            "egress to %s (%s, tenant %s): sent %s, withheld %s (decision %s)",
            agent.id,
            skill,
            tenant,
            sorted(send),
            withheld,
            decision.decision_id,
        )
        # In the run's log too (its timeline, the debug bundle): what left, by name only.
        await progress(
            f"egress to {agent.id} (outside the fleet): {len(send)} field(s) sent, {len(withheld)} withheld"
            f" (decision {decision.decision_id}): withheld {_listed(withheld)}"
        )
        sent: dict[str, Any] = (await redact_async(keep_paths(payload, send)))[0]
        return sent

    async def _answer(
        self, agent: AgentRecord, skill: str, tenant: str, result: dict[str, Any]
    ) -> dict[str, Any]:
        """``agent``'s answer as the egress policy lets it be used (see the module's doc)."""
        if result.get("status") in ASKING_STATES.values():
            return result  # a question for a person, who sees it before anything acts on it
        decision = await self._egress_decision(
            "fleet.egress.answer",
            f"the answer of {agent.id} is refused",
            agent,
            skill,
            tenant,
            fields=sorted(result),
            size=len(json.dumps(result, default=str)),
        )
        return result if decision.result.get("act") is True else {**result, UNTRUSTED: agent.id}

    async def _egress_decision(
        self, path: str, refused: str, agent: AgentRecord, skill: str, tenant: str, **facts: Any
    ) -> Decision:
        """The egress policy's decision at ``path``; ``policy_denied`` (``refused``: why) if it
        does not allow, ``policy_unavailable`` if there is no policy here (closed)."""
        if self._engine is None:
            raise FleetError(ErrorCode.POLICY_UNAVAILABLE, "no egress policy here: nothing leaves the fleet")
        agent_facts = {"id": agent.id, "url": agent.url}
        decision = await self._engine.decide(
            path, {"tenant": tenant, "agent": agent_facts, "skill": skill, **facts}
        )
        if not decision.allow:
            reasons = "; ".join(decision.reasons)
            log.warning("%s: %s (decision %s)", refused, reasons, decision.decision_id)
            raise FleetError(
                ErrorCode.POLICY_DENIED, f"{refused}: {reasons} (decision {decision.decision_id})"
            )
        return decision

    async def _grant(self, run_id: str) -> str | None:
        if self._grants is None:
            return None
        if run_id not in self._grant_of:
            if len(self._grant_of) >= GRANTS_CACHED:
                self._grant_of.clear()
            self._grant_of[run_id] = await self._grants(run_id)
        return self._grant_of[run_id]

    async def operation_status(
        self, agent: AgentRecord, operation_id: str, *, tenant: str, wait_s: float
    ) -> dict[str, Any] | None:
        """What ``agent`` knows of an operation (see :mod:`fleet.operation_ext`), or None if the
        agent does not declare the operations extension and so cannot say."""
        return await self._operation_call(
            agent, status_url(_card(agent)), operation_id, tenant, "GET", wait_s, "query"
        )

    async def cancel_operation(
        self, agent: AgentRecord, operation_id: str, *, tenant: str
    ) -> dict[str, Any] | None:
        """Cancel an operation at ``agent`` (see :mod:`fleet.operation_ext`) and return what the agent
        then says of it, as :meth:`operation_status` does; None if the agent cannot cancel operations
        (it does not declare the extension, or an earlier version of it without ``cancel_url``)."""
        return await self._operation_call(
            agent, cancel_url(_card(agent)), operation_id, tenant, "POST", MAX_WAIT_S, "cancel"
        )

    async def _operation_call(
        self,
        agent: AgentRecord,
        template: str | None,
        operation_id: str,
        tenant: str,
        method: str,
        wait_s: float,
        what: str,
    ) -> dict[str, Any] | None:
        """One request of the operations extension to the URL ``template`` names, or None if the
        card names none. The URL must be on the agent's own origin; the agent may hold the answer
        up to ``wait_s`` (a status query says so with ``?wait``; a cancel waits for its effect).
        These are the fleet's own supervision of its operations, so they go in the worker's name
        (a revoked caller does not stop a cancel or the reconciliation of what it started)."""
        if template is None:
            return None
        url = template.replace("{operation_id}", quote(operation_id, safe=""))
        if _origin(url) != _origin(agent.url):
            raise FleetError(
                ErrorCode.CARD_INVALID, f"{agent.id} names an operation {what} URL outside its own origin"
            )
        token = await self._agent_token(agent, tenant, "")
        try:
            response = await self._http.request(
                method,
                url,
                params={"wait": f"{wait_s:g}"} if method == "GET" else None,
                headers={"Authorization": f"Bearer {token}"},
                timeout=httpx.Timeout(10.0, read=wait_s + 10.0),
            )
        except httpx.TransportError as exc:
            raise FleetError(
                ErrorCode.SPECIALIST_UNAVAILABLE,
                f"cannot reach {agent.id} for an operation {what}",
                retryable=True,
            ) from exc
        return _operation_answer(agent, response, what)


def _operation_answer(agent: AgentRecord, response: httpx.Response, what: str) -> dict[str, Any]:
    """The body of an answer of the operations extension, checked."""
    if response.status_code != 200:
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED,
            f"{agent.id} answered the operation {what} with HTTP {response.status_code}",
        )
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("status"), str):
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED, f"{agent.id} answered the operation {what} without a status"
        )
    return body


class CallInterrupted(FleetError):
    """The call reached the agent but its answer was lost: only the agent knows what happened."""

    def __init__(self, agent_id: str) -> None:
        super().__init__(
            ErrorCode.SPECIALIST_UNAVAILABLE,
            f"the call to {agent_id} was cut off before it answered",
            retryable=True,
        )


def _idle() -> None:
    return None


def _listed(names: list[str], most: int = 20) -> str:
    shown = ", ".join(names[:most]) or "none"
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def _unauthenticated(exc: A2AClientError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 401


def _fate_open(exc: A2AClientError) -> bool:
    """Whether a failed call may still have been received and acted on."""
    cause = exc.__cause__
    if isinstance(exc, A2AClientTimeoutError) or isinstance(cause, httpx.TransportError | ValueError):
        return True  # cut off, or an answer that could not be read
    if isinstance(cause, httpx.HTTPStatusError):
        return cause.response.status_code >= 500  # a 4xx is a refusal; a 5xx may come after the work
    # An error event mid-stream, or the agent's internal error (it may have crashed after acting).
    return str(exc).startswith(("SSE stream error", "Network communication error", "JSON-RPC Error -32603"))


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def _card_oauth(agent: AgentRecord) -> tuple[str, list[str]]:
    """The token endpoint and scopes of the OAuth 2 client-credentials scheme ``agent``'s card names
    (the first one, in the order of its security requirements), or ``card_invalid``."""
    card = _card(agent)
    for requirement in card.security_requirements:
        for name in requirement.schemes:
            scheme = card.security_schemes.get(name)
            if scheme is None or not scheme.HasField("oauth2_security_scheme"):
                continue
            flows = scheme.oauth2_security_scheme.flows
            if flows.HasField("client_credentials") and flows.client_credentials.token_url:
                token_url = flows.client_credentials.token_url
                if not _acceptable_token_url(token_url):
                    raise FleetError(
                        ErrorCode.CARD_INVALID, f"{agent.id} names a token endpoint over plain HTTP"
                    )
                return token_url, sorted(flows.client_credentials.scopes)
    raise FleetError(ErrorCode.CARD_INVALID, f"{agent.id}'s card names no OAuth 2 client-credentials scheme")


def _acceptable_token_url(url: str) -> bool:
    """HTTPS, or HTTP to this machine (a local stack): a client assertion never travels in clear."""
    parts = urlsplit(url)
    return parts.scheme == "https" or (
        parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost", "::1")
    )


_ASKING = frozenset({"input_required", "auth_required", "pending_approval"})


def check_answer(agent: AgentRecord, skill: str, result: dict[str, Any]) -> None:
    """Refuse a result that breaks the JSON Schema the agent's own card declares for the skill (a
    broken release answering garbage): ``specialist_bad_answer``, naming what is wrong and where.
    A result that asks a person (a gate) is not the skill's result yet."""
    schema = skill_traits(agent.card, skill).get("output")
    if not isinstance(schema, dict) or result.get("status") in _ASKING:
        return
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(result))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the result"
        raise FleetError(
            ErrorCode.BAD_ANSWER,
            f"{agent.id} (v{agent.version}) answered {skill} with a result its card's schema refuses:"
            f" {where}: {error.message[:200]}",
        )


def skill_is_idempotent(agent: AgentRecord, skill: str) -> bool:
    """Whether the agent's card says a repeat of ``skill`` under one operation id is safe."""
    return skill_traits(agent.card, skill).get("idempotent") is True


def _card(agent: AgentRecord) -> AgentCard:
    try:
        return ParseDict(agent.card, AgentCard(), ignore_unknown_fields=True)
    except ParseError as exc:
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent.id} has an unreadable card") from exc


async def _collect(
    stream: Any, agent_id: str, progress: Progress, activity: Activity, said: _Said
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    state = TaskState.TASK_STATE_UNSPECIFIED
    last_text = ""
    error: dict[str, Any] = {}
    asked: list[Any] = []  # the data of the agent's last status message
    async for event in stream:
        activity()
        kind = event.WhichOneof("payload")
        if kind == "task":
            state = event.task.status.state
        elif kind == "status_update":
            state = event.status_update.status.state
            await said.heard(event.status_update.status.message)
            parts = event.status_update.status.message.parts
            text = " ".join(get_text_parts(parts))
            asked = get_data_parts(parts)
            error = next(
                (
                    d["error"]
                    for d in reversed(asked)
                    if isinstance(d, dict) and isinstance(d.get("error"), dict)
                ),
                error,
            )
            if text:
                last_text = text
                if state == TaskState.TASK_STATE_WORKING:
                    await progress(f"{agent_id}: {text}")
        elif kind == "artifact_update":
            await said.heard(event.artifact_update.artifact)
            for data in get_data_parts(event.artifact_update.artifact.parts):
                if isinstance(data, dict):
                    result.update(data)
    return _ended(state, agent_id, result, last_text, error, asked)


MAX_USAGE_CHARS = 4096  # what an agent's usage report may hold


@dataclass(frozen=True, slots=True)
class _Said:
    """Who hears what an agent says of a task besides its result: what it spent (``usage``) and
    its progress notes (``notes``)."""

    usage: Usage | None = None
    notes: Notes | None = None
    last_request: Notes | None = None

    async def heard(self, carrier: Any) -> None:
        """Pass on what a message's or an artifact's metadata says: ``fleet.usage`` if it is an
        object of bounded size (the agent's word: the run counts it against its budget, and a
        hostile agent can understate it), ``fleet.progress`` and ``fleet.last_request`` if they are
        objects."""
        if not carrier.HasField("metadata"):
            return
        fields = carrier.metadata.fields
        if not any(
            k in fields for k in (USAGE_METADATA_KEY, PROGRESS_METADATA_KEY, LAST_REQUEST_METADATA_KEY)
        ):
            return  # a heartbeat, a progress text
        said = MessageToDict(carrier.metadata)
        spent, notes, request = (
            said.get(k) for k in (USAGE_METADATA_KEY, PROGRESS_METADATA_KEY, LAST_REQUEST_METADATA_KEY)
        )
        if (
            self.usage is not None
            and isinstance(spent, dict)
            and len(json.dumps(spent, default=str)) <= MAX_USAGE_CHARS
        ):
            self.usage(spent)
        if self.notes is not None and isinstance(notes, dict):
            await self.notes(notes)
        if self.last_request is not None and isinstance(request, dict):
            await self.last_request(request)


@dataclass(frozen=True, slots=True)
class TaskLimits:
    """What a delegated task may spend and what its agent loop does at a limit: the metadata
    ``fleet.budget`` (TaskBudget's keys) and ``fleet.loop`` (LoopPolicy's) of its message."""

    budget: dict[str, Any]
    loop: dict[str, Any]


def _ended(
    state: TaskState,
    agent_id: str,
    result: dict[str, Any],
    last_text: str,
    error: dict[str, Any],
    asked: list[Any],
) -> dict[str, Any]:
    """What the step gets from a stream that ended in ``state``: the result, a gate, or an error."""
    if state in FAILED_STATES:
        cause = FleetError.from_dict(error, fallback=ErrorCode.SPECIALIST_FAILED) if error else None
        if cause is not None and cause.code == ErrorCode.OUTCOME_UNKNOWN:
            raise FleetError(ErrorCode.OUTCOME_UNKNOWN, f"{agent_id}: {cause.message}", cause=cause.cause)
        said = cause.message if cause is not None else last_text or "failed"
        raise FleetError(ErrorCode.SPECIALIST_FAILED, f"{agent_id} failed the step: {said}", cause=cause)
    if state in UNFINISHED_STATES:
        raise CallInterrupted(agent_id)  # the stream ended, the task did not: ask the agent
    if state in ASKING_STATES:
        # The agent asks for input (or for authorization) before it can go on: a gate. The step
        # pauses the run until a person answers, and the answer goes into the step's next call.
        status = ASKING_STATES[state]
        return {"status": status, "question": last_text or f"{agent_id}: {status}", "details": asked}
    if state != TaskState.TASK_STATE_COMPLETED:
        raise FleetError(
            ErrorCode.SPECIALIST_FAILED, f"{agent_id} ended the step in state {TaskState.Name(state)}"
        )
    return result
