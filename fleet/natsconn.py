"""The NATS connection every process opens, and get-or-create helpers for KV buckets.

A connection knows how many replicas the streams, KV buckets and object stores it creates get: one
on the embedded single server, three on a three-node cluster (``FLEET_NATS_REPLICAS``). Whoever
creates a stream first sets it; every process of a deployment is given the same number.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import re
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from fleet.errors import ErrorCode, FleetError
from fleet.keys import SigningKey
from fleet.retry import retrying
from fleet.settings import ServiceSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a JetStream call meets while a cluster elects a leader or is slow under load: worth asking again.
TRANSIENT: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
RETRY_S = 0.2


# A server's -ERR that ends the connection because of who it is: nats-py closes the client for good on
# these (it reconnects only after a network error).
_AUTH_ENDED = ("authorization violation", "authentication expired", "authentication timeout")


class FleetConnection(NATS):
    """A NATS connection that carries the replica count of what it creates, and that reconnects
    (with fresh credentials) when a server ends it over its authorization.

    In a cluster that loses a node, every client of that node reconnects at once, the registry's
    own among them, and the registry answers the servers' authorization callouts: a server that
    asks while the callout is itself reconnecting times out and answers ``Authorization
    Violation``. nats-py treats that -ERR as final and closes the client, so the service (the
    registry itself, which then could never answer a callout again) would stay cut off while the
    bus is healthy again a moment later. Here it is a reason to reconnect like any other; a
    connection truly refused keeps being refused, each time logged."""

    def __init__(self, replicas: int) -> None:
        super().__init__()
        self.replicas = replicas

    async def _process_err(self, err_msg: str) -> None:
        if self.options.get("allow_reconnect") and self.is_connected:
            reason = err_msg.strip().strip("'").lower()
            if any(ended in reason for ended in _AUTH_ENDED):
                log.warning(
                    "%s: the bus ended the connection (%s); reconnecting", self.options.get("name"), reason
                )
                await self._process_op_err(nats.errors.AuthorizationError())
                return
        await super()._process_err(err_msg)


BUS_AUDIENCE = "fleet-bus"  # the audience of the assertion a fleet identity connects with
ASSERTION_TTL_S = 60
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def subject_token(value: str) -> str:
    """``value`` as one NATS subject token: itself when it is 1-64 letters, digits, ``-`` and
    ``_``; otherwise ``h`` and a hash of it (no ``.``, ``*``, ``>`` or space can reach a subject)."""
    if _TOKEN.match(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:32]


def inbox_prefix(principal: str) -> str:
    """Where ``principal``'s replies arrive: its own inbox subjects, which nobody else may read."""
    return f"_INBOX.{subject_token(principal)}"


@dataclass(frozen=True, slots=True)
class Credentials:
    """How a connection proves who it is to the bus; one of:

    * a fleet identity and its key: at every connect (and reconnect) a fresh assertion, signed with
      the key and good for a minute, once, and the server's nonce signed with the same key, which
      the registry checks against the identity's enrolled keys;
    * an nkey seed: a producer's (issued by ``fleet producers issue``), or a static user's (the
      bootstrap admin, the registry's own connections).

    ``principal`` names the connection's inbox (see :func:`inbox_prefix`); ``tls_ca``: the CA that
    signed the servers' certificates, when the bus runs TLS."""

    principal: str
    key: SigningKey | None = None
    nkey_seed: str = ""
    tls_ca: Path | None = None

    def assertion(self) -> str:
        """A new single-use assertion of this identity (see the class's doc)."""
        if self.key is None:
            raise FleetError(ErrorCode.INVALID_REQUEST, "these credentials have no key")
        now = int(time.time())
        return self.key.sign(
            {
                "iss": self.principal,
                "sub": self.principal,
                "aud": BUS_AUDIENCE,
                "iat": now,
                "exp": now + ASSERTION_TTL_S,
                "jti": secrets.token_hex(16),
            },
            typ="bus-assertion+jwt",
        )

    def _sign_nonce(self, nonce: str) -> bytes:
        """The server's nonce signed with the identity's key (DER, base64): proof that whoever
        presents the assertion holds the key, on this connection."""
        assert self.key is not None
        signature = self.key.private_key.sign(nonce.encode(), ec.ECDSA(hashes.SHA256()))
        return base64.b64encode(signature)

    def connect_options(self) -> dict[str, Any]:
        """nats-py ``connect`` arguments for these credentials."""
        options: dict[str, Any] = {"inbox_prefix": inbox_prefix(self.principal)}
        if self.key is not None:
            options["token"] = self.assertion
            options["signature_cb"] = self._sign_nonce
        elif self.nkey_seed:
            options["nkeys_seed_str"] = self.nkey_seed
        if self.tls_ca is not None:
            options["tls"] = ssl.create_default_context(cafile=str(self.tls_ca))
        return options


