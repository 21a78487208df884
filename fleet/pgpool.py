"""Postgres connection pools that survive their server's restart, and the error a lost connection is.

When Postgres restarts (an operator's restart, a failover, a crash), every connection a pool keeps
idle is dead, and the pool does not know: psycopg finds out only when it next uses one. Left alone,
each dead connection is handed out once and fails the request that got it, so one restart becomes a
trickle of failures for as long as the pool's idle connections last (seen across hosts: runs failed
a minute after a restart, from a tool server's pool). :func:`pool` checks each connection as it is
handed out, for free: a connection at rest has nothing to read, so one whose socket is readable has
been told something by the server (a restart's ``FATAL: terminating connection``, then EOF) and is
thrown away for another. No query is sent, so the check costs no round trip.

A connection lost in the middle of a request is the other half: :func:`connection_lost` says whether
an error is that (the server went away, not the statement was wrong), and :func:`db_failure` turns
it into ``dependency_unavailable``, retryable, so that the caller sends the request again rather
than treating it as the request's own failure.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from fleet.errors import ErrorCode, FleetError

# SQLSTATE classes and codes of a server that went away or is not taking connections: connection
# exceptions (08), operator intervention (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot
# connect now), too many connections (53300).
_LOST_CLASSES = ("08",)
_LOST_CODES = frozenset({"57P01", "57P02", "57P03", "53300"})


async def at_rest_and_alive(conn: psycopg.AsyncConnection[Any]) -> None:
    """The pool's ``check``: raise if ``conn``, at rest, has been told something by its server or is
    closed. It is closed first: the pool discards a closed connection and makes another (one that
    is merely refused would be put back and handed out again)."""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    waiting = select.poll()  # not select(): a busy process has descriptors past its 1024 limit
    waiting.register(conn.pgconn.socket, select.POLLIN)
    if waiting.poll(0):
        await conn.close()
        raise psycopg.OperationalError("the server spoke to a connection at rest: it is going away")


def pool(conninfo: str, **options: Any) -> AsyncConnectionPool[Any]:
    """An :class:`AsyncConnectionPool` (``options`` as psycopg_pool takes them; not opened unless
    ``open=True``) that never hands out a connection its server has dropped."""
    options.setdefault("open", False)
    return AsyncConnectionPool(conninfo, check=at_rest_and_alive, **options)


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the server went away (or will not take connections now) rather than
    that the statement failed."""
    if not isinstance(exc, psycopg.Error):
        return False
    sqlstate = getattr(exc, "sqlstate", None) or ""
    if sqlstate in _LOST_CODES or sqlstate.startswith(_LOST_CLASSES):
        return True
    return isinstance(exc, psycopg.OperationalError) and not sqlstate


def db_failure(exc: psycopg.Error, doing: str, code: ErrorCode = ErrorCode.TOOL_FAILED) -> FleetError:
    """The error to answer for ``exc`` raised while ``doing``: ``dependency_unavailable``, retryable,
    when the database went away; else ``code`` with the server's one-line reason (never the
    statement or its parameters)."""
    diag = getattr(exc, "diag", None)
    reason = str(getattr(diag, "message_primary", None) or type(exc).__name__)
    if connection_lost(exc):
        return FleetError(
            ErrorCode.DEPENDENCY_UNAVAILABLE,
            f"{doing}: the database is unavailable ({reason})",
            retryable=True,
            retry_after_s=1,
        )
    return FleetError(code, f"{doing}: {reason}")
