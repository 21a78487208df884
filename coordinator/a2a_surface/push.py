"""Push notifications: configs kept in Postgres, deliveries driven by the run's event log, every
request signed with the coordinator's own key.

Delivery does not ride on the A2A request that started a task: :class:`PushDispatcher` follows the
event log with a cursor per config (``delivered_seq``) and posts each update the fold makes (the same
updates a stream carries, as ``StreamResponse`` bodies). A delivery that fails is retried with
exponential backoff; after ``max_attempts`` consecutive failures the config stops and keeps its last
error. The run never waits for a webhook and never learns of one failing. A restarted coordinator (or
another replica) picks up where the cursor stands, so pushes survive restarts too.

Every push carries a JWT (ES256, the coordinator's key, ``kid`` and ``jku`` in the header) in
``Fleet-Push-Signature``, and in ``Authorization: Bearer`` unless the config brought its own
credentials (those go in ``Authorization``, as A2A requires). Its claims bind it to the webhook
(``aud``), the task, the event and the exact body (``request_body_sha256``); it lives five minutes.

Webhook URLs are screened against SSRF when a config is set: http(s) only, no credentials in the
URL, and the host must resolve to public addresses only (the SDK's
``validate_push_notification_url``) unless it is on the operator's allow-list. Deliveries go through
the guarded client (:mod:`fleet.outbound`, purpose ``webhook``), which screens the address again and
connects to the very address it screened (a name that resolves elsewhere after the check reaches
nothing), reads a bounded answer and ends by a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import urllib.parse
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
from a2a.server.context import ServerCallContext
from a2a.server.tasks import PushNotificationConfigStore
from a2a.server.tasks.push_notification_config_store import normalize_push_notification_config
from a2a.types import Task, TaskPushNotificationConfig
from a2a.utils.errors import InvalidParamsError
from a2a.utils.proto_utils import to_stream_response
from a2a.utils.push_url_validator import validate_push_notification_url
from google.protobuf.json_format import MessageToDict
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from coordinator.a2a_surface.task_events import TaskUpdate
from coordinator.a2a_surface.task_store import PostgresTaskStore
from coordinator.record.access import Reach, RunAccess, RunAction
from coordinator.record.notifier import RunNotifier
from coordinator.record.runs import PostgresRunStore
from fleet.a2a_support import a2a_error, claims_of
from fleet.errors import ErrorCode, FleetError
from fleet.keys import ALGORITHM, SigningKey
from fleet.retry import backoff_s

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "Fleet-Push-Signature"
PUSH_JWT_TTL_S = 300
DELIVERY_TIMEOUT_S = 10.0
BATCH = 20
CLAIM_S = 30.0  # a dispatcher that dies holding a claim delays its configs by at most this
MAX_BACKOFF_S = 60.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS fleet_runs.push_configs (
    task_id          text NOT NULL,
    config_id        text NOT NULL,
    tenant           text NOT NULL,
    url              text NOT NULL,
    token            text NOT NULL DEFAULT '',
    auth_scheme      text NOT NULL DEFAULT '',
    auth_credentials text NOT NULL DEFAULT '',
    delivered_seq    bigint NOT NULL DEFAULT 0,
    attempts         integer NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    claimed_until    timestamptz,
    gave_up          boolean NOT NULL DEFAULT false,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, config_id)
);
-- Who set the config, and whether their reach was the tenant's (fleet.runs.access, action push): a
-- config delivers only a run its setter reaches. Configs from before runs were owned have no
-- principal, and deliver nothing.
ALTER TABLE fleet_runs.push_configs ADD COLUMN IF NOT EXISTS principal text;
ALTER TABLE fleet_runs.push_configs ADD COLUMN IF NOT EXISTS reach_all boolean NOT NULL DEFAULT false;
"""

COALESCE_S = 0.05  # after a wake-up, before the claim: the events committed meanwhile come with it
_CLAIM = """
WITH due AS (
    SELECT c.task_id, c.config_id FROM fleet_runs.push_configs c
    JOIN fleet_runs.runs r ON r.run_id = c.task_id AND r.tenant = c.tenant
     AND (c.reach_all OR r.owner = c.principal)  -- only a run its setter reaches
    JOIN fleet_runs.a2a_tasks t ON t.task_id = c.task_id  -- its context id is recorded
    WHERE r.last_seq > c.delivered_seq AND NOT c.gave_up AND c.next_attempt_at <= now()
      AND (c.claimed_until IS NULL OR c.claimed_until < now())
    ORDER BY c.next_attempt_at LIMIT %s FOR UPDATE OF c SKIP LOCKED
)
UPDATE fleet_runs.push_configs c SET claimed_until = now() + make_interval(secs => %s)
FROM due WHERE c.task_id = due.task_id AND c.config_id = due.config_id
RETURNING c.task_id, c.config_id, c.tenant, c.url, c.token, c.auth_scheme, c.auth_credentials,
          c.delivered_seq, c.attempts
"""


