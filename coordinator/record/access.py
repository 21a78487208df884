"""Runs are owned: which of its tenant's runs a caller reaches, as the policy ``fleet.runs.access``
decides it (``policy/bundles/fleet/runs.rego``).

A run belongs to the principal that started it: ``runs.owner`` is the subject of the verified token
that created it (for an exchanged token the original subject, e.g. the person the console acts for;
for an outside issuer's token its mapped subject, e.g. ``partner:alice``), in the token's tenant. The
act chain says who acts for the principal; it never makes a run anyone else's.

For each kind of action (:class:`RunAction`) the decision gives a :class:`Reach`: the caller's own
runs (an owner filter), or every run of its tenant (a scope that ``data.config.runs.tenant_reach``
lists for the action, e.g. ``runs:admin``). The stores apply it in their SQL, so a run out of reach
is never loaded, and the caller gets exactly the answer it would get for a run that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fleet.errors import ErrorCode, FleetError
from fleet.tokens import Claims
from policy import PolicyEngine

ACCESS_DECISION = "fleet.runs.access"
ADMIN_SCOPE = "runs:admin"


class RunAction(StrEnum):
    """What a caller does to a run (the ``action`` of ``fleet.runs.access``)."""

    READ = "read"  # tasks, runs, events, streams, signals, operations, debug bundles
    PUSH = "push"  # A2A push-notification configs
    CANCEL = "cancel"  # every cancel path
    ANSWER = "answer"  # approve, reject, input, extend
    RESOLVE = "resolve"  # an operation's verdict, a spent budget's decision


@dataclass(frozen=True, slots=True)
class Reach:
    """The runs a caller reaches: those of ``tenant``, and only ``owner``'s unless it is None."""

    tenant: str
    owner: str | None
    decision_id: str = ""

    @classmethod
    def tenant_wide(cls, tenant: str) -> Reach:
        """Every run of ``tenant``: for the fleet's own processes (workers, dispatchers), never
        for a caller."""
        return cls(tenant, None)


def signal_action(action: str) -> RunAction:
    """The run action of a signal's action (``cancel``, or an answer)."""
    return RunAction.CANCEL if action == "cancel" else RunAction.ANSWER


class RunAccess:
    """Asks ``fleet.runs.access`` for a caller's reach (every decision is logged with its id)."""

    def __init__(self, engine: PolicyEngine) -> None:
        self._engine = engine

    async def reach(self, claims: Claims, action: RunAction) -> Reach:
        """The runs ``claims``' principal reaches for ``action``; ``forbidden`` if policy refuses
        the principal outright (no subject, no single tenant), fail closed on a malformed result."""
        decision = await self._engine.decide(
            ACCESS_DECISION,
            {
                "action": action.value,
                "principal": {
                    "sub": claims.sub,
                    "tenant": claims.tenant,
                    "scopes": sorted(claims.scopes),
                    "actors": list(claims.actors),
                },
            },
        )
        if not decision.allow:
            raise FleetError(ErrorCode.FORBIDDEN, "; ".join(decision.reasons) or "runs are out of reach")
        result = decision.result if isinstance(decision.result, dict) else {}
        if result.get("reach") == "tenant":
            return Reach(claims.tenant, None, decision.decision_id)
        if result.get("reach") == "own" and result.get("owner") == claims.sub:
            return Reach(claims.tenant, claims.sub, decision.decision_id)
        raise FleetError(
            ErrorCode.POLICY_UNAVAILABLE, f"{ACCESS_DECISION} gave no reach this service understands"
        )


__all__ = ["ACCESS_DECISION", "ADMIN_SCOPE", "Reach", "RunAccess", "RunAction", "signal_action"]
