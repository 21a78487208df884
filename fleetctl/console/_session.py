"""Who is signed in to the console, and the tokens the console acts with in their name.

A person signs in with a link that ``fleet console`` prints: an access token addressed to the
console, in the link's fragment (a fragment never reaches a server log or a ``Referer``). The page
posts it once to ``/session``; the console checks it (single use: a link opened twice signs in
once), exchanges it at the token service for a **session grant** and keeps that in an ``HttpOnly``,
``SameSite=Strict`` cookie. For every backend call the console exchanges the grant for a token
addressed to that backend, in the person's name (``sub``, tenant) with the console as the acting
party (``act``), carrying no scope the person did not sign in with. A copy of the grant is worth
nothing at any other service (only the console's own key can redeem it); at the console it is the
session until it expires, the person signs out (its id is then kept in ``SIGNED_OUT_BUCKET`` until
it would have expired, and refused by every replica), or a key of its chain is revoked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue
from starlette.requests import Request
from starlette.responses import Response

from fleet.errors import AuthError, ErrorCode, FleetError
from fleet.natsconn import key_value
from fleet.revocations import Revocations
from fleet.tokens import (
    SESSION_GRANT_TYPE,
    Claims,
    KeyLookup,
    MemoryReplayGuard,
    TokenClient,
    TokenVerifier,
    bearer_token,
)

COOKIE = "fleet_console"
# What the console asks a sign-in for: reading runs and agents, answering and cancelling runs, and
# (runs:admin) reaching every run of the tenant, not only those the person started. A person signed
# in without runs:admin sees and acts on their own runs only.
SIGN_IN_SCOPES = ("agent:invoke", "runs:approve", "runs:resolve", "registry:read", "runs:admin")
SIGNED_OUT_BUCKET = "fleet-console-signouts"
SIGNED_OUT_KEPT_S = 9 * 3600.0  # longer than a session grant lives (8 hours)


@dataclass(frozen=True, slots=True)
class Person:
    """The signed-in person: their claims, and the session grant the cookie carries."""

    claims: Claims
    grant: str

    @property
    def expires_at(self) -> int:
        return self.claims.expires_at


class SignOuts:
    """The sessions ended by signing out before their grant expired, by the grant's ``jti``."""

    def __init__(self) -> None:
        self._bucket: KeyValue | None = None

    async def open(self, client: NATS) -> None:
        self._bucket = await key_value(client, SIGNED_OUT_BUCKET, history=1, ttl_s=SIGNED_OUT_KEPT_S)

    async def add(self, jti: str) -> None:
        await self._kv().put(jti, b"signed out")

    async def contains(self, jti: str) -> bool:
        try:
            await self._kv().get(jti)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        return True

    def _kv(self) -> KeyValue:
        if self._bucket is None:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "the console is still starting", retryable=True
            )
        return self._bucket


class Sessions:
    """Sign-in, and the person behind each request."""

    def __init__(
        self,
        *,
        tokens: TokenClient,
        login_verifier: TokenVerifier,
        grant_verifier: TokenVerifier,
        secure_cookie: bool,
        signed_out: SignOuts,
    ) -> None:
        self._signed_out = signed_out
        self._tokens = tokens
        self._login = login_verifier
        self._grants = grant_verifier
        self._secure = secure_cookie

    @staticmethod
    def verifiers(
        keys: KeyLookup, *, issuer: str, console_id: str, revocations: Revocations
    ) -> tuple[TokenVerifier, TokenVerifier]:
        """The sign-in verifier (single use) and the session-grant verifier, for ``console_id``."""
        login = TokenVerifier(
            keys, issuer=issuer, audience=console_id, revocations=revocations, single_use=MemoryReplayGuard()
        )
        grants = TokenVerifier(
            keys, issuer=issuer, audience=console_id, revocations=revocations, run_grants=True
        )
        return login, grants

    async def sign_in(self, request: Request) -> Person:
        """The session that the sign-in token of ``request`` opens (the token works once)."""
        token = bearer_token(request.headers.get("authorization"))
        await self._login.verify(token)
        grant = await self._tokens.exchange(token, requested_type=SESSION_GRANT_TYPE)
        return Person(await self._grants.verify(grant), grant)

    def keep(self, response: Response, person: Person) -> None:
        """Set the session cookie for ``person`` on ``response``: script cannot read it, and no
        other site's page can make the browser send it."""
        response.set_cookie(
            COOKIE,
            person.grant,
            max_age=max(0, person.expires_at - int(time.time())),
            httponly=True,
            samesite="strict",
            secure=self._secure,
            path="/",
        )

    async def person(self, request: Request) -> Person:
        """The person signed in on ``request``; ``unauthenticated`` if nobody is (or the session
        ended: expired, or a key of its chain revoked)."""
        grant = request.cookies.get(COOKIE)
        if not grant:
            raise AuthError("not signed in: open a sign-in link from `fleet console`")
        try:
            claims = await self._grants.verify(grant)
        except FleetError as exc:
            raise AuthError(f"the session ended ({exc.message}): sign in again") from exc
        if claims.raw.get("token_use") != "session_grant":
            raise AuthError("not a console session")
        if await self._signed_out.contains(claims.jti):
            raise AuthError("signed out: sign in again")
        return Person(claims, grant)

    async def token_for(self, person: Person, audience: str, scopes: tuple[str, ...]) -> str:
        """A token addressed to ``audience`` in ``person``'s name (cached by the token client)."""
        wanted = tuple(s for s in scopes if s in person.claims.scopes)
        if not wanted:
            raise FleetError(ErrorCode.FORBIDDEN, f"the session was signed in without {' '.join(scopes)}")
        return await self._tokens.exchange(person.grant, audience, wanted, subject_type=SESSION_GRANT_TYPE)

    async def sign_out(self, request: Request, response: Response) -> None:
        """End the session of ``request`` for good (not only in this browser), and drop the cookie."""
        try:
            person = await self.person(request)
        except AuthError:
            person = None  # nobody (or nobody any more) is signed in
        if person is not None:
            await self._signed_out.add(person.claims.jti)
        response.delete_cookie(COOKIE, path="/")