class PushUrlPolicy:
    """Which webhook URLs the coordinator will call (SSRF screening).

    ``allowed_hosts`` (``FLEET_PUSH_ALLOWED_HOSTS``) are hosts, or ``host:port`` pairs, that may be
    private or loopback all the same, e.g. a webhook receiver on the same network."""

    def __init__(self, allowed_hosts: Iterable[str] = ()) -> None:
        self._allowed = {host.strip().lower() for host in allowed_hosts if host.strip()}

    async def check(self, url: str) -> None:
        """Raise ``push_url_refused`` with the reason if ``url`` may not be called."""
        try:
            parsed = urllib.parse.urlsplit(url)
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
        except ValueError:
            raise _refused("the push URL is not a valid URL") from None
        host = (parsed.hostname or "").lower()
        if parsed.scheme not in ("http", "https") or not host:
            raise _refused("the push URL must be an http or https URL with a host")
        if parsed.username is not None or parsed.password is not None:
            raise _refused("the push URL must not carry credentials (use the config's authentication)")
        if host in self._allowed or f"{host}:{port}" in self._allowed:
            return
        if not await validate_push_notification_url(url):
            raise _refused(
                f"push host {host!r} does not resolve to public addresses only (private, loopback, "
                "link-local and other internal addresses are refused unless the operator allows "
                "the host in FLEET_PUSH_ALLOWED_HOSTS)"
            )


def _refused(reason: str) -> FleetError:
    return FleetError(ErrorCode.PUSH_URL_REFUSED, reason)


def _without_credentials(config: TaskPushNotificationConfig) -> TaskPushNotificationConfig:
    """What is shown back to a client: everything but the webhook's credentials."""
    shown = TaskPushNotificationConfig()
    shown.CopyFrom(config)
    if shown.HasField("authentication"):
        shown.authentication.ClearField("credentials")
    return shown


def _shown(task_id: str, row: dict[str, Any]) -> TaskPushNotificationConfig:
    config = TaskPushNotificationConfig(
        id=row["config_id"], task_id=task_id, url=row["url"], token=row["token"]
    )
    if row["auth_scheme"]:
        config.authentication.scheme = row["auth_scheme"]
    return config


class PostgresPushConfigStore(PushNotificationConfigStore):
    """Push configs in ``fleet_runs.push_configs``, scoped in SQL to the caller's tenant and reach
    (``fleet.runs.access``, action ``push``): a principal without the tenant's reach sees, changes
    and deletes only configs it set on tasks it started, and a config delivers only a run its setter
    reaches (the SDK also checks the task first: another principal's task is not found).

    A new config starts at the beginning of the task's log, so its webhook learns everything the task
    did; setting an existing config again changes its target but keeps its cursor."""

    def __init__(self, pool: AsyncConnectionPool[Any], policy: PushUrlPolicy, access: RunAccess) -> None:
        self._pool = pool
        self._policy = policy
        self._access = access

    async def _reach(self, context: ServerCallContext) -> tuple[Reach, str]:
        claims = claims_of(context)
        try:
            return await self._access.reach(claims, RunAction.PUSH), claims.sub
        except FleetError as exc:
            raise a2a_error(exc, InvalidParamsError) from exc

    async def setup(self) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.push_configs.schema'))")
            await conn.execute(SCHEMA)

    async def set_info(
        self, task_id: str, notification_config: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        try:
            await self._policy.check(notification_config.url)
        except FleetError as exc:
            raise a2a_error(exc, InvalidParamsError) from exc
        reach, principal = await self._reach(context)
        config = normalize_push_notification_config(task_id, notification_config)
        auth = config.authentication
        async with self._pool.connection() as conn:
            # A task of someone else's (the SDK finds none first: this is the data layer's own
            # check) gets no config; a new task's config comes before its run, and is the caller's.
            await conn.execute(
                "INSERT INTO fleet_runs.push_configs (task_id, config_id, tenant, url, token, auth_scheme,"
                " auth_credentials, principal, reach_all)"
                " SELECT %s, %s, %s, %s, %s, %s, %s, %s, %s WHERE NOT EXISTS (SELECT 1 FROM fleet_runs.runs r"
                " WHERE r.run_id = %s AND (r.tenant <> %s OR (NOT %s AND r.owner <> %s)))"
                " ON CONFLICT (task_id, config_id) DO UPDATE"
                " SET url = EXCLUDED.url, token = EXCLUDED.token, auth_scheme = EXCLUDED.auth_scheme,"
                " auth_credentials = EXCLUDED.auth_credentials, gave_up = false, attempts = 0,"
                " next_attempt_at = now(), last_error = NULL, principal = EXCLUDED.principal,"
                " reach_all = EXCLUDED.reach_all WHERE push_configs.tenant = EXCLUDED.tenant"
                " AND (EXCLUDED.reach_all OR push_configs.principal = EXCLUDED.principal)",
                (
                    task_id,
                    config.id,
                    reach.tenant,
                    config.url,
                    config.token,
                    auth.scheme,
                    auth.credentials,
                    principal,
                    reach.owner is None,
                    task_id,
                    reach.tenant,
                    reach.owner is None,
                    principal,
                ),
            )
        return _without_credentials(config)

    async def get_info(self, task_id: str, context: ServerCallContext) -> list[TaskPushNotificationConfig]:
        reach, principal = await self._reach(context)
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=dict_row)
            await cursor.execute(
                "SELECT config_id, url, token, auth_scheme FROM fleet_runs.push_configs"
                " WHERE task_id = %s AND tenant = %s AND (%s OR principal = %s)"
                " ORDER BY created_at, config_id",
                (task_id, reach.tenant, reach.owner is None, principal),
            )
            rows = await cursor.fetchall()
        return [_shown(task_id, row) for row in rows]

    async def delete_info(
        self, task_id: str, context: ServerCallContext, config_id: str | None = None
    ) -> None:
        """Idempotent: deleting a config that is gone is not an error."""
        reach, principal = await self._reach(context)
        async with self._pool.connection() as conn:
            await conn.execute(
                "DELETE FROM fleet_runs.push_configs WHERE task_id = %s AND tenant = %s"
                " AND (%s OR principal = %s) AND (%s::text IS NULL OR config_id = %s)",
                (task_id, reach.tenant, reach.owner is None, principal, config_id, config_id),
            )


