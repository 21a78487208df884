"""Errors of the policy plane. When policy cannot be evaluated, callers fail closed."""

from fleet.errors import ErrorCode, FleetError


class PolicyError(FleetError):
    """The bundle cannot be loaded or a decision cannot be evaluated."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.POLICY_UNAVAILABLE, message, retryable=True)


class PolicyQueryError(FleetError):
    """A query that does not parse: the asker's mistake, not the policy's (``policy_query_invalid``)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.POLICY_QUERY_INVALID, message)
