"""The operator console (see :mod:`fleet.console._server`); ``fleet up`` runs it as ``console``."""

from fleet.console._server import build_app, main
from fleet.console._session import COOKIE, SIGN_IN_SCOPES

__all__ = ["COOKIE", "SIGN_IN_SCOPES", "build_app", "main"]