def service_credentials(settings: ServiceSettings) -> Credentials:
    """A service's bus credentials: its identity and key (and the bus's CA, if any)."""
    key = SigningKey.load_or_create(settings.key_file)
    return Credentials(settings.service_id, key=key, tls_ca=settings.tls_ca_file)


def server_urls(url: str) -> list[str]:
    """``FLEET_NATS_URL`` as a list: one URL, or a cluster's seed servers separated by commas."""
    urls = [part.strip() for part in url.split(",") if part.strip()]
    if not urls:
        raise FleetError(ErrorCode.INVALID_REQUEST, "no NATS server URL given")
    return urls


CONNECT_PATIENCE_S = 60.0  # how long a first connection is tried before the caller is told why not


PING_INTERVAL_S = 5  # a silent server is left for another within about 15 s
MAX_OUTSTANDING_PINGS = 3


async def connect(
    url: str,
    name: str,
    *,
    replicas: int = 1,
    credentials: Credentials | None = None,
    patience_s: float = CONNECT_PATIENCE_S,
) -> NATS:
    """Connect to NATS (``url``: one server or a comma-separated list of a cluster's servers).
    The first connection is tried for ``patience_s`` (a server starting, the registry restarting
    while it refuses credentials, each failure logged), then fails with the last reason: no server
    answering, a certificate this side does not trust, or refused credentials (nats-py alone would
    try forever). Once connected it follows the cluster: a node going away, or going silent (a
    partition: no answer to ``MAX_OUTSTANDING_PINGS`` pings ``PING_INTERVAL_S`` apart), moves the
    connection to another, and publishes wait for it; a connection the bus closes (its time is up, see
    :mod:`registry._callout`) comes back with fresh credentials.

    ``replicas``: the replicas of every stream, KV bucket and object store created through this
    connection (1 to 5, at most the cluster's size). ``credentials``: who connects (none: an
    anonymous connection, which only a bus without authentication takes)."""
    if not 1 <= replicas <= 5:
        raise FleetError(ErrorCode.INVALID_REQUEST, f"NATS replicas must be 1 to 5, not {replicas}")
    servers = server_urls(url)
    client = FleetConnection(replicas)
    report = _report_error(name)
    failures: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        if not client.is_connected:
            failures[:] = [exc]  # the reason a first connection is not made yet
        await report(exc)

    try:
        await asyncio.wait_for(
            client.connect(
                servers=servers,
                name=name,
                connect_timeout=5,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                # The order of a cluster's URLs should not decide which node every process lands on.
                dont_randomize=False,
                # A node cut off by a partition answers nothing (no reset): without pings of its own
                # the client would wait nats-py's 2 minutes x 2 before moving to another node.
                ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                error_cb=on_error,
                **(credentials.connect_options() if credentials is not None else {}),
            ),
            patience_s,
        )
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        with contextlib.suppress(Exception):
            await client.close()
        raise _not_connected(url, name, failures[-1] if failures else exc, patience_s) from exc
    return client


