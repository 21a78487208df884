"""Token verification (used by every service) and token acquisition (client credentials with
``private_key_jwt``, RFC 7523).

Verification is deliberately strict: an explicit algorithm allow-list, required claims, one audience,
a small leeway, and keys looked up by ``kid`` in the issuer's JWKS (cached for the JWKS's
``max-age``; an unknown ``kid`` triggers one rate-limited refetch so that key rotation is picked up).
A token signed by a revoked key, or issued to a client on a revoked key (``client_kid``), is refused
as soon as the revocation reaches the process (:mod:`fleet.revocations`). Where a token must be used
once, a :class:`ReplayGuard` refuses its ``jti`` the second time. Every refusal is logged (why, the
key id, the audience, the claimed subject: never the token).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import jwt
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from jwt.algorithms import RSAAlgorithm

from fleet.approvals import APPROVAL_GRANT_TYPE, ApprovalBinding
from fleet.errors import AuthError, DependencyUnavailable, ErrorCode, FleetError
from fleet.keys import ALGORITHM, SigningKey, public_key_from_jwk
from fleet.retry import retrying
from fleet.revocations import Revocations
from fleet.settings import ExternalIssuer

log = logging.getLogger(__name__)

ALLOWED_ALGORITHMS = (ALGORITHM,)
REQUIRED_CLAIMS = ("exp", "iat", "iss", "aud", "sub", "jti", "tenant")
DEFAULT_LEEWAY_S = 10
ACCESS_TOKEN_TTL_S = 300
REUSE_FOR_S = 60  # a client reuses a token this long at most (see TokenClient)
MAX_CACHED_TOKENS = 1024
VERIFIED_MEMO_SIZE = 4096  # tokens a verifier remembers having checked the signature of
CLIENT_ASSERTION_TYPE = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer"
TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"  # RFC 8693
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
RUN_GRANT_TYPE = "urn:fleet:params:oauth:token-type:run-grant"  # see registry._token_service
SESSION_GRANT_TYPE = "urn:fleet:params:oauth:token-type:session-grant"  # the console's; ditto
SIGNAL_GRANT_TYPE = "urn:fleet:params:oauth:token-type:signal-grant"  # one NATS signal's; ditto
GRANT_TYPS = {  # typ -> token_use: none of them is an access token
    "run-grant+jwt": "run_grant",
    "session-grant+jwt": "session_grant",
    "signal-grant+jwt": "signal_grant",
    "approval-grant+jwt": "approval_grant",  # one gated tool call's (fleet.approvals)
}
EXCHANGEABLE_GRANTS = ("run_grant", "session_grant")  # what the token service takes as a subject


@dataclass(frozen=True, slots=True)
class Claims:
    """The verified claims of an access token."""

    sub: str
    tenant: str
    audience: str
    scopes: frozenset[str]
    jti: str
    expires_at: int
    raw: dict[str, Any] = field(repr=False)
    # The verified token itself: what this service passes on in a token exchange (RFC 8693) to act
    # for the same principal at the next hop. Never logged, never stored outside memory.
    token: str = field(default="", repr=False, compare=False)

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes

    @property
    def run_id(self) -> str:
        """The coordinator run the token was issued for (its ``run_id`` claim), "" for a token
        outside a run."""
        return str(self.raw.get("run_id") or "")

    @property
    def actors(self) -> tuple[str, ...]:
        """Who acts for ``sub``, the current actor first (RFC 8693 ``act``); empty for a token in the
        client's own name."""
        chain: list[str] = []
        act = self.raw.get("act")
        while isinstance(act, dict) and len(chain) < 16:
            chain.append(str(act.get("sub", "")))
            act = act.get("act")
        return tuple(chain)


PublicKey = ec.EllipticCurvePublicKey | rsa.RSAPublicKey
KeyLookup = Callable[[str], Awaitable[PublicKey | None]]
KeyParser = Callable[[dict[str, Any]], PublicKey]
MIN_RSA_BITS = 2048


def any_public_key(jwk: dict[str, Any]) -> PublicKey:
    """An EC P-256 or an RSA (at least 2048-bit) public key from a JWK: what outside issuers use."""
    if jwk.get("kty") == "RSA":
        key = RSAAlgorithm.from_jwk(json.dumps({k: jwk[k] for k in ("kty", "n", "e")}))
        if not isinstance(key, rsa.RSAPublicKey) or key.key_size < MIN_RSA_BITS:
            raise ValueError("an RSA JWK must be a public key of at least 2048 bits")
        return key
    return public_key_from_jwk(jwk)


_MAX_AGE = re.compile(r"max-age=(\d+)")


UNKNOWN_KID_S = 5.0  # a kid a fetch did not find is refused without another fetch this long
MAX_UNKNOWN_KIDS = 4096


