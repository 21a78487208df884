"""The policy plane: Rego bundles under ``policy/bundles/`` and the engines that evaluate them.

Every process embeds an engine; when policy cannot be evaluated, callers fail closed. Pushed bundles
are signed (:class:`PolicySigner`) and verified against the operator's key (:class:`PushVerifier`).
"""

from policy._bundle import DEFAULT_BUNDLE_DIR, Bundle
from policy._signing import PolicySigner, PushRefused, PushVerifier, certify_author, public_jwk_from_file
from policy.engine import Decision, PolicyEngine
from policy.errors import PolicyError, PolicyQueryError
from policy.regorus_engine import RegorusEngine
from policy.testing import RegoTestResult, run_tests

__all__ = [
    "DEFAULT_BUNDLE_DIR",
    "Bundle",
    "Decision",
    "PolicyEngine",
    "PolicyError",
    "PolicyQueryError",
    "PolicySigner",
    "PushRefused",
    "PushVerifier",
    "RegoTestResult",
    "RegorusEngine",
    "certify_author",
    "public_jwk_from_file",
    "run_tests",
]
