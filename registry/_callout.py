"""The bus's door: NATS asks the registry who every new connection is (an authorization callout),
and the registry answers with exactly the rights that connection's identity has.

A connection presents one of:

* a fleet identity's assertion (``auth_token``): a JWT signed with a key enrolled for that identity,
  addressed to the bus, good for a minute and once, and a signature of the server's nonce made
  with the same key (``sig``), so a copy of the assertion is worth nothing on another connection;
* a producer's nkey (``nkey`` and ``sig``): a key the registry issued credentials for, with a
  tenant, the sources it may publish as, and an expiry (:mod:`registry._producers`).

Anything else, an unknown or revoked key, a replayed assertion, an expired producer: refused, and
the refusal logged. The rights come from policy (``fleet.bus.decision``, :file:`bus.rego`): the
subjects the connection may publish and subscribe to, how many subscriptions it may hold, how large
a message may be. They are written into the user JWT of the answer, which the server enforces; the
registry is not asked again while the connection lives.

Connections do not live for ever: every ``ttl_s`` (policy) the registry closes a connection, and
the client comes back with a fresh credential, checked again; a revoked identity's connections are
closed within a second of the revocation, and it cannot come back.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import jwt
import nats.errors
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from fleet import natsjwt
from fleet.buskeys import FLEET_ACCOUNT
from fleet.errors import FleetError
from fleet.keys import ALGORITHM, public_key_from_jwk
from fleet.natsconn import BUS_AUDIENCE, Credentials, connect, inbox_prefix, subject_token
from fleet.natsjwt import KeyPair
from fleet.revocations import Revocations
from fleet.tokens import MemoryReplayGuard
from policy.engine import PolicyEngine
from registry._records import IdentityRecord, ProducerRecord

log = logging.getLogger(__name__)

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
MAX_ASSERTION_LIFETIME_S = 300
SWEEP_EVERY_S = 15.0
CONNZ_TIMEOUT_S = 1.0
_REFUSED = "refused"

IdentityLookup = Callable[[str], Awaitable[IdentityRecord | None]]
ProducerLookup = Callable[[str], Awaitable[ProducerRecord | None]]
RECORD_FRESH_S = 30.0  # an identity's record is read again after this (or at once for a key it lacks)
RECORD_STALE_S = 600.0  # while the store does not answer (a node failing over), the last one read serves
# The server waits 3 s for an answer (``authorization.timeout``, fleet.buskeys): a read of the store
# waits at most this, so that an answer from the last record read still comes in time. The store is
# reached through the registry's own bus connection, which comes back through this door: a door that
# waited on it would keep its own way back shut.
STORE_WAIT_S = 1.0
# Requests answered at once (each its own task: one that waits on the store holds up no other, the
# registry's own reconnection least of all); one more is refused, and its client comes back (the
# registry's own is never refused for it).
MAX_ANSWERING = 256


class Refused(Exception):
    """A connection the bus does not let in, and why (logged; the client sees only a refusal)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a connection is, as checked."""

    type: str  # identity | producer
    id: str
    kid: str  # the key its credential was checked with (an identity's kid, a producer's nkey)
    kind: str = ""
    tenants: tuple[str, ...] = ()
    scopes: tuple[str, ...] = ()
    external: bool = False
    sources: tuple[str, ...] = ()
    expires_at: float | None = None

    def user_name(self) -> str:
        """A new connection's name, as the server shows it (``authorized_user``): whose, with which
        key (what a revocation looks for), and which connection (what a renewal closes)."""
        return f"{self.owner()}:{self.kid}:{secrets.token_hex(6)}"

    def owner(self) -> str:
        """Whose a connection is, as its user name says (:func:`owner_of`)."""
        return f"{self.type}:{self.id}"

    def policy_input(self) -> dict[str, Any]:
        return {
            "principal": {
                "type": self.type,
                "id": self.id,
                "token": subject_token(self.id),
                "inbox": inbox_prefix(self.id),
                "kind": self.kind,
                "tenants": list(self.tenants),
                "tenant_tokens": [subject_token(t) for t in self.tenants if t != "*"],
                "scopes": list(self.scopes),
                "external": self.external,
                "sources": [subject_token(s) for s in self.sources],
            }
        }


@dataclass(slots=True)
class _Live:
    """What the registry knows of a connection it let in: whom, and until when."""

    principal: Principal
    renew_at: float


@dataclass(slots=True)
class BusAuthority:
    """Answers the bus's authorization requests (see the module's doc)."""

    keys: dict[str, KeyPair]  # callout_issuer, responder, system
    identities: IdentityLookup
    producers: ProducerLookup
    policy: PolicyEngine
    revocations: Revocations
    self_id: str  # the registry's own identity: its rights are fixed here, not by policy
    tls_ca: Any = None
    _responder: NATS | None = None
    _system: NATS | None = None
    _live: dict[str, _Live] = field(default_factory=dict)  # by user name
    # Assertions seen (bound to their connection's nonce already; this is the second lock): in
    # memory, so that a reconnect storm while the store fails over does not wait on it.
    _used: MemoryReplayGuard = field(default_factory=MemoryReplayGuard)
    _records: dict[str, tuple[IdentityRecord, float]] = field(default_factory=dict)
    _sweeper: asyncio.Task[None] | None = None
    _answering: set[asyncio.Task[None]] = field(default_factory=set)
    # One principal's connections are let in one at a time (its count of connections is exact);
    # the lock of each owner with requests under way, and how many.
    _admitting: dict[str, tuple[asyncio.Lock, int]] = field(default_factory=dict)
    refused: int = 0
    admitted: int = 0

    async def start(self, url: str) -> None:
        """Connect as the callout responder and as the system user, and answer from now on."""
        self._responder = await connect(
            url, "registry-callout", credentials=self._static("responder", "registry-callout")
        )
        self._system = await connect(
            url, "registry-system", credentials=self._static("system", "registry-system")
        )
        await self._responder.subscribe(AUTH_SUBJECT, cb=self._receive)
        self.revocations.on_revoke(lambda revoked: self._schedule_close(kid=revoked.kid))
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="bus-sweeper")

    def _static(self, name: str, principal: str) -> Credentials:
        return Credentials(principal, nkey_seed=self.keys[name].seed, tls_ca=self.tls_ca)

    async def stop(self) -> None:
        for task in (self._sweeper, *self._answering):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in (self._responder, self._system):
            if client is None:
                continue
            with contextlib.suppress(Exception):
                await client.drain()
            if not client.is_closed:  # a drain that failed leaves the connection open
                with contextlib.suppress(Exception):
                    await client.close()

    # ------------------------------------------------------------------ answering
    async def _receive(self, msg: Msg) -> None:
        """Answer ``msg`` in a task of its own (the subscription hands its messages over one at a
        time), or refuse it at once when ``MAX_ANSWERING`` are being answered."""
        busy = len(self._answering) >= MAX_ANSWERING
        task = asyncio.get_running_loop().create_task(self._answer(msg, busy=busy), name="bus-door")
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, msg: Msg, *, busy: bool = False) -> None:
        issuer = self.keys["callout_issuer"]
        try:
            request = natsjwt.decode(msg.data.decode())
            server = request["nats"]["server_id"]["id"]
            user_nkey = request["nats"]["user_nkey"]
            if request["iss"] != server or request.get("sub") != issuer.public_key:
                raise Refused("an authorization request not from a server of this bus")
        except (natsjwt.NkeyError, KeyError, TypeError, UnicodeDecodeError, Refused) as exc:
            log.warning("ignoring an unreadable authorization request: %s", exc)
            return
        answer: dict[str, Any] = {"type": "authorization_response", "version": 2}
        try:
            try:
                if busy and not self._claims_to_be_itself(request["nats"]):
                    raise Refused(f"{MAX_ANSWERING} connections are being let in already; come back")
                principal = await self.authenticate(request["nats"])
                answer["jwt"] = await self._user_jwt(principal, user_nkey)
                self.admitted += 1
            except (Refused, asyncio.CancelledError):
                raise
            except Exception as exc:  # the store or the policy failing: nobody is let in unchecked
                log.warning("bus authorization failed, refusing", exc_info=True)
                raise Refused(f"could not be checked ({type(exc).__name__})") from exc
        except Refused as exc:
            self.refused += 1
            info = request["nats"].get("client_info", {})
            log.warning(
                "bus connection refused (%s from %s, name %r): %s",
                info.get("kind", "client"),
                info.get("host"),
                info.get("name"),
                exc,
            )
            answer["error"] = _REFUSED
        response = natsjwt.encode({"sub": user_nkey, "aud": server, "nats": answer}, issuer)
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(response.encode())

    def _claims_to_be_itself(self, request: dict[str, Any]) -> bool:
        """Whether the request's assertion names the registry's own identity (unverified). Its
        connection is never held up by the cap: its checks read no store, so they never wait, and
        a flood of others must not keep the registry's way back to its store shut. A false claim is
        checked, and refused, as any other."""
        token = str((request.get("connect_opts") or {}).get("auth_token") or "")
        try:
            return bool(jwt.decode(token, options={"verify_signature": False}).get("iss") == self.self_id)
        except jwt.PyJWTError:
            return False

    async def authenticate(self, request: dict[str, Any]) -> Principal:
        """Who presents ``request``'s credentials; :class:`Refused` if nobody we let in."""
        options = request.get("connect_opts") or {}
        nonce = str((request.get("client_info") or {}).get("nonce") or "")
        signature = str(options.get("sig") or "")
        if options.get("auth_token"):
            return await self._identity(str(options["auth_token"]), nonce, signature)
        if options.get("nkey"):
            return await self._producer(str(options["nkey"]), nonce, signature)
        raise Refused("no credentials")

    async def _identity(self, assertion: str, nonce: str, signature: str) -> Principal:
        try:
            header = jwt.get_unverified_header(assertion)
            claimed = jwt.decode(assertion, options={"verify_signature": False}).get("iss")
        except jwt.PyJWTError as exc:
            raise Refused("the token is not an assertion") from exc
        if header.get("typ") != "bus-assertion+jwt" or not isinstance(claimed, str):
            raise Refused("the token is not a bus assertion")
        kid = str(header.get("kid", ""))
        identity = await self._record(claimed, kid)
        jwk = identity.usable_keys(time.time()).get(kid) if identity is not None else None
        if identity is None or jwk is None:
            raise Refused(f"{claimed!r} has no enrolled key {kid!r}")
        if claimed != self.self_id and self._revoked(kid):
            raise Refused(f"key {kid} of {claimed} is revoked")
        key = public_key_from_jwk(jwk)
        try:
            claims = jwt.decode(
                assertion,
                key,
                algorithms=[ALGORITHM],
                audience=BUS_AUDIENCE,
                issuer=claimed,
                leeway=10,
                options={"require": ["exp", "iat", "jti", "iss", "aud", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise Refused(f"{claimed}'s assertion does not verify: {type(exc).__name__}") from exc
        if claims["sub"] != claimed or int(claims["exp"]) - int(claims["iat"]) > MAX_ASSERTION_LIFETIME_S:
            raise Refused(f"{claimed}'s assertion is not one to connect with")
        if not nonce or not _es256_signed(key, nonce, signature):  # the fleet's servers always send one
            raise Refused(f"{claimed} did not sign the server's nonce")
        if not await self._used.first_use(f"{claimed}.{claims['jti']}", float(claims["exp"]) + 10):
            raise Refused(f"{claimed}'s assertion was already used")
        return Principal(
            type="identity",
            id=identity.id,
            kid=kid,
            kind=identity.kind,
            tenants=tuple(identity.tenants),
            scopes=tuple(identity.scopes),
            external=identity.external,
        )

    async def _record(self, identity_id: str, kid: str) -> IdentityRecord | None:
        """``identity_id``'s record: read again when older than ``RECORD_FRESH_S`` or without
        ``kid`` (a new key); the last one read while the store does not answer (failing over), for
        up to ``RECORD_STALE_S``. A revoked key is refused whatever the record says."""
        cached = self._records.get(identity_id)
        now = time.monotonic()
        if cached is not None and now - cached[1] < RECORD_FRESH_S and kid in cached[0].keys:
            return cached[0]
        try:
            record = await asyncio.wait_for(self.identities(identity_id), STORE_WAIT_S)
        except Exception:
            if cached is not None and now - cached[1] < RECORD_STALE_S:
                log.warning(
                    "the registry's store did not answer; %s's record of %.0f s ago serves",
                    identity_id,
                    now - cached[1],
                )
                return cached[0]
            raise
        if record is None:
            self._records.pop(identity_id, None)
        else:
            self._records[identity_id] = (record, now)
        return record

    async def _producer(self, nkey: str, nonce: str, signature: str) -> Principal:
        record = await asyncio.wait_for(self.producers(nkey), STORE_WAIT_S)
        if record is None or record.revoked:
            raise Refused(f"no producer holds nkey {nkey[:12]}...")
        if record.expires_at <= time.time():
            raise Refused(f"producer {record.id}'s credentials expired")
        if self._revoked(nkey):
            raise Refused(f"producer {record.id}'s key is revoked")
        if not nonce or not natsjwt.verify(nkey, nonce.encode(), _b64(signature)):
            raise Refused(f"producer {record.id} did not sign the server's nonce")
        return Principal(
            type="producer",
            id=record.id,
            kid=nkey,
            kind="producer",
            tenants=(record.tenant,),
            sources=tuple(record.sources),
            expires_at=record.expires_at,
        )

    def _revoked(self, kid: str) -> bool:
        try:
            return self.revocations.check(kid) is not None
        except FleetError as exc:  # the list is not loaded yet: nobody is believed unrevoked
            raise Refused("the list of revoked keys is not loaded yet") from exc

    async def _rights(self, principal: Principal) -> dict[str, Any]:
        if principal.type == "identity" and principal.id == self.self_id:
            return registry_rights(principal)
        try:
            decision = await self.policy.decide("fleet.bus.decision", principal.policy_input())
        except FleetError as exc:
            raise Refused(f"the bus policy cannot be evaluated: {exc.message}") from exc
        if not decision.allow:
            raise Refused(f"policy: {'; '.join(decision.reasons) or 'not allowed'}")
        return decision.result if isinstance(decision.result, dict) else {}

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, owner: str) -> AsyncIterator[None]:
        lock, waiting = self._admitting.get(owner, (asyncio.Lock(), 0))
        self._admitting[owner] = (lock, waiting + 1)
        try:
            async with lock:
                yield
        finally:
            lock, waiting = self._admitting[owner]
            if waiting == 1:
                del self._admitting[owner]
            else:
                self._admitting[owner] = (lock, waiting - 1)

    async def _user_jwt(self, principal: Principal, user_nkey: str) -> str:
        async with self._one_at_a_time(principal.owner()):
            return await self._admit(principal, user_nkey)

    async def _admit(self, principal: Principal, user_nkey: str) -> str:
        result = await self._rights(principal)
        await self._within_connections(principal, int(result.get("connections", -1)))
        ttl_s = float(result.get("ttl_s", 3600))
        renew_at = time.time() + ttl_s
        if principal.expires_at is not None:
            renew_at = min(renew_at, principal.expires_at)
        name = principal.user_name()
        self._live[name] = _Live(principal, renew_at)
        permissions = {
            "pub": {"allow": list(result.get("pub_allow", [])), "deny": list(result.get("pub_deny", []))},
            "sub": {"allow": list(result.get("sub_allow", [])), "deny": list(result.get("sub_deny", []))},
            "subs": int(result.get("subs", -1)),
            "data": -1,
            "payload": int(result.get("payload", -1)),
            "type": "user",
            "version": 2,
        }
        claims = {"sub": user_nkey, "aud": FLEET_ACCOUNT, "name": name, "nats": permissions}
        return natsjwt.encode(claims, self.keys["callout_issuer"])

    async def _within_connections(self, principal: Principal, limit: int) -> None:
        """Refuse a connection beyond the ``limit`` (policy's ``bus.limits.connections``) that one
        principal may hold open at once. The connections this registry let in are counted first; when
        they reach the limit, the bus is asked (CONNZ, every server), which also counts those other
        registry replicas let in and forgets the ones that have closed since."""
        if limit < 0:
            return
        whose = principal.owner()
        mine = [name for name in self._live if owner_of(name) == whose]
        if len(mine) < limit:
            return
        open_now = {
            name
            for _, connection in await self._connections()
            if owner_of(name := str(connection.get("authorized_user") or "")) == whose
        }
        for name in mine:
            if name not in open_now:
                del self._live[name]
        if len(open_now) >= limit:
            raise Refused(
                f"{principal.type} {principal.id} has {len(open_now)} connections open, the most allowed"
            )

    # ------------------------------------------------------------------ closing connections
    def _schedule_close(self, *, kid: str) -> None:
        # Not its own: the registry's connection is the bus's authority (a revoked key of its own is
        # an old signing key after a rotation, which it no longer signs tokens with).
        mine = f"identity:{self.self_id}:"
        task = asyncio.get_running_loop().create_task(
            self.close_connections(lambda name: f":{kid}:" in name and not name.startswith(mine))
        )
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def close_connections(self, matches: Callable[[str], bool]) -> int:
        """Close every connection whose user name ``matches`` (on every server of the bus); how
        many were closed."""
        closed = 0
        for server, connection in await self._connections():
            name = str(connection.get("authorized_user") or "")
            if name and matches(name):
                closed += await self._kick(server, int(connection["cid"]), name)
        return closed

    async def _connections(self) -> list[tuple[str, dict[str, Any]]]:
        """(server id, connection) of every client connection on every server, as CONNZ says."""
        assert self._system is not None
        inbox = self._system.new_inbox()
        replies: asyncio.Queue[Msg] = asyncio.Queue()
        subscription = await self._system.subscribe(inbox, cb=replies.put)
        try:
            await self._system.publish(
                "$SYS.REQ.SERVER.PING.CONNZ",
                json.dumps({"auth": True, "limit": 100_000, "acc": FLEET_ACCOUNT}).encode(),
                reply=inbox,
            )
            found: list[tuple[str, dict[str, Any]]] = []
            deadline = time.monotonic() + CONNZ_TIMEOUT_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    reply = await asyncio.wait_for(replies.get(), left)
                except TimeoutError:
                    break
                body = json.loads(reply.data)
                server = body.get("server", {}).get("id", "")
                found += [(server, c) for c in (body.get("data", {}).get("connections") or [])]
            return found
        finally:
            await subscription.unsubscribe()

    async def _kick(self, server: str, cid: int, name: str) -> int:
        assert self._system is not None
        try:
            reply = await self._system.request(
                f"$SYS.REQ.SERVER.{server}.KICK", json.dumps({"cid": cid}).encode(), timeout=CONNZ_TIMEOUT_S
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not close bus connection %s of %s: %s", cid, name, exc)
            return 0
        if json.loads(reply.data or b"{}").get("error"):
            return 0
        log.warning("closed bus connection %s of %s", cid, name)
        return 1

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                await self.sweep()
            except Exception:
                log.warning("the bus sweep failed", exc_info=True)

    async def sweep(self) -> int:
        """Close the connections whose time is up (they come back with fresh credentials, or not
        at all if their credentials no longer hold)."""
        now = time.time()
        due = {name for name, live in self._live.items() if live.renew_at <= now}
        if not due:
            return 0
        closed = await self.close_connections(lambda name: name in due)
        for name in due:
            self._live.pop(name, None)
        return closed


def owner_of(user_name: str) -> str:
    """``type:id`` of a connection's user name ``type:id:kid:random`` (an id may hold a colon; a kid
    and the random part do not)."""
    return user_name.rsplit(":", 2)[0]


def registry_rights(principal: Principal) -> dict[str, Any]:
    """The registry's own rights on the bus. They are fixed here rather than in policy: policy
    cannot lock the bus's authority out of the records it keeps, nor give it more."""
    me = subject_token(principal.id)
    buckets = ("fleet-registry", "fleet-nonces", "fleet-revocations")
    publish = {
        "$JS.API.STREAM.NAMES",
        f"fleet.decisions.{me}",
        "$JS.API.STREAM.INFO.FLEET_DECISIONS",
        f"fleet.metrics.{me}",
        "$JS.API.STREAM.INFO.FLEET_METRICS",
        "$JS.API.CONSUMER.CREATE.KV_fleet-revocations",
        "$JS.FC.KV_fleet-revocations.>",
        "$JS.API.STREAM.INFO.KV_fleet-policy",
        "$JS.API.STREAM.MSG.GET.KV_fleet-policy",
        "$JS.API.CONSUMER.CREATE.KV_fleet-policy",
        "$JS.FC.KV_fleet-policy.>",
        "$JS.API.STREAM.INFO.KV_fleet-policy-status",
        f"$KV.fleet-policy-status.{me}",
    }
    for bucket in buckets:
        publish |= {
            f"$JS.API.STREAM.INFO.KV_{bucket}",
            f"$JS.API.STREAM.MSG.GET.KV_{bucket}",
            f"$KV.{bucket}.>",
        }
    return {
        "pub_allow": sorted(publish),
        "sub_allow": [f"{inbox_prefix(principal.id)}.>"],
        "subs": 1000,
        "payload": 8 * 1024 * 1024,
        "ttl_s": 24 * 3600,
    }


def _b64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        try:
            return base64.b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            return b""


def _es256_signed(key: ec.EllipticCurvePublicKey, nonce: str, signature: str) -> bool:
    """Whether ``signature`` (DER, base64) is ``key``'s over the nonce."""
    try:
        key.verify(_b64(signature), nonce.encode(), ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True