class JwksCache:
    """Public keys of one issuer, fetched from its JWKS URL and cached by ``kid``: for the
    document's ``max-age`` (so a key the issuer retired stops being trusted), refetched at once
    (rate-limited) for an unknown ``kid`` (so a new key is picked up), and forgotten at once when
    revoked (:meth:`forget`). A ``kid`` that a fetch made after it was first presented did not find
    is refused for ``UNKNOWN_KID_S`` without another fetch (unless a fetch finds it meanwhile);
    requests with unknown kids wait for their turn outside the lock, so they never hold up a
    request that needs the lock to refresh stale keys."""

    def __init__(
        self,
        jwks_url: str,
        http: httpx.AsyncClient,
        *,
        min_refresh_interval_s: float = 1.0,
        default_max_age_s: float = 60.0,
        parse: KeyParser = public_key_from_jwk,
    ) -> None:
        """``parse``: how a JWK becomes a key (the fleet's own: EC P-256 only); one it refuses is
        left out."""
        self._url = jwks_url
        self._http = http
        self._parse = parse
        self._keys: dict[str, PublicKey] = {}
        self._last_fetch = 0.0
        self._fresh_until = 0.0
        self._min_refresh = min_refresh_interval_s
        self._default_max_age = default_max_age_s
        self._forgotten: set[str] = set()
        self._unknown: dict[str, float] = {}  # kid -> refused without a fetch until (monotonic)
        self._lock = asyncio.Lock()

    async def get(self, kid: str) -> PublicKey | None:
        if kid in self._forgotten:
            return None
        arrived = time.monotonic()
        key = self._keys.get(kid)
        if key is not None and arrived < self._fresh_until:
            return key
        if key is None and arrived < self._fresh_until:
            if self._unknown.get(kid, 0.0) > arrived:
                return None
            # An unknown key may be one the issuer has just published (a rotation): look once
            # more, at most once per ``min_refresh_interval_s``, waiting for the turn (without the
            # lock) rather than refusing a good token.
            pause = self._min_refresh - (arrived - self._last_fetch)
            if pause > 0:
                await asyncio.sleep(pause)
        async with self._lock:
            # Another caller fetched (or tried) while this one waited: use that.
            if self._last_fetch < arrived:
                stale = time.monotonic() >= self._fresh_until
                if stale or kid not in self._keys:
                    try:
                        await self._refresh()
                    except FleetError:
                        # The issuer is unreachable: keep what it published, and ask again only
                        # after the refetch interval (not once per request).
                        self._fresh_until = time.monotonic() + self._min_refresh
                        if kid not in self._keys:
                            raise
                        log.warning("JWKS %s unreachable; using the keys fetched before", self._url)
            if kid not in self._keys and self._last_fetch >= arrived:
                if len(self._unknown) >= MAX_UNKNOWN_KIDS:
                    self._unknown.clear()
                self._unknown[kid] = time.monotonic() + UNKNOWN_KID_S
        return None if kid in self._forgotten else self._keys.get(kid)

    def forget(self, kid: str) -> None:
        """Never trust ``kid`` again (it was revoked), whatever the issuer's JWKS still says."""
        self._forgotten.add(kid)
        self._keys.pop(kid, None)

    async def _refresh(self) -> None:
        self._last_fetch = time.monotonic()
        try:
            response = await self._http.get(self._url, timeout=5.0)
            response.raise_for_status()
            document = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise FleetError(
                ErrorCode.DEPENDENCY_UNAVAILABLE, "cannot fetch the issuer's JWKS", retryable=True
            ) from exc
        keys: dict[str, PublicKey] = {}
        for jwk in document.get("keys", []):
            try:
                keys[jwk["kid"]] = self._parse(jwk)
            except (KeyError, ValueError):
                continue
        self._keys = keys
        self._unknown = {kid: until for kid, until in self._unknown.items() if kid not in keys}
        found = _MAX_AGE.search(response.headers.get("cache-control", ""))
        max_age = float(found.group(1)) if found else self._default_max_age
        self._fresh_until = time.monotonic() + max_age


class ReplayGuard(Protocol):
    """Remembers the ``jti``s of single-use tokens until they expire."""

    async def first_use(self, jti: str, expires_at: float) -> bool:
        """True the first time ``jti`` is presented, False ever after (until it expires)."""
        ...