@dataclass(frozen=True, slots=True)
class _Target:
    task_id: str
    config_id: str
    tenant: str
    url: str
    token: str
    auth_scheme: str
    auth_credentials: str = ""

    def __repr__(self) -> str:  # never show the token or the credentials
        return f"_Target({self.task_id}/{self.config_id})"


class PushSigner:
    """Signs push bodies with the coordinator's key; receivers verify with its JWKS (``jku``)."""

    def __init__(self, key: SigningKey, issuer: str, jwks_url: str) -> None:
        self._key = key
        self._issuer = issuer
        self._jwks_url = jwks_url

    def sign(self, target: _Target, event_id: int, body: bytes) -> str:
        now = int(time.time())
        claims = {
            "iss": self._issuer,
            "aud": target.url,
            "iat": now,
            "exp": now + PUSH_JWT_TTL_S,
            "jti": uuid.uuid4().hex,
            "taskId": target.task_id,
            "configId": target.config_id,
            "eventId": event_id,
            "request_body_sha256": hashlib.sha256(body).hexdigest(),
        }
        headers = {"kid": self._key.kid, "typ": "JWT", "jku": self._jwks_url}
        return jwt.encode(claims, self._key.private_key, algorithm=ALGORITHM, headers=headers)


class PushDispatcher:
    """Delivers every config's pending updates, in order, at least once (see the module docstring).

    Several coordinator replicas can run one each: a config is claimed (``claimed_until``) by one
    dispatcher at a time."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        tasks: PostgresTaskStore,
        runs: PostgresRunStore,
        signer: PushSigner,
        http: httpx.AsyncClient,
        *,
        max_attempts: int = 8,
        poll_s: float = 1.0,
    ) -> None:
        self._pool = pool
        self._tasks = tasks
        self._runs = runs
        self._signer = signer
        self._http = http
        self._max_attempts = max_attempts
        self._poll_s = poll_s

    async def run(self, notifier: RunNotifier) -> None:
        """Deliver until cancelled; wake on new events (of any run, through the process's one
        ``notifier``), and at least every ``poll_s`` for retries. A wake-up waits ``COALESCE_S`` for
        the rest of its burst (a step commits several events at once), so that a burst costs one
        claim, not one per event of every run."""
        with notifier.watch() as wakeup:
            while True:
                try:
                    wakeup.arm()
                    if not await self.deliver_due():
                        await wakeup.wait(self._poll_s)
                        await asyncio.sleep(COALESCE_S)
                except Exception:  # the dispatcher outlives any failure (database down, a bug): log, retry
                    log.exception("push dispatcher failed; retrying")
                    await asyncio.sleep(self._poll_s)

    async def deliver_due(self) -> int:
        """Claim the configs with pending updates and deliver them; return how many were claimed."""
        async with self._pool.connection() as conn:
            cursor = await conn.execute(_CLAIM, (20, CLAIM_S))
            targets = [(_Target(*row[:7]), int(row[7]), int(row[8])) for row in await cursor.fetchall()]
        results = await asyncio.gather(
            *(self._deliver(target, after, attempts) for target, after, attempts in targets),
            return_exceptions=True,
        )
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, Exception):  # its claim lapses and the next round tries again
                log.error("push delivery for task %s failed", target[0].task_id, exc_info=result)
        return len(targets)

    async def _deliver(self, target: _Target, after: int, attempts: int) -> None:
        delivered = after
        deadline = time.monotonic() + CLAIM_S - DELIVERY_TIMEOUT_S - 5.0  # stop well inside the claim
        try:
            fold = await self._tasks.fold(target.task_id, target.tenant, upto=after)
            if fold is None:
                return
            if fold.seq > after:  # the events after the cursor were pruned: send the task as it is now
                await self._post(target, fold.seq, fold.snapshot())
                delivered = fold.seq
            for event in await self._runs.events_after(target.task_id, target.tenant, fold.seq, BATCH):
                if time.monotonic() > deadline:
                    break  # the rest in the next round, under a fresh claim, so no one else overtakes
                update = fold.apply(event)
                if update is not None:
                    await self._post(target, event.seq, update)
                delivered = event.seq
        except _DeliveryFailed as exc:
            await self._record(target, delivered, failure=exc.error, attempts=attempts + 1)
            return
        await self._record(target, delivered)

    async def _post(self, target: _Target, event_id: int, payload: TaskUpdate | Task) -> None:
        body = json.dumps(MessageToDict(to_stream_response(payload)), separators=(",", ":")).encode()
        signature = self._signer.sign(target, event_id, body)
        headers = {"Content-Type": "application/a2a+json", SIGNATURE_HEADER: signature}
        headers["Authorization"] = (
            f"{target.auth_scheme or 'Bearer'} {target.auth_credentials}"
            if target.auth_credentials
            else f"Bearer {signature}"
        )
        if target.token:
            headers["X-A2A-Notification-Token"] = target.token
        try:  # the guarded client screens the address again, the one it connects to (DNS may change)
            response = await self._http.post(
                target.url, content=body, headers=headers, timeout=DELIVERY_TIMEOUT_S
            )
        except FleetError as exc:  # refused, too large, too slow (see fleet.outbound)
            raise _DeliveryFailed(exc) from exc
        except httpx.HTTPError as exc:
            unreached = f"{type(exc).__name__} reaching the webhook"
            raise _DeliveryFailed(
                FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, unreached, retryable=True)
            ) from exc
        if not response.is_success:
            refused = f"the webhook answered {response.status_code}"
            raise _DeliveryFailed(FleetError(ErrorCode.DEPENDENCY_UNAVAILABLE, refused, retryable=True))

    async def _record(
        self, target: _Target, delivered: int, failure: FleetError | None = None, attempts: int = 0
    ) -> None:
        """Move the cursor and release the claim; on a failure, schedule the retry or give up (the
        failure is kept in ``last_error`` as its envelope, JSON)."""
        gave_up = failure is not None and attempts >= self._max_attempts
        backoff = backoff_s(attempts, base_s=2.0, cap_s=MAX_BACKOFF_S)
        if failure is not None:
            host = urllib.parse.urlsplit(target.url).hostname
            log.warning(
                "push to %s for task %s failed (attempt %d%s): %s %s",
                host,
                target.task_id,
                attempts,
                ", giving up" if gave_up else "",
                failure.code,
                failure.message,
            )
        async with self._pool.connection() as conn:
            await conn.execute(
                "UPDATE fleet_runs.push_configs SET delivered_seq = GREATEST(delivered_seq, %s),"
                " attempts = %s, last_error = %s, gave_up = %s, claimed_until = NULL,"
                " next_attempt_at = now() + make_interval(secs => %s)"
                " WHERE task_id = %s AND config_id = %s AND tenant = %s",
                (
                    delivered,
                    attempts,
                    json.dumps(failure.to_dict()) if failure is not None else None,
                    gave_up,
                    backoff if failure is not None else 0,
                    target.task_id,
                    target.config_id,
                    target.tenant,
                ),
            )


class _DeliveryFailed(Exception):
    """One delivery did not get a 2xx answer (or was refused before it was sent): ``error`` says why."""

    def __init__(self, error: FleetError) -> None:
        super().__init__(error.message)
        self.error = error


__all__ = ["SIGNATURE_HEADER", "PostgresPushConfigStore", "PushDispatcher", "PushSigner", "PushUrlPolicy"]
