"""Which skills an agent may offer: the skills on its card against those its identity was given.

The operator names an identity's skills when it mints the enrollment token (``fleet up`` gives each
built-in specialist the skills its module serves; ``fleet keys enrollment-token --skill``), and
policy may grant more, or hold a skill inside the fleet (``fleet.registry.skills``). A card that
claims any other skill is refused when the agent registers (``skill_not_allowed``), quarantined
when a later check finds it (see :mod:`registry._refresh`), and never offered by discovery, which
asks again for every agent it would hand out (a policy change or a new enrollment shows at once).
A card's word is never what makes an agent the one for a skill."""

from __future__ import annotations

import logging

from fleet.errors import ErrorCode, FleetError
from policy import Decision, PolicyEngine
from registry._records import AgentRecord, IdentityRecord

log = logging.getLogger(__name__)

SKILLS_DECISION = "fleet.registry.skills"


class SkillBinding:
    """Asks policy whether an identity may offer the skills its card claims."""

    def __init__(self, policy: PolicyEngine) -> None:
        self._policy = policy

    async def decide(self, identity: IdentityRecord, claimed: list[str]) -> Decision:
        """The decision on ``claimed`` for ``identity`` (``policy_unavailable`` if there is none)."""
        facts = {"id": identity.id, "kind": identity.kind, "external": identity.external}
        return await self._policy.decide(
            SKILLS_DECISION,
            {"identity": facts, "enrolled": sorted(identity.skills), "claimed": sorted(set(claimed))},
        )

    async def check(self, identity: IdentityRecord, record: AgentRecord) -> Decision:
        """Allow ``record``'s card, or raise ``skill_not_allowed`` naming the refused skills, the
        reasons and the decision."""
        decision = await self.decide(identity, [s.id for s in record.skills])
        if not decision.allow:
            refused = ", ".join(str(s) for s in decision.result.get("refused", []))
            raise FleetError(
                ErrorCode.SKILL_NOT_ALLOWED,
                f"the card of {identity.id} claims skills it may not offer ({refused}):"
                f" {'; '.join(decision.reasons)} (decision {decision.decision_id})",
            )
        return decision

    async def offers(self, identity: IdentityRecord | None, skill: str) -> bool:
        """Whether discovery may hand out ``identity``'s agent for ``skill`` now."""
        if identity is None:
            return False
        decision = await self.decide(identity, [skill])
        if not decision.allow:
            log.warning(
                "not offering %s for skill %s: %s (decision %s)",
                identity.id,
                skill,
                "; ".join(decision.reasons),
                decision.decision_id,
            )
        return decision.allow