class MemoryReplayGuard:
    """A :class:`ReplayGuard` for one process (a service that is its tokens' only verifier)."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    async def first_use(self, jti: str, expires_at: float) -> bool:
        now = time.time()
        if len(self._seen) > 10_000:
            self._seen = {k: exp for k, exp in self._seen.items() if exp > now}
        if jti in self._seen and self._seen[jti] > now:
            return False
        self._seen[jti] = expires_at
        return True


@dataclass(frozen=True, slots=True)
class _Verified:
    """A token whose signature, issuer, audience and claims checked out once."""

    claims: Claims
    kids: tuple[str, ...]  # its signing key, its client's key and its chain's: checked every time
    expires_at: float


class TokenVerifier:
    """Verifies access tokens issued by one issuer for one audience.

    Every request's token is verified; a token this verifier has verified before (the very same
    bytes) skips only the signature and the parse of its claims, which cannot have changed: its
    expiry, the revocation of every key it involves and the scopes asked for are checked again each
    time. A single-use verifier remembers nothing (the replay guard must see every use)."""

    def __init__(
        self,
        keys: KeyLookup,
        *,
        issuer: str,
        audience: str,
        leeway_s: int = DEFAULT_LEEWAY_S,
        revocations: Revocations | None = None,
        single_use: ReplayGuard | None = None,
        run_grants: bool = False,
        grant: str | None = None,
    ) -> None:
        """``run_grants``: accept grants too (the coordinator's run grants and the console's session
        grants: the token service does, as the subject of an exchange); every other verifier refuses
        them, as they are no access tokens. ``grant``: verify this kind of grant (a ``token_use``,
        e.g. ``signal_grant``) and nothing else, access tokens included."""
        self._run_grants = run_grants
        self._grant = grant
        self._keys = keys
        self._issuer = issuer
        self._audience = audience
        self._leeway = leeway_s
        self._revocations = revocations
        self._single_use = single_use
        self._memo: OrderedDict[str, _Verified] | None = OrderedDict() if single_use is None else None

    @property
    def audience(self) -> str:
        return self._audience

    @property
    def issuer(self) -> str:
        return self._issuer

    async def verify(self, token: str, *, required_scopes: Iterable[str] = ()) -> Claims:
        """Return the token's claims, or raise :class:`AuthError` (never returns a partial result).
        Every refusal is logged."""
        try:
            return await self._verify(token, required_scopes)
        except FleetError as exc:
            _log_refusal(token, self._audience, exc)
            raise

    async def _verify(self, token: str, required_scopes: Iterable[str]) -> Claims:
        memo = self._memo
        seen = memo.get(token) if memo is not None else None
        if seen is not None and memo is not None:
            revoked = self._revocations is not None and self._revocations.check(*seen.kids)
            if not revoked and time.time() <= seen.expires_at + self._leeway:
                memo.move_to_end(token)
                return _with_scopes(seen.claims, required_scopes)
            del memo[token]  # the full check below says why it no longer passes
        header, kid = _header_of(token, ALLOWED_ALGORITHMS)
        if self._grant is not None:
            if GRANT_TYPS.get(str(header.get("typ"))) != self._grant:
                raise AuthError(f"not a {self._grant.replace('_', ' ')}")
        elif header.get("typ") in GRANT_TYPS and not self._run_grants:
            raise AuthError(f"a {GRANT_TYPS[header['typ']].replace('_', ' ')} is not an access token")
        if self._revocations is not None and self._revocations.check(kid):
            raise AuthError("token signed by a revoked key")
        key = await self._keys(kid)
        if key is None:
            raise AuthError("token signed by an unknown key")
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise AuthError("token algorithm does not match its key")
        raw = decode_es256(token, key, self._audience, self._issuer, self._leeway, REQUIRED_CLAIMS, header)
        use = raw.get("token_use", "access")
        if self._grant is not None and use != self._grant:
            raise AuthError(f"not a {self._grant.replace('_', ' ')}")
        if self._grant is None and use != "access" and not (self._run_grants and use in EXCHANGEABLE_GRANTS):
            raise AuthError("not an access token")
        claims = _claims_of(raw, self._audience, token)
        # the client's key, and every key of the chain that passed the caller's token down
        chain = raw.get("chain_kids")
        listed: list[Any] = chain if isinstance(chain, list) else []
        kids = [k for k in (raw.get("client_kid"), *listed) if isinstance(k, str)]
        if self._revocations is not None and self._revocations.check(*kids):
            raise AuthError("token issued to a client whose key was revoked")
        if self._single_use is not None and not await self._single_use.first_use(
            claims.jti, claims.expires_at
        ):
            raise AuthError("token was already used")
        if self._memo is not None:
            self._memo[token] = _Verified(claims, (kid, *kids), float(claims.expires_at))
            if len(self._memo) > VERIFIED_MEMO_SIZE:
                self._memo.popitem(last=False)
        return _with_scopes(claims, required_scopes)


def _with_scopes(claims: Claims, required_scopes: Iterable[str]) -> Claims:
    missing = [s for s in required_scopes if s not in claims.scopes]
    if missing:
        raise FleetError(ErrorCode.FORBIDDEN, f"token lacks scope {' '.join(missing)}")
    return claims


def peek(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and the claims of a compact JWS, **unverified**: only to choose how to verify it
    (which key, which issuer), never to trust. ``AuthError`` if it is not three parts of base64url
    JSON objects. (PyJWT's own unverified reads check the alphabet in Python, a character at a
    time; the verified decode that follows checks everything again.)"""
    parts = token.split(".")
    if len(parts) != 3:
        raise AuthError("malformed token")
    return _json_object(parts[0], "malformed token"), _json_object(parts[1], "malformed token")


