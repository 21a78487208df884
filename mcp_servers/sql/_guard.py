"""What a tenant's statement may call and read, decided on Postgres's own analysis of it.

The statement becomes the body of a temporary SQL function (``BEGIN ATOMIC``), created by the tenant's
own login inside a savepoint that is rolled back: Postgres parses and analyses it as it would run it
(same login, same search path) and keeps the analysed tree in ``pg_proc.prosqlbody``. That tree names
every function, aggregate, window function, operator and relation the statement uses by OID (string
constants are stored as bytes and aliases with their spaces escaped, so no text of the statement can
pose as a reference). One query reads the references out and returns the ones not allowed:

- functions: those of ``pg_catalog`` that are immutable or stable, except :data:`DENIED` (stable ones
  that reach outside the statement), plus :data:`ALLOWED_VOLATILE`. Everything else is refused:
  ``pg_notify``, ``pg_advisory_*``, ``pg_logical_emit_message``, ``set_config``, ``nextval``, ``lo_*``, ``pg_read_*``, ``pg_ls_*``, ``query_to_xml`` and every function outside
  ``pg_catalog`` (``dblink``, the service's own ``fleet_sql`` functions).
- relations: those of :data:`ALLOWED_SCHEMAS`; every table and view of ``pg_catalog`` (``pg_class``
  with its ``reltuples``, ``pg_stat_*``, ``pg_statio_*``, ``pg_locks``, ``pg_settings``, ``pg_roles``)
  is refused.

An operator counts as the function behind it. Functions a statement runs without naming them (row
security policies, column defaults, type input and output) are the operator's, not the tenant's.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import sql

# Stable or immutable functions of pg_catalog that a tenant's statement may not call: statistics that
# count every tenant's rows, transaction ids and snapshots, the server's and the client's addresses and
# files, role names by id, and functions that run a query or read a whole table by name.
DENIED = (
    "txid_current",
    "txid_current_if_assigned",
    "txid_current_snapshot",
    "pg_current_xact_id",
    "pg_current_xact_id_if_assigned",
    "pg_current_snapshot",
    "inet_client_addr",
    "inet_client_port",
    "inet_server_addr",
    "inet_server_port",
    "pg_tablespace_location",
    "pg_tablespace_databases",
    "pg_relation_filepath",
    "pg_relation_filenode",
    "pg_filenode_relation",
    "pg_show_all_settings",
    "pg_get_userbyid",
    "pg_cursor",
    "pg_prepared_statement",
    "pg_get_replication_slots",
    "pg_get_publication_tables",
    "pg_replication_origin_oid",
    "pg_config",
    "ts_rewrite",
    "ts_stat",
)
# Name patterns with the same reasons: every pg_stat_get_* counter, and the *_to_xml functions that
# read a table, a schema or the whole database.
DENIED_PATTERN = r"^pg_stat|_to_xml"
# Volatile functions of pg_catalog a query may call: random values, the clock, TABLESAMPLE methods, and
# sleeping, which the statement timeout stops (a statement cannot change it: set_config is refused).
ALLOWED_VOLATILE = (
    "pg_sleep",
    "pg_sleep_for",
    "pg_sleep_until",
    "random",
    "random_normal",
    "setseed",
    "gen_random_uuid",
    "uuidv4",
    "uuidv7",
    "clock_timestamp",
    "timeofday",
    "array_sample",
    "array_shuffle",
    "bernoulli",
    "system",
)
ALLOWED_SCHEMAS = ("tenant_data", "information_schema")

# Keys of the analysed tree (nodes/outfuncs) whose value is the OID of a function, an operator or a
# relation.
FUNCTION_KEYS = (
    "funcid",
    "aggfnoid",
    "winfnoid",
    "opfuncid",
    "hashfuncid",
    "negfuncid",
    "tsmhandler",
    "startInRangeFunc",
    "endInRangeFunc",
)
OPERATOR_KEYS = ("opno", "eqop", "sortop")
RELATION_KEYS = ("relid", "resorigtbl")

_CREATE = sql.SQL("CREATE FUNCTION pg_temp.fleet_guard() RETURNS void LANGUAGE sql BEGIN ATOMIC {}\n; END")
_REFUSED = """
WITH body AS (
    SELECT prosqlbody::pg_catalog.text AS tree FROM pg_catalog.pg_proc
    WHERE oid = 'pg_temp.fleet_guard()'::pg_catalog.regprocedure
), refs AS (
    SELECT m[1] AS key, m[2]::pg_catalog.oid AS id
    FROM body, pg_catalog.regexp_matches(tree, ' :([A-Za-z]+) ([0-9]+)', 'g') AS m
    UNION ALL
    SELECT 'opno', o::pg_catalog.oid
    FROM body, pg_catalog.regexp_matches(tree, ' :opnos \\(o ([0-9 ]+)\\)', 'g') AS m,
        pg_catalog.unnest(pg_catalog.string_to_array(m[1], ' ')) AS o
), called AS (
    SELECT id FROM refs WHERE key = ANY(%(function_keys)s) AND id <> 0
    UNION
    SELECT op.oprcode::pg_catalog.oid FROM refs JOIN pg_catalog.pg_operator op ON op.oid = refs.id
    WHERE refs.key = ANY(%(operator_keys)s)
)
SELECT 'function', p.proname::pg_catalog.text FROM called JOIN pg_catalog.pg_proc p ON p.oid = called.id
WHERE NOT (
    p.pronamespace = 'pg_catalog'::pg_catalog.regnamespace
    AND (
        p.proname = ANY(%(allowed_volatile)s)
        OR (p.provolatile <> 'v' AND p.proname <> ALL(%(denied)s) AND p.proname !~ %(denied_pattern)s)
    )
)
UNION
SELECT 'relation', c.oid::pg_catalog.regclass::pg_catalog.text
FROM refs JOIN pg_catalog.pg_class c ON c.oid = refs.id
WHERE refs.key = ANY(%(relation_keys)s) AND c.relnamespace::pg_catalog.regnamespace::pg_catalog.text <> ALL(%(schemas)s)
ORDER BY 1, 2
"""
_TRAILING = re.compile(r"[\s;]+\Z")


class StatementRefused(Exception):
    """The statement names functions or relations a tenant's statement may not use."""

    def __init__(self, refused: list[tuple[str, str]]) -> None:
        self.refused = refused
        super().__init__(", ".join(f"{kind} {name}" for kind, name in refused))