def _not_connected(url: str, name: str, cause: BaseException, patience_s: float) -> FleetError:
    text = str(cause) or type(cause).__name__
    if "authorization violation" in text.lower():
        return FleetError(ErrorCode.UNAUTHENTICATED, f"the bus at {url} refused {name}'s credentials")
    if isinstance(cause, ssl.SSLError):
        return FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE,
            f"no TLS connection to NATS at {url}: {text} (is FLEET_TLS_CA_FILE the bus's CA?)",
        )
    return FleetError(
        ErrorCode.DEPENDENCY_UNAVAILABLE,
        f"cannot reach NATS at {url} within {patience_s:g} s: {text}",
        retryable=True,
    )


def _report_error(name: str) -> Callable[[Exception], Awaitable[None]]:
    """The connection's error callback: the bus refusing a publish or subscription outside the
    connection's rights arrives here (not as an exception): it is logged as an error."""

    async def report(exc: Exception) -> None:
        text = str(exc)
        if "permissions violation" in text.lower():
            log.error("%s: the bus refused: %s", name, text)
        else:
            log.warning("%s: NATS: %s", name, text or type(exc).__name__)

    return report


async def patiently(what: str, action: Callable[[], Awaitable[T]], *, patience_s: float = 30.0) -> T:
    """``action`` (a JetStream call), tried again while it fails in a :data:`TRANSIENT` way, for
    up to ``patience_s``; the last failure is raised after that. Only for calls that are safe to
    repeat (a lookup, a create-if-missing, a publish with a message id)."""
    return await retrying(what, action, retry_on=TRANSIENT, patience_s=patience_s, base_s=RETRY_S, cap_s=2.0)


def stream_replicas(endpoints: Mapping[str, Any]) -> int:
    """The replicas a running stack's streams get (its ``endpoints.json``), for a command that may
    be the first to create one."""
    value = endpoints.get("nats_replicas", 1)
    return value if isinstance(value, int) and 1 <= value <= 5 else 1


def replicas(handle: NATS | JetStreamContext) -> int:
    """How many replicas a stream, bucket or object store created through ``handle`` gets."""
    client = handle._nc if isinstance(handle, JetStreamContext) else handle
    return client.replicas if isinstance(client, FleetConnection) else 1


async def key_value(
    client: NATS,
    bucket: str,
    *,
    history: int = 5,
    ttl_s: float | None = None,
) -> KeyValue:
    """The KV bucket ``bucket``, created (file storage) if it does not exist yet."""
    js = client.jetstream()

    async def get_or_create() -> KeyValue:
        try:
            return await js.key_value(bucket)
        except BucketNotFoundError:
            config = KeyValueConfig(
                bucket=bucket, history=history, storage=StorageType.FILE, ttl=ttl_s, replicas=replicas(client)
            )
            return await js.create_key_value(config)

    return await patiently(f"opening KV bucket {bucket}", get_or_create)


# nats-py's ``KeyValue.history`` and ``KeyValue.keys`` read through a watcher that can signal "no
# more entries" before the entries already pushed to it are processed (its consumer reports nothing
# pending while none has been handled yet), and then answer empty on a loaded machine. These two read
# the bucket's stream directly instead: each answer is complete as of the moment it is asked.
_REMOVED = {b"DEL", b"PURGE"}


async def kv_history(bucket: KeyValue, key: str) -> list[tuple[int, bytes]]:
    """Every value ``key`` holds in ``bucket``'s kept history, oldest first: (revision, value).
    Deletions and purges are left out; empty if the key was never written."""
    js = bucket._js
    subject = f"{bucket._pre}{key}"
    kept: list[tuple[int, bytes]] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(bucket._stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return kept
        if not msg.headers or msg.headers.get("KV-Operation", "").encode() not in _REMOVED:
            kept.append((int(msg.seq or 0), msg.data or b""))
        seq = int(msg.seq or seq) + 1


async def kv_keys(bucket: KeyValue) -> list[str]:
    """The keys of ``bucket`` whose latest entry is a value (not a deletion), sorted."""
    info = await bucket._js.stream_info(bucket._stream, subjects_filter=f"{bucket._pre}>")
    keys = []
    for subject in sorted((info.state.subjects or {}).keys()):
        key = subject[len(bucket._pre) :]
        try:
            await bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue
        keys.append(key)
    return keys