def _json_object(part: str, refusal: str) -> dict[str, Any]:
    """A base64url segment that holds a JSON object, or :class:`AuthError` (``refusal``)."""
    try:
        value = json.loads(_segment(part))
    except (ValueError, AuthError) as exc:
        raise AuthError(refusal) from exc
    if not isinstance(value, dict):
        raise AuthError(refusal)
    return value


def _header_of(token: str, algorithms: Collection[str]) -> tuple[dict[str, Any], str]:
    """The token's header (unverified) and key id, or :class:`AuthError` (malformed, an algorithm
    not in ``algorithms``, no key id)."""
    if token.count(".") != 2:
        raise AuthError("malformed token")
    header = _json_object(token.split(".", 1)[0], "malformed token")
    if header.get("alg") not in algorithms:
        raise AuthError("token algorithm not allowed")
    kid = header.get("kid")
    if not isinstance(kid, str):
        raise AuthError("token has no key id")
    return header, kid


_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
_SIGNATURE_HASH = ec.ECDSA(hashes.SHA256())


def _segment(part: str) -> bytes:
    """A base64url segment of a compact JWS, strictly: the URL-safe alphabet and no padding."""
    if not _BASE64URL.fullmatch(part):
        raise AuthError("invalid token: DecodeError")
    try:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except ValueError as exc:
        raise AuthError("invalid token: DecodeError") from exc