def trimmed(statement: str) -> str:
    """``statement`` without trailing semicolons and blanks (it is placed inside other SQL)."""
    return _TRAILING.sub("", statement)


async def refused_objects(conn: psycopg.AsyncConnection[Any], statement: str) -> list[tuple[str, str]]:
    """The functions and relations of ``statement`` that are not allowed, as ``(kind, name)``; raises
    :class:`psycopg.Error` when Postgres cannot analyse it. ``conn`` is in a read-write transaction
    (creating the temporary function needs one); what the check creates is rolled back."""
    async with conn.transaction(force_rollback=True):
        cursor = conn.cursor()
        # binary: the extended protocol, which refuses a second statement
        await cursor.execute(_CREATE.format(sql.SQL(statement)), binary=True)
        await cursor.execute(
            _REFUSED,
            {
                "function_keys": list(FUNCTION_KEYS),
                "operator_keys": list(OPERATOR_KEYS),
                "relation_keys": list(RELATION_KEYS),
                "allowed_volatile": list(ALLOWED_VOLATILE),
                "denied": list(DENIED),
                "denied_pattern": DENIED_PATTERN,
                "schemas": list(ALLOWED_SCHEMAS),
            },
        )
        return [(str(kind), str(name)) for kind, name in await cursor.fetchall()]


async def check_statement(conn: psycopg.AsyncConnection[Any], statement: str) -> None:
    """Raise :class:`StatementRefused` if ``statement`` uses what a tenant may not (see the module)."""
    refused = await refused_objects(conn, statement)
    if refused:
        raise StatementRefused(refused)
