"""The policy plane: Rego bundles under ``policy/bundles/`` and the engines that evaluate them.

Every process embeds an engine; when policy cannot be evaluated, callers fail closed.
"""

from policy._bundle import DEFAULT_BUNDLE_DIR, Bundle
from policy.engine import Decision, PolicyEngine
from policy.errors import PolicyError
from policy.regorus_engine import RegorusEngine
from policy.testing import RegoTestResult, run_tests

__all__ = [
    "DEFAULT_BUNDLE_DIR",
    "Bundle",
    "Decision",
    "PolicyEngine",
    "PolicyError",
    "RegoTestResult",
    "RegorusEngine",
    "run_tests",
]