def decode_es256(
    token: str,
    key: ec.EllipticCurvePublicKey,
    audience: str | tuple[str, ...],
    issuer: str,
    leeway: int,
    required: Iterable[str],
    header: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The verified claims of an ES256 compact JWS signed by ``key`` (the fleet's own tokens), or
    :class:`AuthError` saying which check failed. The same checks as PyJWT's ``jwt.decode`` with
    ``algorithms=["ES256"]`` and these options, in the same order (signature; then required
    claims, ``iat``, ``nbf``, ``exp``, ``iss``, ``aud``, ``sub``, ``jti``), done directly with
    ``cryptography``: PyJWT checks each segment's alphabet in Python, a character at a time, which
    costs more than the signature. ``tests/unit/test_tokens.py`` holds the two to the same answers.
    ``header``: the token's header, if the caller has read it already (it is signed over as sent).
    ``audience``: the audience the token must name, or several of which it must name one."""
    claims = _verified_claims(token, key, header)
    for claim in required:
        if claims.get(claim) is None:
            raise AuthError(f"token lacks the {claim} claim")
    times = _times(claims)
    now = time.time()
    if times.get("iat", 0) > now + leeway or times.get("nbf", 0) > now + leeway:
        raise AuthError("token not valid yet")
    if "exp" in times and times["exp"] <= now - leeway:
        raise AuthError("token expired")
    if claims.get("iss") != issuer:
        raise AuthError("token from another issuer")
    _check_audience(claims.get("aud"), audience)
    if "sub" in claims and not isinstance(claims["sub"], str):
        raise AuthError("invalid token: InvalidSubjectError")
    if "jti" in claims and not isinstance(claims["jti"], str):
        raise AuthError("invalid token: InvalidJTIError")
    return claims


def _verified_claims(
    token: str, key: ec.EllipticCurvePublicKey, header: dict[str, Any] | None
) -> dict[str, Any]:
    """The claims of ``token`` once its ES256 signature by ``key`` verifies (no claim is checked yet)."""
    parts = token.split(".")
    if len(parts) != 3:
        raise AuthError("malformed token")
    header_part, claims_part, signature_part = parts
    if header is None:
        header = _json_object(header_part, "invalid token: DecodeError")
    claims = _json_object(claims_part, "invalid token: DecodeError")
    if header.get("alg") != ALGORITHM or "crit" in header or "b64" in header:
        raise AuthError("token algorithm not allowed")
    signature = _segment(signature_part)
    if len(signature) != 64:
        raise AuthError("token signature does not verify")
    der = encode_dss_signature(int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big"))
    try:
        key.verify(der, f"{header_part}.{claims_part}".encode("ascii"), _SIGNATURE_HASH)
    except InvalidSignature as exc:
        raise AuthError("token signature does not verify") from exc
    return claims


def _times(claims: dict[str, Any]) -> dict[str, int]:
    """``iat``, ``nbf`` and ``exp`` of ``claims``, those it has, as integers (PyJWT's checks)."""
    times: dict[str, int] = {}
    for claim in ("iat", "nbf", "exp"):
        if claim in claims:
            value = claims[claim]
            try:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(claim)
                times[claim] = int(value)  # JSON's Infinity and NaN do not convert
            except (ValueError, OverflowError) as exc:
                raise AuthError(f"invalid token: the {claim} claim is not a number") from exc
    return times


def _check_audience(named: Any, audience: str | tuple[str, ...]) -> None:
    audiences = [named] if isinstance(named, str) else named
    if not isinstance(audiences, list) or not all(isinstance(a, str) for a in audiences) or not audiences:
        raise AuthError("token lacks the aud claim" if not named else "token is not meant for this service")
    if not any(wanted in audiences for wanted in ((audience,) if isinstance(audience, str) else audience)):
        raise AuthError("token is not meant for this service")


def _decode(
    token: str,
    key: PublicKey,
    algorithms: list[str],
    audience: str,
    issuer: str,
    leeway: int,
    required: Iterable[str],
) -> dict[str, Any]:
    """The verified claims, or :class:`AuthError` saying which check failed."""
    try:
        raw: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=algorithms,
            audience=audience,
            issuer=issuer,
            leeway=leeway,
            options={"require": list(required)},
        )
    except jwt.ExpiredSignatureError as exc:
        raise AuthError("token expired") from exc
    except jwt.ImmatureSignatureError as exc:
        raise AuthError("token not valid yet") from exc
    except jwt.InvalidAudienceError as exc:
        raise AuthError("token is not meant for this service") from exc
    except jwt.InvalidIssuerError as exc:
        raise AuthError("token from another issuer") from exc
    except jwt.MissingRequiredClaimError as exc:
        raise AuthError(f"token lacks the {exc.claim} claim") from exc
    except jwt.InvalidSignatureError as exc:
        raise AuthError("token signature does not verify") from exc
    except jwt.PyJWTError as exc:
        raise AuthError(f"invalid token: {type(exc).__name__}") from exc
    return raw


class BearerVerifier(Protocol):
    """What verifies the bearer tokens of a service (:class:`TokenVerifier` and its kin)."""

    async def verify(self, token: str, *, required_scopes: Iterable[str] = ()) -> Claims: ...


EXTERNAL_ALGORITHMS = ("ES256", "RS256")
EXTERNAL_REQUIRED_CLAIMS = ("exp", "iat", "iss", "aud", "sub")


class ExternalTokenVerifier:
    """Verifies access tokens of one :class:`~fleet.settings.ExternalIssuer` and maps them into the
    fleet: the caller is ``NAME:SUB`` in the issuer's tenant with its scopes. Nothing else of the
    token is taken (a ``tenant``, ``act`` or ``run_id`` it carries means nothing here). Tokens
    that live longer than ``max_lifetime_s`` are refused: an outside token is a bearer credential
    the fleet cannot revoke."""

    def __init__(
        self,
        issuer: ExternalIssuer,
        http: httpx.AsyncClient,
        *,
        revocations: Revocations | None = None,
        leeway_s: int = DEFAULT_LEEWAY_S,
    ) -> None:
        self.issuer = issuer
        self._jwks = JwksCache(issuer.jwks_url, http, parse=any_public_key)
        self._revocations = revocations
        self._leeway = leeway_s
        self._algorithms = [a for a in issuer.algorithms if a in EXTERNAL_ALGORITHMS]

    async def verify(self, token: str, *, required_scopes: Iterable[str] = ()) -> Claims:
        try:
            return await self._verify(token, required_scopes)
        except FleetError as exc:
            _log_refusal(token, self.issuer.audience, exc)
            raise

    async def _verify(self, token: str, required_scopes: Iterable[str]) -> Claims:
        header, kid = _header_of(token, self._algorithms)
        alg = str(header["alg"])
        if self._revocations is not None and self._revocations.check(kid):
            raise AuthError("token signed by a revoked key")
        key = await self._jwks.get(kid)
        if key is None:
            raise AuthError("token signed by an unknown key")
        if (alg == "ES256") != isinstance(key, ec.EllipticCurvePublicKey):
            raise AuthError("token algorithm does not match its key")
        issuer = self.issuer
        raw = _decode(
            token, key, [str(alg)], issuer.audience, issuer.issuer, self._leeway, EXTERNAL_REQUIRED_CLAIMS
        )
        if int(raw["exp"]) - int(raw["iat"]) > issuer.max_lifetime_s:
            raise AuthError(f"token lives longer than {issuer.max_lifetime_s} s")
        principal = issuer.principal(str(raw["sub"]))
        scopes = frozenset(issuer.scopes)
        jti = str(raw.get("jti") or hashlib.sha256(token.encode()).hexdigest()[:32])
        mapped = {
            "iss": raw["iss"],
            "sub": principal,
            "tenant": issuer.tenant,
            "scope": " ".join(sorted(scopes)),
            "exp": int(raw["exp"]),
            "jti": jti,
            "ext_issuer": issuer.name,
            "ext_kid": kid,
        }
        missing = [s for s in required_scopes if s not in scopes]
        if missing:
            raise FleetError(ErrorCode.FORBIDDEN, f"token lacks scope {' '.join(missing)}")
        return Claims(principal, issuer.tenant, issuer.audience, scopes, jti, int(raw["exp"]), mapped, token)


class FederatedVerifier:
    """The fleet's own tokens, and those of the configured outside issuers (each to its own
    verifier, chosen by the token's ``iss``; any other issuer is the fleet's verifier's to refuse)."""

    def __init__(self, own: TokenVerifier, external: Iterable[ExternalTokenVerifier]) -> None:
        self._own = own
        self._external = {v.issuer.issuer: v for v in external}

    async def verify(self, token: str, *, required_scopes: Iterable[str] = ()) -> Claims:
        try:
            issuer = peek(token)[1].get("iss")
        except AuthError:
            issuer = None
        if isinstance(issuer, str) and issuer in self._external:
            return await self._external[issuer].verify(token, required_scopes=required_scopes)
        if isinstance(issuer, str) and issuer != self._own.issuer:
            refused = AuthError("token from another issuer (not one this service trusts)")
            _log_refusal(token, self._own.audience, refused)
            raise refused
        return await self._own.verify(token, required_scopes=required_scopes)


def _log_refusal(token: str, audience: str, exc: FleetError) -> None:
    """Log why a token was refused, with what identifies it (never the token itself)."""
    try:
        kid = jwt.get_unverified_header(token).get("kid")
        unverified = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError:
        kid, unverified = None, {}
    log.warning(
        "token refused (%s) at %s: %s; kid=%r sub=%r iss=%r jti=%r",
        exc.code,
        audience,
        exc.message,
        kid,
        unverified.get("sub"),
        unverified.get("iss"),
        unverified.get("jti"),
    )


def _claims_of(raw: dict[str, Any], audience: str, token: str) -> Claims:
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise AuthError("token carries no tenant")
    scope = raw.get("scope", "")
    return Claims(
        sub=str(raw["sub"]),
        tenant=tenant,
        audience=audience,
        scopes=frozenset(scope.split()) if isinstance(scope, str) else frozenset(),
        jti=str(raw["jti"]),
        expires_at=int(raw["exp"]),
        raw=raw,
        token=token,
    )


def bearer_token(authorization: str | None) -> str:
    """The token of an ``Authorization: Bearer ...`` header, or :class:`AuthError`."""
    if not authorization:
        raise AuthError("missing bearer token")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("authorization is not a bearer token")
    return token.strip()


def client_assertion(key: SigningKey, client_id: str, token_url: str) -> str:
    """An RFC 7523 client assertion: a one-minute, single-use JWT signed by the client's own key.

    Its audience is the token endpoint's URL, so an assertion sent to a lookalike endpoint cannot be
    redeemed at the real one."""
    now = int(time.time())
    return key.sign(
        {
            "iss": client_id,
            "sub": client_id,
            "aud": token_url,
            "iat": now,
            "exp": now + 60,
            "jti": uuid.uuid4().hex,
        }
    )


@dataclass(frozen=True, slots=True)
class _Cached:
    token: str
    use_until: float


# A token service failing over (a NATS node lost under the registry's store) answers again within
# seconds (longer on a loaded machine); a service's request waits that long rather than failing the work
# it is for.
FAILOVER_PATIENCE_S = 30.0
FAILOVER_RETRY_S = 0.25


class TokenClient:
    """Gets access tokens from the registry's token endpoint and reuses each for at most
    ``REUSE_FOR_S`` (and never in its last 30 seconds): a token this service passes on leaves the
    next hop most of its life to act with it (exchange it in turn). One instance per identity (the
    service's own key)."""

    def __init__(
        self,
        *,
        token_url: str,
        client_id: str,
        key: SigningKey,
        http: httpx.AsyncClient,
        failover_patience_s: float = FAILOVER_PATIENCE_S,
        control_plane: bool = True,
    ) -> None:
        """``failover_patience_s``: how long a request keeps asking while the token service cannot
        answer (it or its store failing over); 0 for a person's command, which should say so now.
        ``control_plane``: the endpoint is the fleet's own token service. One outside the fleet (an
        outside agent's) is never waited for: it failing is that agent being unavailable."""
        self._token_url = token_url
        self._client_id = client_id
        self._key = key
        self._http = http
        self._patience_s = failover_patience_s if control_plane else 0.0
        self._control_plane = control_plane
        self._cache: dict[tuple[str, str, str], _Cached] = {}

    def use_key(self, key: SigningKey) -> None:
        """Authenticate with ``key`` from now on (after a rotation); cached tokens stay valid."""
        self._key = key

    def discard(self, token: str) -> None:
        """Stop reusing ``token`` (a service refused it: it was revoked, or its key rotated away)."""
        self._cache = {k: c for k, c in self._cache.items() if c.token != token}

    async def token(
        self, audience: str, tenant: str, scopes: Iterable[str] = (), *, resource: str = "", run_id: str = ""
    ) -> str:
        """A client-credentials token for ``audience``, ``tenant`` and ``scopes`` (and the RFC 8707
        ``resource``, for a token endpoint outside the fleet that wants one; ``run_id``: the run a
        worker calls for, which the token then names)."""
        scope = " ".join(sorted(set(scopes)))
        cache_key = (f"{audience}|{run_id}" if run_id else audience, tenant, scope)
        form = {"grant_type": "client_credentials", "audience": audience, "tenant": tenant, "scope": scope}
        if resource:
            form["resource"] = resource
        if run_id:
            form["run_id"] = run_id
        return await self._request(cache_key, form)

    async def _request(
        self, cache_key: tuple[str, str, str], form: dict[str, str], *, cache: bool = True
    ) -> str:
        """The token cached under ``cache_key`` until shortly before it expires, or a new one from
        the token endpoint for ``form`` (with this client's assertion). ``cache=False``: always a
        new one, never kept (a single-use grant)."""
        cached = self._cache.get(cache_key) if cache else None
        if cached is not None and cached.use_until > time.time():
            return cached.token
        if not cache:
            cache_key = (f"once|{uuid.uuid4().hex}", "", "")

        async def once() -> str:
            token = await self._request_once(cache_key, form)
            if not cache:
                self._cache.pop(cache_key, None)
            return token

        return await retrying(
            "token request",
            once,
            retry_on=(DependencyUnavailable,),
            patience_s=self._patience_s,
            base_s=FAILOVER_RETRY_S,
            cap_s=2.0,
        )

    async def _request_once(self, cache_key: tuple[str, str, str], form: dict[str, str]) -> str:
        form = {
            **form,
            "client_assertion_type": CLIENT_ASSERTION_TYPE,
            # a new assertion each try: its jti is single-use
            "client_assertion": client_assertion(self._key, self._client_id, self._token_url),
        }
        try:
            response = await self._http.post(self._token_url, data=form, timeout=10.0)
        except httpx.TransportError as exc:
            if not self._control_plane:
                raise FleetError(
                    ErrorCode.SPECIALIST_UNAVAILABLE,
                    f"cannot reach the token endpoint {self._token_url}: {type(exc).__name__}",
                    retryable=True,
                ) from exc
            raise DependencyUnavailable(
                f"cannot reach the registry's token endpoint: {type(exc).__name__}"
            ) from exc
        if response.status_code != 200:
            error = _token_error(response)
            if isinstance(error, DependencyUnavailable) and not self._control_plane:
                raise FleetError(ErrorCode.SPECIALIST_UNAVAILABLE, error.message, retryable=True)
            raise error
        body = response.json()
        token = str(body["access_token"])
        now = time.time()
        expires_in = float(body.get("expires_in", 60))
        if len(self._cache) >= MAX_CACHED_TOKENS:  # exchanged tokens: one per subject; drop the stale
            self._cache = {k: c for k, c in self._cache.items() if c.use_until > now}
        self._cache[cache_key] = _Cached(token, now + min(REUSE_FOR_S, expires_in - 30))
        return token

    async def exchange(
        self,
        subject_token: str,
        audience: str = "",
        scopes: Iterable[str] = (),
        *,
        subject_type: str = ACCESS_TOKEN_TYPE,
        requested_type: str = ACCESS_TOKEN_TYPE,
        run_id: str = "",
    ) -> str:
        """A token for the next hop in the name of whoever ``subject_token`` names (RFC 8693 token
        exchange; this client becomes the current actor of the ``act`` chain). With
        ``requested_type=RUN_GRANT_TYPE`` (the coordinator, when a run is created): the run grant
        for ``run_id``. Exchanged tokens are cached per subject token, audience and scopes."""
        scope = " ".join(sorted(set(scopes)))
        # keyed by the subject token's signature (its tail): another subject, another cache entry
        cache_key = (f"{subject_token[-43:]}|{requested_type}|{run_id}|{audience}", "", scope)
        form = {
            "grant_type": TOKEN_EXCHANGE,
            "subject_token": subject_token,
            "subject_token_type": subject_type,
            "requested_token_type": requested_type,
            "scope": scope,
        }
        if audience:
            form["audience"] = audience
        if run_id:
            form["run_id"] = run_id
        return await self._request(cache_key, form)

    async def signal_grant(
        self, audience: str, tenant: str, signal: SignalBinding, scopes: Iterable[str] = ("runs:approve",)
    ) -> str:
        """A single-use grant for one signal in this client's own name (see
        ``registry._token_service``): good only for the exact signal ``signal`` describes, for a
        few minutes."""
        scope = " ".join(sorted(set(scopes)))
        form = {
            "grant_type": "client_credentials",
            "requested_token_type": SIGNAL_GRANT_TYPE,
            "audience": audience,
            "tenant": tenant,
            "scope": scope,
            "run_id": signal.run_id,
            **signal.form(),
        }
        cache_key = (
            f"signal|{audience}|{signal.run_id}|{signal.signal_id}|{signal.body_sha256}",
            tenant,
            scope,
        )
        return await self._request(cache_key, form)

    async def approval_grant(
        self,
        binding: ApprovalBinding,
        tenant: str,
        *,
        approver_token: str = "",
        approver_type: str = "",
        facts: dict[str, Any] | None = None,
    ) -> str:
        """A single-use approval grant for the one tool call ``binding`` describes (see
        :mod:`fleet.approvals`), never cached. With ``approver_token`` (the coordinator, when a
        person approved): exchanged for that token, whose verified subject is the approver
        (``approver_type``: an access token's or a signal grant's token type). Without: a grant
        that policy approved, in this client's name (the coordinator and its workers only), on
        ``facts`` (what the run computed), which the token service puts to policy again."""
        form = {
            "requested_token_type": APPROVAL_GRANT_TYPE,
            "audience": binding.server,
            "tenant": tenant,
            **binding.form(),
        }
        if approver_token:
            form.update(
                grant_type=TOKEN_EXCHANGE,
                subject_token=approver_token,
                subject_token_type=approver_type or ACCESS_TOKEN_TYPE,
            )
        else:
            form.update(grant_type="client_credentials", approval_facts=json.dumps(facts or {}))
        return await self._request(("", "", ""), form, cache=False)


@dataclass(frozen=True, slots=True)
class SignalBinding:
    """What a signal grant is bound to: one run, one action, one signal id (the nonce) and the
    SHA-256 (hex) of the exact message body."""

    run_id: str
    action: str
    signal_id: str
    body_sha256: str

    @classmethod
    def of(cls, run_id: str, action: str, signal_id: str, body: bytes) -> SignalBinding:
        return cls(run_id, action, signal_id, hashlib.sha256(body).hexdigest())

    def form(self) -> dict[str, str]:
        """The token request's fields for it (``run_id`` aside)."""
        return {"signal_action": self.action, "signal_id": self.signal_id, "signal_sha256": self.body_sha256}

    def claim(self) -> dict[str, str]:
        """The grant's ``signal`` claim."""
        return {"action": self.action, "id": self.signal_id, "sha256": self.body_sha256}


def _token_error(response: httpx.Response) -> FleetError:
    """The error a token request was refused with. An RFC 6749 answer (``{"error": "invalid_client",
    "error_description": ...}``) is a refusal (``forbidden``; 429: ``rate_limited``, the tenant's
    own rate), its OAuth code kept in ``details["oauth_error"]``. The registry's own errors (problem
    details) read as they are: its store failing over is ``dependency_unavailable``, which is waited
    out, while a policy that cannot be evaluated fails closed. A proxy's 502-504 is
    ``dependency_unavailable`` too."""
    status = response.status_code
    retry = response.headers.get("Retry-After", "")
    retry_after_s = int(retry) if retry.isdigit() else None
    try:
        body = response.json()
    except ValueError:
        body = None
    oauth = body.get("error") if isinstance(body, dict) else None
    if not isinstance(oauth, str):
        error = FleetError.from_response(response).within(f"token request refused ({status})")
        if status in (502, 503, 504) and error.code == ErrorCode.DEPENDENCY_UNAVAILABLE:
            return DependencyUnavailable(error.message)  # the registry's store, or a proxy, failing over
        if error.retry_after_s is None and retry_after_s is not None:
            error.retry_after_s = retry_after_s
        return error
    assert isinstance(body, dict)
    message = f"token request refused ({status}): {str(body.get('error_description', ''))[:300]}"
    details = {"oauth_error": oauth[:100]}
    if status == 429:
        return FleetError(
            ErrorCode.RATE_LIMITED, message, retryable=True, retry_after_s=retry_after_s, details=details
        )
    code = ErrorCode.FORBIDDEN if status in (400, 401, 403) else ErrorCode.DEPENDENCY_UNAVAILABLE
    return FleetError(code, message, details=details)
