"""The operator's one-time enrollment tokens: how a service of the stack (or a partner's agent)
gets the right to enroll its key at the registry. The local supervisor and the deployment key
generator both mint them."""

from __future__ import annotations

import secrets
import time

from deploy.local_stack import OPERATOR_ID, ServiceSpec
from fleet.keys import SigningKey

ENROLLMENT_TTL_S = 600


def enrollment_token(operator: SigningKey, spec: ServiceSpec, *, external: bool = False) -> str:
    """A one-time enrollment token: the operator vouches that ``spec.id`` may enroll a key, and
    that its card may offer ``spec.skills`` (``external``: an agent another organisation runs; see
    ``IdentityRecord.external``)."""
    now = int(time.time())
    return operator.sign(
        {
            "iss": OPERATOR_ID,
            "sub": spec.id,
            "aud": "fleet-enrollment",
            "iat": now,
            "exp": now + ENROLLMENT_TTL_S,
            "jti": secrets.token_hex(16),
            "kind": spec.kind,
            "scopes": list(spec.scopes),
            "tenants": list(spec.tenants),
            "skills": list(spec.skills),
            "external": external,
        },
        typ="enrollment+jwt",
    )


__all__ = ["ENROLLMENT_TTL_S", "enrollment_token"]
