"""The token service: short-lived access tokens bound to one audience, one tenant and the granted
scopes, for a client authenticated with ``private_key_jwt`` (RFC 7523).

Two grants:

* ``client_credentials``: a token in the client's own name (``sub`` = the client).
* token exchange (RFC 8693, ``urn:ietf:params:oauth:grant-type:token-exchange``): a token in the name
  of whoever the ``subject_token`` names, for the next hop. The subject token must have been issued
  here and addressed to the client (only the party a token was given to may pass it on); the new
  token keeps the subject's ``sub`` and ``tenant`` (a hop never changes either) and records the
  chain of acting parties in ``act`` (RFC 8693 section 4.1: the current actor outermost, earlier
  actors nested), at most ``MAX_CHAIN`` deep.

  A run outlives its caller's token (a run may wait days for an approval), so the coordinator
  exchanges the caller's token, when the run is created, for a **run grant**
  (``requested_token_type`` ``urn:fleet:params:oauth:token-type:run-grant``): the same principal and
  chain, bound to the run (``run_id``), addressed to the coordinator, living ``RUN_GRANT_TTL_S``.
  It is not an access token (``token_use: run_grant``, ``typ: run-grant+jwt``: every verifier refuses
  it as one) and is good only as the subject of an exchange, by the coordinator or one of its
  workers, each authenticated with its own key: a copy of it alone is worth nothing.

  A person at the console signs in with an access token addressed to the console, which the console
  exchanges for a **session grant** (``urn:fleet:params:oauth:token-type:session-grant``): the same
  principal, tenant and scopes, addressed to the console, living ``SESSION_GRANT_TTL_S`` (a working
  day, where an access token lives minutes). Like a run grant it is no access token
  (``token_use: session_grant``, ``typ: session-grant+jwt``) and is good only as the subject of an
  exchange by the console it was given to, for tokens carrying no scope the person signed in
  without: whatever the console does, it does in the person's name and within their rights.

  A signer that sends a signal over NATS (``fleet.signal_client``) asks for a **signal grant**
  (``urn:fleet:params:oauth:token-type:signal-grant``) with its own assertion (client
  credentials only: a signal is in the name of whoever holds the key), for the tenant and scopes
  policy grants, addressed to the coordinator, bound to one run (``run_id``), one action, one
  signal id and the SHA-256 of the exact body (the ``signal`` claim), living
  ``SIGNAL_GRANT_TTL_S``. No verifier takes it as an access token (``token_use: signal_grant``, ``typ: signal-grant+jwt``), and it is never the
  subject of an exchange: copied from a stored message, it can carry that one signal again, which
  the coordinator answers with the first answer.

  The subject may also be an access token of an outside identity provider the fleet trusts
  (``external``; only the coordinator may pass one on): its mapped principal and tenant, nothing
  else of it (see ``fleet.tokens.ExternalTokenVerifier``).

Either way the token carries exactly the scopes asked for, and only if the client's enrollment
allows each of them (the ceiling) and policy grants them (``fleet.tokens``, asked for every token:
which scopes the audience acts on, what may never be delegated, which tenant may reach which
service). A request for a scope that either refuses fails ``invalid_scope`` with the reasons; a
policy that cannot be evaluated fails it ``temporarily_unavailable`` (never a token by default).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from fleet.approvals import (
    APPROVAL_GRANT,
    APPROVAL_GRANT_TTL_S,
    APPROVAL_GRANT_TYP,
    APPROVAL_GRANT_TYPE,
    BINDING_FIELDS,
    POLICY_APPROVER,
    ApprovalBinding,
)
from fleet.errors import AuthError, ErrorCode, FleetError
from fleet.keys import SigningKey, public_key_from_jwk
from fleet.rates import RateLimits
from fleet.revocations import Revocations
from fleet.tokens import (
    ACCESS_TOKEN_TTL_S,
    ACCESS_TOKEN_TYPE,
    CLIENT_ASSERTION_TYPE,
    RUN_GRANT_TYPE,
    SESSION_GRANT_TYPE,
    SIGNAL_GRANT_TYPE,
    TOKEN_EXCHANGE,
    ExternalTokenVerifier,
    KeyLookup,
    TokenVerifier,
    decode_es256,
    peek,
)
from policy import Decision, PolicyEngine
from registry._records import IdentityRecord
from registry._store import RegistryStore

RUN_GRANT_TTL_S = 14 * 24 * 3600  # longer than any run may last (the budgets' max_seconds bound that)
SESSION_GRANT_TTL_S = 8 * 3600  # a console session: a working day, then the person signs in again
GRANT_KINDS = {
    RUN_GRANT_TYPE: ("run-grant+jwt", "run_grant"),
    SESSION_GRANT_TYPE: ("session-grant+jwt", "session_grant"),
}
SIGNAL_GRANT_TTL_S = 300  # published at once; refused once expired, even if it waited in the stream
log = logging.getLogger(__name__)
ISSUED_TYPES = {
    "signal-grant+jwt": SIGNAL_GRANT_TYPE,
    APPROVAL_GRANT_TYP: APPROVAL_GRANT_TYPE,
} | {typ: t for t, (typ, _) in GRANT_KINDS.items()}
APPROVE_SCOPE = "runs:approve"
APPROVING_ACTIONS = ("approve", "input")  # the signals that approve a gate
SIGNAL_FIELDS = {  # a signal grant's binding: the token request's field, and what it must look like
    "run_id": re.compile(r"[A-Za-z0-9_-]{1,128}"),
    "signal_action": re.compile(r"[a-z_]{1,32}"),
    "signal_id": re.compile(r"[A-Za-z0-9._:@/-]{1,200}"),
    "signal_sha256": re.compile(r"[0-9a-f]{64}"),
}
MAX_CHAIN = 5  # actors in one delegation chain, the subject's excluded
MAX_ASSERTION_LIFETIME_S = 300
IDENTITY_CACHE_S = 2.0
IDENTITY_REREAD_S = 1.0  # an identity is read again for a key it did not hold at most this often
DECISION_CACHE_S = 10.0
DECISIONS_CACHED = 4096
CLIENT_KEYS_CACHED = 4096
ASSERTION_CLAIMS = ("exp", "iat", "jti", "iss", "sub", "aud")
LEEWAY_S = 10
REGISTRY_AUDIENCE = "registry"


class OAuthError(Exception):
    """An RFC 6749 error response: ``error`` is the standard code, ``status`` the HTTP status,
    ``retry_after_s`` the ``Retry-After`` of a refusal that retrying later helps."""

    def __init__(
        self, error: str, description: str, status: int = 400, retry_after_s: int | None = None
    ) -> None:
        super().__init__(description)
        self.error = error
        self.description = description
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class IssuedToken:
    access_token: str
    expires_in: int
    scope: str
    issued_token_type: str = ACCESS_TOKEN_TYPE
    tenant: str = ""  # whose quota it counts against (fleet.limits.fair.token_issue)


class TokenService:
    """Verifies client assertions against enrolled keys and mints access tokens."""

    def __init__(
        self,
        store: RegistryStore,
        key: SigningKey,
        issuer: str,
        token_url: str,
        revocations: Revocations | None = None,
        keys: KeyLookup | None = None,
        *,
        policy: PolicyEngine,
        external: Iterable[ExternalTokenVerifier] = (),
        issuer_url: str = "",
    ) -> None:
        """``token_url``: the token endpoint, which a client assertion may name as its audience;
        ``issuer_url``: the registry's URL as its RFC 8414 metadata names it (its ``issuer``), which
        an assertion may name instead (RFC 7523, as standard clients such as the MCP SDK's do)."""
        self._store = store
        self._policy = policy
        self._external = {v.issuer.issuer: v for v in external}
        self._keys: KeyLookup = keys or self._own_key
        self.key = key  # the issuer's signing key; replaced when the registry rotates it
        self._issuer = issuer
        self._token_url = token_url
        root = issuer_url.rstrip("/")
        # Who an assertion may be addressed to: the token endpoint, or this server by its issuer URL.
        self._assertion_audiences = (token_url, root, root + "/") if root else (token_url,)
        self._revocations = revocations
        self._identities: dict[str, tuple[float, IdentityRecord]] = {}
        self._rereads: dict[str, asyncio.Lock] = {}  # by identity id (identities that exist only)
        self._servers: dict[str, tuple[float, set[str]]] = {}  # MCP servers' declared scopes
        self._decisions: dict[str, tuple[float, Decision]] = {}  # token decisions, by facts
        self._client_keys: dict[str, ec.EllipticCurvePublicKey] = {}  # by kid (a thumbprint)
        self._rates = RateLimits()  # tokens issued per tenant

    async def _own_key(self, kid: str) -> ec.EllipticCurvePublicKey | None:
        return self.key.private_key.public_key() if kid == self.key.kid else None

    async def _identity(self, identity_id: str, kid: str | None = None) -> IdentityRecord | None:
        """The identity's record, read again at most every ``IDENTITY_CACHE_S``; at once if it does
        not hold ``kid`` (a key enrolled a moment ago). A revoked key is refused by the revocation
        list, which is followed live, whatever the cached record says."""
        arrived = time.monotonic()
        cached = self._identities.get(identity_id)
        fresh = cached is not None and arrived - cached[0] < IDENTITY_CACHE_S
        if cached is not None and fresh and (kid is None or kid in cached[1].keys):
            return cached[1]
        if cached is None or not fresh:
            return await self._read_identity(identity_id)
        # A key the identity did not hold when last read (enrolled a moment ago, or made up):
        # requests for it share one read per IDENTITY_REREAD_S, waiting for the turn.
        async with self._rereads.setdefault(identity_id, asyncio.Lock()):
            latest = self._identities.get(identity_id)
            if latest is not None and latest[0] >= arrived:  # read since this request arrived
                return latest[1]
            pause = IDENTITY_REREAD_S - (time.monotonic() - (latest or cached)[0])
            if pause > 0:
                await asyncio.sleep(pause)
            return await self._read_identity(identity_id)

    async def _read_identity(self, identity_id: str) -> IdentityRecord | None:
        started = time.monotonic()
        found = await self._store.identity(identity_id)
        if found is None:
            self._identities.pop(identity_id, None)
            self._rereads.pop(identity_id, None)
        else:
            self._identities[identity_id] = (started, found)
        return found

    async def grant(self, form: Mapping[str, str]) -> IssuedToken:
        """Answer a token request (either grant; see the module's doc)."""
        grant_type = form.get("grant_type")
        if grant_type not in ("client_credentials", TOKEN_EXCHANGE):
            raise OAuthError("unsupported_grant_type", "client_credentials or token exchange (RFC 8693)")
        if form.get("client_assertion_type") != CLIENT_ASSERTION_TYPE:
            raise OAuthError("invalid_client", "a private_key_jwt client assertion is required", 401)
        client, client_kid, jti = await self._authenticate(form.get("client_assertion", ""))
        # The assertion is used up (in NATS KV, so for every replica) while the grant is decided
        # and signed; the token is given only once that write says it was the first use.
        first_use = asyncio.ensure_future(self._store.use_nonce("assertion", f"{client.id}.{jti}"))
        try:
            issued = await self._decide_grant(grant_type, client, client_kid, form)
        except OAuthError:
            await self._first_use(first_use)  # a replay is refused as such, whatever else is wrong
            raise
        except BaseException:
            first_use.cancel()
            raise
        await self._first_use(first_use)
        await self._within_rate(client, issued.tenant)
        return issued

    async def _within_rate(self, client: IdentityRecord, tenant: str) -> None:
        """Count one token issued for ``tenant``, or refuse it (``rate_limited``, 429) if the tenant
        has had as many as ``fleet.limits.fair.token_issue`` allows (per second, burst)."""
        try:
            decision = await self._policy.decide("fleet.limits.fair.token_issue", {"tenant": tenant})
        except FleetError as exc:
            raise OAuthError(
                "temporarily_unavailable", f"rate policy unavailable: {exc.message}", 503
            ) from None
        wait_s = self._rates.take((tenant,), decision.result)
        if wait_s:
            retry = max(1, math.ceil(min(wait_s, 3600)))
            log.warning("token for %s of tenant %r refused: tenant over its rate", client.id, tenant)
            raise OAuthError(
                str(ErrorCode.RATE_LIMITED),
                f"tenant {tenant!r} is issued tokens more often than policy allows; retry in {retry} s",
                429,
                retry,
            )

    @staticmethod
    async def _first_use(first_use: Awaitable[bool]) -> None:
        if not await first_use:
            raise OAuthError("invalid_client", "client assertion was already used", 401)

    async def _decide_grant(
        self, grant_type: str, client: IdentityRecord, client_kid: str, form: Mapping[str, str]
    ) -> IssuedToken:
        if grant_type == TOKEN_EXCHANGE:
            return await self._exchange(client, client_kid, form)
        audience = await self._audience(form)
        tenant = form.get("tenant", "") or _only_tenant(client)
        scopes = sorted(set(form.get("scope", "").split()))
        if form.get("resource") and not form.get("audience"):
            scopes = _within_enrollment(client, scopes)
        if form.get("requested_token_type") == SIGNAL_GRANT_TYPE:
            return await self._signal_grant(client, client_kid, tenant, scopes, form)
        if form.get("requested_token_type") == APPROVAL_GRANT_TYPE:
            if client.kind not in ("coordinator", "worker") or not client.allows_tenant(tenant):
                raise OAuthError(
                    "unauthorized_client", "only the coordinator and its workers approve by policy"
                )
            await self._policy_approves(tenant, form)
            return await self._approval_grant(client, client_kid, tenant, POLICY_APPROVER, "policy", form)
        decided = await self._check_grant(client, audience, tenant, scopes, client.id, [])
        extra: dict[str, Any] = {"policy_decision": decided, "sub_kind": subject_kind(client)}
        run_id = form.get("run_id", "")
        if run_id:
            # The run a worker calls for (a run no caller started: a trigger's), so that what the
            # call leads to (memory provenance, idempotency keys) names it, as a run grant would.
            if client.kind not in ("coordinator", "worker") or len(run_id) > 100 or not run_id.isprintable():
                raise OAuthError("invalid_request", "only the coordinator's workers name a run_id")
            extra["run_id"] = run_id
        return self._sign(client.id, client.id, audience, tenant, scopes, client_kid, extra)

    async def _audience(self, form: Mapping[str, str]) -> str:
        """The audience a client-credentials token is asked for: ``audience`` (the fleet's clients
        name the service), or the MCP server whose registered endpoint is the RFC 8707
        ``resource`` (what a standard MCP client sends, from the server's RFC 9728 metadata). Both,
        if given, must name the same server."""
        audience, resource = form.get("audience", ""), form.get("resource", "")
        if not resource:
            return audience
        wanted = resource.rstrip("/")
        named = [m.audience for m in await self._store.mcp_servers() if m.url.rstrip("/") == wanted]
        if len(named) != 1 or (audience and audience != named[0]):
            raise OAuthError("invalid_target", f"resource {resource!r} is no MCP server of this fleet")
        return named[0]

    async def _exchange(
        self, client: IdentityRecord, client_kid: str, form: Mapping[str, str]
    ) -> IssuedToken:
        subject_type = form.get("subject_token_type", "")
        if form.get("requested_token_type") == APPROVAL_GRANT_TYPE:
            return await self._person_approval(client, client_kid, subject_type, form)
        if subject_type != ACCESS_TOKEN_TYPE and subject_type not in GRANT_KINDS:
            raise OAuthError(
                "invalid_request",
                "subject_token_type must be an access token, a run grant or a session grant",
            )
        subject = await self._subject(client, form.get("subject_token", ""), subject_type)
        tenant = str(subject["tenant"])
        if form.get("tenant", tenant) != tenant:
            raise OAuthError("invalid_request", "an exchanged token keeps the subject's tenant")
        if not client.allows_tenant(tenant):
            raise OAuthError("unauthorized_client", f"{client.id} may not act for tenant {tenant!r}")
        act: dict[str, Any] = {"sub": client.id}
        if isinstance(subject.get("act"), dict):
            act["act"] = subject["act"]
        if len(actors_of(act)) > MAX_CHAIN:
            raise OAuthError("invalid_request", f"the delegation chain is longer than {MAX_CHAIN}")
        # Every key the chain authenticated with, so that revoking any of them (the caller's too)
        # stops what was exchanged from its tokens.
        chain_kids = [str(subject.get("client_kid", "")), *[str(k) for k in subject.get("chain_kids", [])]]
        extra: dict[str, Any] = {
            "act": act,
            "chain_kids": [k for k in chain_kids if k],
            "sub_kind": str(subject.get("sub_kind") or ""),  # a hop never changes who the subject is
        }
        if "run_id" in subject:
            extra["run_id"] = subject["run_id"]
        requested = form.get("requested_token_type", ACCESS_TOKEN_TYPE)
        if requested == RUN_GRANT_TYPE:
            run_id = form.get("run_id", "")
            if client.kind != "coordinator" or subject_type != ACCESS_TOKEN_TYPE or not run_id:
                raise OAuthError(
                    "invalid_request",
                    "a run grant is for the coordinator, from a caller's token, for a run_id",
                )
            scopes = sorted(str(subject.get("scope", "")).split())
            return self._sign(
                str(subject["sub"]), client.id, client.id, tenant, scopes, client_kid,
                {**extra, "run_id": run_id, "token_use": "run_grant"}, RUN_GRANT_TTL_S, "run-grant+jwt",
            )  # fmt: skip
        if requested == SESSION_GRANT_TYPE:
            return await self._session_grant(client, client_kid, subject, subject_type, tenant, extra)
        if requested != ACCESS_TOKEN_TYPE:
            raise OAuthError("invalid_request", f"cannot issue a {requested!r}")
        audience = form.get("audience", "")
        scopes = sorted(set(form.get("scope", "").split()))
        if subject_type == SESSION_GRANT_TYPE:  # the console acts within the person's sign-in
            if await self._person(str(subject["sub"])) is None:
                raise OAuthError("invalid_grant", "the session's person is no longer enrolled")
            beyond = set(scopes) - set(str(subject.get("scope", "")).split())
            if beyond:
                raise OAuthError(
                    "invalid_scope", f"the session was not signed in with {' '.join(sorted(beyond))}"
                )
        decided = await self._check_grant(
            client, audience, tenant, scopes, str(subject["sub"]), actors_of(act)
        )
        extra["policy_decision"] = decided
        return self._sign(str(subject["sub"]), client.id, audience, tenant, scopes, client_kid, extra)

    async def _person(self, subject: str) -> IdentityRecord | None:
        """The enrolled person (an identity of kind ``operator``) named ``subject``, if any."""
        identity = await self._identity(subject)
        return identity if identity is not None and identity.kind == "operator" else None

    async def _session_grant(
        self,
        client: IdentityRecord,
        client_kid: str,
        subject: Mapping[str, Any],
        subject_type: str,
        tenant: str,
        extra: Mapping[str, Any],
    ) -> IssuedToken:
        """A console's session grant for the person whose access token (addressed to the console)
        it was given: same principal, tenant and scopes."""
        if client.kind != "console" or subject_type != ACCESS_TOKEN_TYPE:
            raise OAuthError("invalid_request", "a session grant is for the console, from a person's token")
        # Only a person's own sign-in: not a token passed down a chain, not one of a run, not a service's.
        own = "act" not in subject and "run_id" not in subject and subject.get("client_id") == subject["sub"]
        if not own or await self._person(str(subject["sub"])) is None:
            raise OAuthError("invalid_grant", "a session is opened with a person's own sign-in token")
        scopes = sorted(str(subject.get("scope", "")).split())
        # The console becomes the actor when it redeems the grant, not before (once in the chain).
        claims = {k: v for k, v in extra.items() if k != "act"}
        return self._sign(
            str(subject["sub"]), client.id, client.id, tenant, scopes, client_kid,
            {**claims, "token_use": "session_grant"}, SESSION_GRANT_TTL_S, "session-grant+jwt",
        )  # fmt: skip

    async def _signal_grant(
        self, client: IdentityRecord, client_kid: str, tenant: str, scopes: list[str], form: Mapping[str, str]
    ) -> IssuedToken:
        """A grant for the one signal ``form`` describes (see the module's doc)."""
        bound = {name: form.get(name, "") for name in SIGNAL_FIELDS}
        wrong = [name for name, shape in SIGNAL_FIELDS.items() if not shape.fullmatch(bound[name])]
        if wrong:
            raise OAuthError("invalid_request", f"a signal grant needs a valid {', '.join(wrong)}")
        action = bound["signal_action"]
        audience = form.get("audience", "")
        decided = await self._check_grant(client, audience, tenant, scopes, client.id, [], signal=action)
        signal = {"action": action, "id": bound["signal_id"], "sha256": bound["signal_sha256"]}
        claims = {
            "policy_decision": decided,
            "run_id": bound["run_id"],
            "signal": signal,
            "sub_kind": subject_kind(client),
        }
        return self._sign(
            client.id, client.id, audience, tenant, scopes, client_kid,
            {**claims, "token_use": "signal_grant"}, SIGNAL_GRANT_TTL_S, "signal-grant+jwt",
        )  # fmt: skip

    async def _person_approval(
        self, client: IdentityRecord, client_kid: str, subject_type: str, form: Mapping[str, str]
    ) -> IssuedToken:
        """An approval grant for the person whose token the coordinator was given with their
        approval (an access token addressed to it, or the signal grant of their signal): the
        approver is that token's verified subject, never a field of the request."""
        if client.kind != "coordinator":
            raise OAuthError("unauthorized_client", "only the coordinator asks for a person's approval grant")
        token = form.get("subject_token", "")
        if subject_type == SIGNAL_GRANT_TYPE:
            verifier = TokenVerifier(
                self._keys, issuer=self._issuer, audience=client.id, revocations=self._revocations,
                grant="signal_grant",
            )  # fmt: skip
            try:
                subject = (await verifier.verify(token)).raw
            except FleetError as exc:
                raise OAuthError(
                    "invalid_grant", f"the approver's signal grant is refused: {exc.message}"
                ) from exc
            signal = subject.get("signal")
            action = signal.get("action") if isinstance(signal, dict) else None
            if action not in APPROVING_ACTIONS or subject.get("run_id") != form.get("run_id"):
                raise OAuthError("invalid_grant", "the approver's signal does not approve this run")
        elif subject_type == ACCESS_TOKEN_TYPE:
            subject = await self._subject(client, token, ACCESS_TOKEN_TYPE)
        else:
            raise OAuthError("invalid_request", "the approver's token is an access token or a signal grant")
        tenant = str(subject["tenant"])
        if form.get("tenant", tenant) != tenant:
            raise OAuthError("invalid_request", "an approval grant is for the approver's tenant")
        if APPROVE_SCOPE not in str(subject.get("scope", "")).split():
            raise OAuthError("invalid_scope", f"the approver's token lacks {APPROVE_SCOPE}")
        if not client.allows_tenant(tenant):
            raise OAuthError("unauthorized_client", f"{client.id} may not act for tenant {tenant!r}")
        return await self._approval_grant(client, client_kid, tenant, str(subject["sub"]), "person", form)

    async def _policy_approves(self, tenant: str, form: Mapping[str, str]) -> None:
        """Refuse a grant in policy's name unless ``fleet.approvals.auto`` approves the call on the
        facts the worker says the run computed: a worker's key alone cannot approve what policy
        never approves (a refund, a tool that always asks)."""
        try:
            facts = json.loads(form.get("approval_facts", "{}"))
        except ValueError as exc:
            raise OAuthError("invalid_request", "approval_facts must be a JSON object") from exc
        if not isinstance(facts, dict) or len(form.get("approval_facts", "")) > 4096:
            raise OAuthError("invalid_request", "approval_facts must be a JSON object of at most 4 KiB")
        request = {
            "tenant": tenant,
            "server": form.get("audience", ""),
            "tool": form.get("approval_tool", ""),
            "arguments": {},
            "facts": facts,
        }
        try:
            decision = await self._policy.decide("fleet.approvals.auto", request)
        except FleetError as exc:
            raise OAuthError(
                "temporarily_unavailable", f"approval policy unavailable: {exc.message}", 503
            ) from exc
        if not decision.allow:
            reasons = "; ".join(decision.reasons) or "policy approves no such call"
            raise OAuthError(
                "invalid_grant", f"policy does not approve it: {reasons} (decision {decision.decision_id})"
            )

    async def _approval_grant(
        self,
        client: IdentityRecord,
        client_kid: str,
        tenant: str,
        approver: str,
        by: str,
        form: Mapping[str, str],
    ) -> IssuedToken:
        """The grant for the one call ``form`` binds (see :mod:`fleet.approvals`), addressed to
        the tool's MCP server, in ``approver``'s name."""
        bound = {name: form.get(name, "") for name in BINDING_FIELDS}
        wrong = [name for name, shape in BINDING_FIELDS.items() if not shape.fullmatch(bound[name])]
        if wrong:
            raise OAuthError("invalid_request", f"an approval grant needs a valid {', '.join(wrong)}")
        server = form.get("audience", "")
        identity = await self._identity(server) if server else None
        if identity is None or identity.kind != "mcp_server":
            raise OAuthError("invalid_target", f"an approval grant is for an MCP server, not {server!r}")
        if not tenant:
            raise OAuthError("invalid_request", "tenant is required")
        binding = ApprovalBinding(
            bound["run_id"], bound["approval_op"], server, bound["approval_tool"],
            bound["approval_sha256"], bound["approval_decision"],
        )  # fmt: skip
        claims = {
            "run_id": binding.run_id,
            "approval": binding.claim(approver, by),
            "token_use": APPROVAL_GRANT,
        }
        return self._sign(
            approver,
            client.id,
            server,
            tenant,
            [],
            client_kid,
            claims,
            APPROVAL_GRANT_TTL_S,
            APPROVAL_GRANT_TYP,
        )

    async def _subject(self, client: IdentityRecord, token: str, kind: str) -> dict[str, Any]:
        """The verified claims of the token to exchange: issued here, unexpired, not revoked, and
        given to ``client`` (a run grant: to the coordinator, redeemed by it or one of its workers)."""
        try:
            header, unverified = peek(token)
            typ = header.get("typ")
        except AuthError as exc:
            raise OAuthError("invalid_grant", "the subject token is malformed") from exc
        if kind == ACCESS_TOKEN_TYPE and unverified.get("iss") in self._external:
            return await self._outside_subject(client, token, self._external[str(unverified["iss"])])
        audience = client.id
        if kind in GRANT_KINDS and (typ, unverified.get("token_use")) != GRANT_KINDS[kind]:
            raise OAuthError(
                "invalid_grant", f"the subject token is not a {GRANT_KINDS[kind][1].replace('_', ' ')}"
            )
        if kind == RUN_GRANT_TYPE:
            granted_to = await self._identity(str(unverified.get("aud", "")))
            if client.kind == "worker" and granted_to is not None and granted_to.kind == "coordinator":
                audience = granted_to.id
        verifier = TokenVerifier(
            self._keys, issuer=self._issuer, audience=audience, revocations=self._revocations, run_grants=True
        )
        try:
            claims = await verifier.verify(token)
        except FleetError as exc:
            raise OAuthError("invalid_grant", f"the subject token is refused: {exc.message}") from exc
        if kind == ACCESS_TOKEN_TYPE and claims.raw.get("token_use", "access") != "access":
            raise OAuthError(
                "invalid_grant", f"a {claims.raw['token_use'].replace('_', ' ')} is not an access token"
            )
        return claims.raw

    async def _token_decision(self, request: dict[str, Any]) -> Decision:
        """``fleet.tokens.decision`` for ``request``. The same facts under the same bundle revision
        get the same decision, so one is kept for up to ``DECISION_CACHE_S`` (a client asks for the
        same token again and again; a new revision is a new key)."""
        key = json.dumps([self._policy.revision, request], sort_keys=True)
        now = time.monotonic()
        cached = self._decisions.get(key)
        if cached is not None and now - cached[0] < DECISION_CACHE_S:
            return cached[1]
        decision = await self._policy.decide("fleet.tokens.decision", request)
        if len(self._decisions) >= DECISIONS_CACHED:
            self._decisions.clear()
        self._decisions[key] = (now, decision)
        return decision

    async def _declared_scopes(self, server_id: str) -> set[str]:
        """The scopes an MCP server's registered tools declare (read again at most every
        ``IDENTITY_CACHE_S``: a server registered a moment ago is known at once)."""
        cached = self._servers.get(server_id)
        if cached is not None and time.monotonic() - cached[0] < IDENTITY_CACHE_S:
            return cached[1]
        record = await self._store.mcp_server(server_id)
        declared = record.declared_scopes if record is not None else set()
        if record is not None:
            self._servers[server_id] = (time.monotonic(), declared)
        return declared

    async def _outside_subject(
        self, client: IdentityRecord, token: str, verifier: ExternalTokenVerifier
    ) -> dict[str, Any]:
        """The subject of an outside issuer's token, as the coordinator accepted it: only the
        coordinator may pass one on (it is the one the fleet's outside callers address), and only
        what the issuer's mapping says is taken (see ``fleet.tokens.ExternalTokenVerifier``)."""
        if client.kind != "coordinator":
            raise OAuthError("invalid_grant", "only the coordinator passes on an outside issuer's token")
        try:
            claims = await verifier.verify(token)
        except FleetError as exc:
            raise OAuthError("invalid_grant", f"the subject token is refused: {exc.message}") from exc
        mapped = claims.raw
        return {k: mapped[k] for k in ("sub", "tenant", "scope")} | {
            "client_kid": mapped["ext_kid"],
            "sub_kind": "external",
        }

    async def _authenticate(self, assertion: str) -> tuple[IdentityRecord, str, str]:
        """The client, the key id it proved it holds, and the assertion's ``jti`` (not yet used:
        see :meth:`grant`)."""
        try:
            header, unverified = peek(assertion)
        except AuthError as exc:
            raise OAuthError("invalid_client", "malformed client assertion", 401) from exc
        client_id = unverified.get("sub")
        if not isinstance(client_id, str) or unverified.get("iss") != client_id:
            raise OAuthError("invalid_client", "assertion iss and sub must name the client", 401)
        named = header.get("kid")
        identity = await self._identity(client_id, named if isinstance(named, str) else None)
        usable = identity.usable_keys(time.time()) if identity else {}
        if isinstance(named, str):
            kid = named
        elif identity is not None and len(usable) != 1:
            raise OAuthError("invalid_client", "the assertion must name the client's key (kid)", 401)
        else:  # RFC 7523 needs no kid (the MCP SDK's assertions carry none): the client's one key
            kid = next(iter(usable), "")
        jwk = usable.get(kid)
        if identity is None or jwk is None:
            raise OAuthError("invalid_client", "unknown client or key (or a retired one)", 401)
        if self._revocations is not None and self._revocations.check(kid):
            raise OAuthError("invalid_client", "the client's key was revoked", 401)
        claims = self._verify_assertion(assertion, client_id, kid, jwk)
        return identity, kid, str(claims["jti"])

    def _verify_assertion(
        self, assertion: str, client_id: str, kid: str, jwk: dict[str, Any]
    ) -> dict[str, Any]:
        key = self._client_keys.get(kid)
        if key is None:  # parsed once per key (a JWK's members never change under its thumbprint)
            if len(self._client_keys) >= CLIENT_KEYS_CACHED:
                self._client_keys.clear()
            key = self._client_keys[kid] = public_key_from_jwk(jwk)
        try:
            claims = decode_es256(
                assertion, key, self._assertion_audiences, client_id, LEEWAY_S, ASSERTION_CLAIMS
            )
        except AuthError as exc:
            raise OAuthError("invalid_client", f"client assertion rejected: {exc.message}", 401) from exc
        if int(claims["exp"]) - int(claims["iat"]) > MAX_ASSERTION_LIFETIME_S:
            raise OAuthError("invalid_client", "client assertion lives too long", 401)
        if not all(c.isalnum() or c in "-_" for c in str(claims["jti"])):
            raise OAuthError("invalid_client", "client assertion jti has unsupported characters", 401)
        return claims

    async def _check_grant(
        self,
        client: IdentityRecord,
        audience: str,
        tenant: str,
        scopes: list[str],
        subject: str,
        actors: list[str],
        *,
        signal: str = "",
    ) -> str:
        """Refuse the token unless the audience exists, the client may act for the tenant, its
        enrollment allows every scope, and policy grants them (see the module's doc); the id of the
        decision that granted them (the token carries it as ``policy_decision``). ``signal``: the
        action of the signal a signal grant is asked for."""
        if not audience:
            raise OAuthError("invalid_request", "audience is required")
        if not tenant:
            raise OAuthError("invalid_request", "tenant is required")
        target: dict[str, Any] = {"id": audience, "kind": "registry"}
        if audience != REGISTRY_AUDIENCE:
            identity = await self._identity(audience)
            if identity is None or identity.kind == "operator":
                raise OAuthError("invalid_target", f"unknown audience {audience!r}")
            target["kind"] = identity.kind
            if identity.kind == "mcp_server":  # the scopes its registered tools declare
                target["scopes"] = sorted(await self._declared_scopes(audience))
        if not client.allows_tenant(tenant):
            raise OAuthError("unauthorized_client", f"{client.id} may not act for tenant {tenant!r}")
        refused = [scope for scope in scopes if not client.allows_scope(scope)]
        if refused:
            raise OAuthError("invalid_scope", f"scopes not granted to {client.id}: {' '.join(refused)}")
        request = {
            "grant": "token_exchange" if actors else "client_credentials",
            "client": {
                "id": client.id,
                "kind": client.kind,
                "scopes": list(client.scopes),
                "external": client.external,
            },
            "subject": subject,
            "actors": actors,
            "audience": target,
            "tenant": tenant,
            "scopes": scopes,
        }
        if signal:  # policy sees the action, not the run or the id: one decision serves many signals
            request["signal"] = {"action": signal}
        try:
            decision = await self._token_decision(request)
        except FleetError as exc:
            raise OAuthError(
                "temporarily_unavailable", f"token policy unavailable: {exc.message}", 503
            ) from exc
        if not decision.allow:
            reasons = "; ".join(decision.reasons) or "no rule grants it"
            raise OAuthError("invalid_scope", f"policy refuses: {reasons} (decision {decision.decision_id})")
        return decision.decision_id

    def issue(
        self, subject: str, audience: str, tenant: str, scopes: list[str], client_kid: str
    ) -> IssuedToken:
        """An access token in the client's own name (the grant is checked already). ``client_kid``:
        the key the client authenticated with; a verifier refuses the token once it is revoked."""
        return self._sign(subject, subject, audience, tenant, scopes, client_kid)

    def _sign(
        self,
        subject: str,
        client_id: str,
        audience: str,
        tenant: str,
        scopes: list[str],
        client_kid: str,
        extra: Mapping[str, Any] | None = None,
        ttl_s: int = ACCESS_TOKEN_TTL_S,
        typ: str = "at+jwt",
    ) -> IssuedToken:
        now = int(time.time())
        scope = " ".join(scopes)
        token = self.key.sign(
            {
                "iss": self._issuer,
                "sub": subject,
                "client_id": client_id,
                "aud": audience,
                "tenant": tenant,
                "scope": scope,
                "iat": now,
                "nbf": now,
                "exp": now + ttl_s,
                "jti": uuid.uuid4().hex,
                "client_kid": client_kid,
                **(extra or {}),
            },
            typ=typ,
        )
        return IssuedToken(token, ttl_s, scope, ISSUED_TYPES.get(typ, ACCESS_TOKEN_TYPE), tenant)


def subject_kind(identity: IdentityRecord) -> str:
    """The ``sub_kind`` claim of a token in ``identity``'s own name: its enrolled kind, or
    ``external`` for an identity another organisation runs. Services that keep provenance (the
    memory server) read it to tell a person from a service or a partner; a hop keeps it."""
    return "external" if identity.external else identity.kind


def actors_of(act: Mapping[str, Any] | None) -> list[str]:
    """The acting parties of an ``act`` claim, the current one first."""
    chain: list[str] = []
    while isinstance(act, Mapping) and len(chain) <= MAX_CHAIN + 1:
        chain.append(str(act.get("sub", "")))
        act = act.get("act")
    return chain


def _only_tenant(client: IdentityRecord) -> str:
    """The tenant a client-credentials request that names none is for: the client's one tenant, if
    its enrollment allows exactly one (a standard OAuth client knows no ``tenant`` parameter); else
    none, and the request is refused as it always was."""
    return client.tenants[0] if len(client.tenants) == 1 and client.tenants[0] != "*" else ""


def _within_enrollment(client: IdentityRecord, scopes: list[str]) -> list[str]:
    """What a standard client's request (one that names its target by ``resource``) gets of the
    scopes it asks for: those its enrollment allows (RFC 6749 3.3: the answer's ``scope`` says
    which). Such a client asks for every scope the server's metadata lists, whatever it needs; the
    fleet's own clients name the ``audience`` and are refused anything beyond their enrollment.
    None of them allowed is still a refusal."""
    allowed = [scope for scope in scopes if client.allows_scope(scope)]
    if scopes and not allowed:
        raise OAuthError("invalid_scope", f"none of the scopes asked for is granted to {client.id}")
    return allowed
