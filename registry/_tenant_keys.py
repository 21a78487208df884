"""Tenant keys (``POST /v1/tenant-keys``): a tenant's key for sealing its artifacts and workspace
heads (see :mod:`fleet.tenant_keys`), given to a service only against a caller's token of that tenant.

The service authenticates with its own registry token (in its own name, never delegated) and shows
the access token a caller sent it. The key is released when all of these hold:

* the caller's token is the registry's (its signature, issuer), unexpired, none of its keys revoked,
  an access token (no grant), addressed to the asking service, and for one tenant (never ``*``);
* the tenant the service names, if it names one, is that token's;
* policy (``fleet.tokens.tenant_key``) lets this service hold tenant keys (by default the servers that
  keep artifacts: ``data.config.tokens.tenant_key_holders``).

So a service holds a tenant's key only while that tenant's callers reach it: one stolen service
key, or bus credentials, opens nothing of a tenant none of whose callers come to it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fleet.errors import ErrorCode, FleetError
from fleet.revocations import Revocations
from fleet.tenant_keys import MasterSecret, TenantKey
from fleet.tokens import Claims, KeyLookup, TokenVerifier
from policy import PolicyEngine
from registry._records import IdentityRecord

log = logging.getLogger(__name__)

MAX_VERIFIERS = 256  # one per asking service (their number is bounded by what policy lets in)
KEY_TTL_S = 300  # how long a service may keep a released key (at most its caller's token's life)


@dataclass(frozen=True, slots=True)
class Released:
    key: TenantKey
    expires_in: int

    def to_json(self) -> dict[str, object]:
        return {**self.key.to_json(), "expires_in": self.expires_in}


def refused(message: str) -> FleetError:
    return FleetError(ErrorCode.TENANT_KEY_REFUSED, message)


@dataclass(slots=True)
class TenantKeyService:
    """Releases tenant keys derived from ``master`` (see the module's doc)."""

    master: MasterSecret
    keys: KeyLookup  # the registry's own signing keys, by kid
    issuer: str
    revocations: Revocations
    policy: PolicyEngine
    _verifiers: dict[str, TokenVerifier] = field(default_factory=dict)

    def _verifier(self, audience: str) -> TokenVerifier:
        verifier = self._verifiers.get(audience)
        if verifier is None:
            if len(self._verifiers) >= MAX_VERIFIERS:
                self._verifiers.clear()
            verifier = self._verifiers[audience] = TokenVerifier(
                self.keys, issuer=self.issuer, audience=audience, revocations=self.revocations
            )
        return verifier

    async def release(
        self, service: Claims, identity: IdentityRecord | None, caller_token: str, tenant: str
    ) -> Released:
        """The key of the tenant of ``caller_token`` for ``service`` (its verified registry token),
        or a ``tenant_key_refused`` / ``policy_denied`` :class:`FleetError` saying why not."""
        if service.actors or service.raw.get("client_id", service.sub) != service.sub:
            raise refused("a tenant key is asked for in the service's own name, not a delegated one")
        if identity is None:
            raise refused(f"{service.sub} is not enrolled")
        if not caller_token:
            raise refused("a tenant key is given only against a caller's token (caller_token)")
        try:
            caller = await self._verifier(service.sub).verify(caller_token)
        except FleetError as exc:
            raise refused(f"the caller's token is refused: {exc.message}") from exc
        if not caller.tenant or caller.tenant == "*":
            raise refused("the caller's token is for no one tenant")
        if tenant and tenant != caller.tenant:
            raise refused(f"the caller's token is for tenant {caller.tenant!r}, not {tenant!r}")
        await self._check_policy(identity, caller)
        expires_in = max(0, min(KEY_TTL_S, int(caller.expires_at - time.time())))
        log.info(
            "released tenant %s's key (version %s) to %s for caller %s",
            caller.tenant,
            self.master.version,
            service.sub,
            caller.sub,
        )
        return Released(self.master.tenant_key(caller.tenant), expires_in)

    async def _check_policy(self, identity: IdentityRecord, caller: Claims) -> None:
        try:
            decision = await self.policy.decide(
                "fleet.tokens.tenant_key",
                {
                    "client": {"id": identity.id, "kind": identity.kind},
                    "tenant": caller.tenant,
                    "caller": {"sub": caller.sub, "actors": list(caller.actors)},
                },
            )
        except FleetError as exc:
            raise FleetError(
                ErrorCode.POLICY_UNAVAILABLE,
                f"tenant-key policy unavailable: {exc.message}",
                retryable=True,
            ) from exc
        if not decision.allow:
            reasons = "; ".join(decision.reasons) or "no rule allows it"
            raise FleetError(
                ErrorCode.POLICY_DENIED, f"policy refuses: {reasons} (decision {decision.decision_id})"
            )
