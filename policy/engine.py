"""The policy engine interface and the decision it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Decision:
    """One evaluated decision: the rule's full result, and the conventional allow/reasons."""

    decision_id: str
    query: str
    revision: str
    allow: bool
    reasons: tuple[str, ...]
    result: Any = field(repr=False)
    latency_us: int = 0


class PolicyEngine(Protocol):
    """Evaluates ``data.<path>`` of the loaded bundle for an input document."""

    @property
    def revision(self) -> str: ...

    async def decide(
        self, path: str, input_document: dict[str, Any], *, log_decision: bool = True
    ) -> Decision:
        """Evaluate the rule at ``path`` (e.g. ``fleet.tools.decision``); fail closed on errors.
        ``log_decision``: log it (False when the caller records the decision itself, e.g. in an
        audit event)."""
        ...
