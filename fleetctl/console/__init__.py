"""The operator console (see :mod:`fleetctl.console._server`); ``fleet up`` runs it as ``console``."""

from fleetctl.console._server import build_app, main
from fleetctl.console._session import COOKIE, SIGN_IN_SCOPES

__all__ = ["COOKIE", "SIGN_IN_SCOPES", "build_app", "main"]
