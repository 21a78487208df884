"""The tenant-data schema the SQL server serves, created idempotently at start-up, the tenant login
roles that bind each database session to one tenant, and the small demo data set (two tenants'
invoices) it seeds when asked to.

Why a login role per tenant. Row-level security keyed on a session setting (``fleet.tenant``) is no
boundary against SQL written by a model: a single read-only SELECT can change that setting before the
policy reads it (``WITH s AS MATERIALIZED (SELECT set_config('fleet.tenant', 'other', true)) SELECT ...
FROM s, invoices``), and a shared role also shows every tenant's statements in ``pg_stat_activity``.
Here the policy reads ``session_user``, which no statement can change: ``SET ROLE`` moves
``current_user`` only, and ``SET SESSION AUTHORIZATION`` needs a superuser login. Each tenant's
statements run on connections that logged in as that tenant's role (``fleet_t_`` + a hash of the
tenant), and ``fleet_sql.session_tenant()`` maps the login to its tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import date, timedelta
from typing import Any

from psycopg import AsyncConnection, sql

TENANTS_GROUP = "fleet_sql_tenants"  # every tenant login role is a member; grants go to the group
LEGACY_READER_ROLE = "fleet_sql_reader"  # the shared reader of earlier versions: stripped of grants
OWNER_SETTING = "fleet.tenant"  # used by the owner's own fixed statements (seeding), never by tools
WRITE_STATUS_PENDING = "pending"
RESULT_TOO_LARGE_SQLSTATE = "54F13"  # fleet_sql.query_rows: a query's result passed the byte cap

SCHEMA_SQL = f"""
CREATE SCHEMA IF NOT EXISTS tenant_data;
CREATE SCHEMA IF NOT EXISTS fleet_sql;
REVOKE ALL ON SCHEMA fleet_sql FROM PUBLIC;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{TENANTS_GROUP}') THEN
        CREATE ROLE {TENANTS_GROUP} NOLOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE;
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS fleet_sql.tenant_roles (
    role_name  name PRIMARY KEY,
    tenant_id  text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- The one thing that says which tenant a session is: its login, which no statement can change.
CREATE OR REPLACE FUNCTION fleet_sql.session_tenant() RETURNS text
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog
    AS $fn$ SELECT tenant_id FROM fleet_sql.tenant_roles WHERE role_name = session_user $fn$;
REVOKE ALL ON FUNCTION fleet_sql.session_tenant() FROM PUBLIC;
GRANT USAGE ON SCHEMA fleet_sql TO {TENANTS_GROUP};
GRANT EXECUTE ON FUNCTION fleet_sql.session_tenant() TO {TENANTS_GROUP};

-- The write ledger: one row per (tenant, idempotency key), written in the transaction of the write.
CREATE TABLE IF NOT EXISTS fleet_sql.writes (
    tenant_id       text NOT NULL,
    idempotency_key text NOT NULL,
    statement_hash  text NOT NULL,
    row_count       bigint,
    written_by      text NOT NULL,
    written_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, idempotency_key)
);
-- Claims a key for the session's tenant: 'new' when this transaction holds it now, else what the
-- earlier write under the key recorded. A concurrent claim of the same key waits for the first.
CREATE OR REPLACE FUNCTION fleet_sql.claim_write(p_key text, p_hash text, p_by text,
    OUT status text, OUT statement_hash text, OUT row_count bigint)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $fn$
DECLARE
    t text := fleet_sql.session_tenant();
BEGIN
    IF t IS NULL THEN
        RAISE EXCEPTION 'this login belongs to no tenant';
    END IF;
    INSERT INTO fleet_sql.writes (tenant_id, idempotency_key, statement_hash, written_by)
        VALUES (t, p_key, p_hash, p_by) ON CONFLICT DO NOTHING;
    IF FOUND THEN
        status := 'new'; statement_hash := p_hash; row_count := NULL;
        RETURN;
    END IF;
    SELECT 'done', w.statement_hash, w.row_count INTO status, statement_hash, row_count
        FROM fleet_sql.writes w WHERE w.tenant_id = t AND w.idempotency_key = p_key;
END $fn$;
CREATE OR REPLACE FUNCTION fleet_sql.finish_write(p_key text, p_rows bigint) RETURNS void
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog AS $fn$
    UPDATE fleet_sql.writes SET row_count = p_rows
        WHERE tenant_id = fleet_sql.session_tenant() AND idempotency_key = p_key AND row_count IS NULL
$fn$;
CREATE OR REPLACE FUNCTION fleet_sql.write_status(p_key text,
    OUT statement_hash text, OUT row_count bigint, OUT written_at timestamptz)
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $fn$
    SELECT w.statement_hash, w.row_count, w.written_at FROM fleet_sql.writes w
        WHERE w.tenant_id = fleet_sql.session_tenant() AND w.idempotency_key = p_key
$fn$;
REVOKE ALL ON FUNCTION fleet_sql.claim_write(text, text, text) FROM PUBLIC;
REVOKE ALL ON FUNCTION fleet_sql.finish_write(text, bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION fleet_sql.write_status(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fleet_sql.claim_write(text, text, text) TO {TENANTS_GROUP};
GRANT EXECUTE ON FUNCTION fleet_sql.finish_write(text, bigint) TO {TENANTS_GROUP};
GRANT EXECUTE ON FUNCTION fleet_sql.write_status(text) TO {TENANTS_GROUP};

CREATE TABLE IF NOT EXISTS tenant_data.invoices (
    id          bigserial PRIMARY KEY,
    tenant_id   text        NOT NULL,
    customer    text        NOT NULL,
    amount      numeric(12, 2) NOT NULL CHECK (amount >= 0),
    issued_on   date        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('open', 'paid', 'overdue'))
);
CREATE INDEX IF NOT EXISTS invoices_tenant ON tenant_data.invoices (tenant_id);
-- Payments as the bank reports them, by the invoice number they name (reconciliation's other side).
CREATE TABLE IF NOT EXISTS tenant_data.payments (
    id              bigserial PRIMARY KEY,
    tenant_id       text        NOT NULL,
    invoice_number  text        NOT NULL,
    amount          numeric(12, 2) NOT NULL CHECK (amount > 0),
    paid_on         date        NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_tenant_invoice ON tenant_data.payments (tenant_id, invoice_number);
-- Temporary objects for the tenant roles only, and only for the guard's function (mcp_servers.sql._guard):
-- the query tool declares a cursor (no DDL), the execute tool's statement must be a DML (else its
-- transaction rolls back), and DISCARD ALL drops what a session made before its connection is reused.
DO $$
BEGIN
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
    EXECUTE format('GRANT TEMPORARY ON DATABASE %I TO {TENANTS_GROUP}', current_database());
END $$;

-- The query tool runs a tenant's statement only through these two (as the tenant: no SECURITY DEFINER),
-- so that every error it raises, in planning or in running, passes a handler that cuts the reason to
-- 500 characters before it leaves the server (an invalid cast quotes the whole value it was given).
-- describe_query: a cursor over no rows (fleet_describe) whose description is the statement's columns.
CREATE OR REPLACE FUNCTION fleet_sql.describe_query(p_statement text) RETURNS refcursor
    LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    c refcursor := 'fleet_describe';
BEGIN
    OPEN c FOR EXECUTE 'SELECT * FROM (' || p_statement || E'\n) AS fleet_r LIMIT 0';
    RETURN c;
EXCEPTION WHEN OTHERS THEN
    RAISE EXCEPTION USING ERRCODE = SQLSTATE, MESSAGE = pg_catalog.left(SQLERRM, 500);
END $fn$;
-- query_rows: the statement's rows, at most p_max_rows, and none that would take the result past
-- p_cap bytes (a row counts its text form, or its stored form when that alone is past the cap): that
-- row stops the statement with SQLSTATE {RESULT_TOO_LARGE_SQLSTATE} before it is sent. DETAIL: rows within
-- the cap, their bytes, the bytes of the refused row.
CREATE OR REPLACE FUNCTION fleet_sql.query_rows(p_statement text, p_max_rows integer, p_cap bigint)
    RETURNS SETOF record LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    r record;
    n_rows integer := 0;
    n_bytes bigint := 0;
    row_bytes bigint;
BEGIN
    FOR r IN EXECUTE p_statement LOOP
        row_bytes := pg_catalog.pg_column_size(r);
        IF row_bytes <= p_cap THEN
            row_bytes := pg_catalog.octet_length(r::pg_catalog.text);
        END IF;
        IF n_bytes + row_bytes > p_cap THEN
            RAISE EXCEPTION 'result_too_large' USING ERRCODE = '{RESULT_TOO_LARGE_SQLSTATE}',
                DETAIL = pg_catalog.format('%s %s %s', n_rows, n_bytes, row_bytes);
        END IF;
        n_rows := n_rows + 1;
        n_bytes := n_bytes + row_bytes;
        RETURN NEXT r;
        EXIT WHEN n_rows >= p_max_rows;
    END LOOP;
    RETURN;
EXCEPTION WHEN OTHERS THEN
    IF SQLSTATE = '{RESULT_TOO_LARGE_SQLSTATE}' THEN
        RAISE;
    END IF;
    RAISE EXCEPTION USING ERRCODE = SQLSTATE, MESSAGE = pg_catalog.left(SQLERRM, 500);
END $fn$;
REVOKE ALL ON FUNCTION fleet_sql.describe_query(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION fleet_sql.query_rows(text, integer, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fleet_sql.describe_query(text) TO {TENANTS_GROUP};
GRANT EXECUTE ON FUNCTION fleet_sql.query_rows(text, integer, bigint) TO {TENANTS_GROUP};
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{LEGACY_READER_ROLE}') THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA tenant_data FROM {LEGACY_READER_ROLE};
        REVOKE ALL ON SCHEMA tenant_data FROM {LEGACY_READER_ROLE};
        ALTER ROLE {LEGACY_READER_ROLE} NOLOGIN;
    END IF;
END $$;
"""


async def expose_table(conn: AsyncConnection[Any], table: str, *, writable: bool = False) -> None:
    """Let the tenant roles read (and, if ``writable``, write) ``tenant_data.<table>``, which has a
    text column ``tenant_id``: row-level security on, forced on the owner, one policy for the tenant
    roles keyed on the login, one for the owner's own fixed statements keyed on ``fleet.tenant``.
    Idempotent; call inside the schema lock."""
    target = sql.Identifier("tenant_data", table)
    await conn.execute(sql.SQL("ALTER TABLE {} ENABLE ROW LEVEL SECURITY").format(target))
    await conn.execute(sql.SQL("ALTER TABLE {} FORCE ROW LEVEL SECURITY").format(target))
    policies = {
        str(row[0])
        async for row in await conn.execute(
            "SELECT policyname FROM pg_policies WHERE schemaname = 'tenant_data' AND tablename = %s",
            (table,),
        )
    }
    if "tenant_isolation" in policies:  # the setting-keyed policy of earlier versions applied to all
        await conn.execute(sql.SQL("DROP POLICY tenant_isolation ON {}").format(target))
    if "tenant_login" not in policies:
        await conn.execute(
            sql.SQL(
                "CREATE POLICY tenant_login ON {} TO {} USING (tenant_id = (SELECT fleet_sql.session_tenant()))"
                " WITH CHECK (tenant_id = (SELECT fleet_sql.session_tenant()))"
            ).format(target, sql.Identifier(TENANTS_GROUP))
        )
    if "owner_setting" not in policies:
        await conn.execute(
            sql.SQL(
                "CREATE POLICY owner_setting ON {} TO CURRENT_USER"
                " USING (tenant_id = current_setting({}, true))"
                " WITH CHECK (tenant_id = current_setting({}, true))"
            ).format(target, sql.Literal(OWNER_SETTING), sql.Literal(OWNER_SETTING))
        )
    await conn.execute(
        sql.SQL("GRANT USAGE ON SCHEMA tenant_data TO {}").format(sql.Identifier(TENANTS_GROUP))
    )
    privileges = "SELECT, INSERT, UPDATE, DELETE" if writable else "SELECT"
    await conn.execute(
        sql.SQL("GRANT {} ON {} TO {}").format(sql.SQL(privileges), target, sql.Identifier(TENANTS_GROUP))
    )
    if writable:
        sequences = await conn.execute(
            "SELECT pg_get_serial_sequence(format('tenant_data.%%I', %s::text), a.attname)"
            " FROM pg_attribute a WHERE a.attrelid = format('tenant_data.%%I', %s::text)::regclass"
            " AND a.attnum > 0 AND NOT a.attisdropped",
            (table, table),
        )
        for (sequence,) in await sequences.fetchall():
            if sequence:
                await conn.execute(
                    sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(
                        sql.SQL(sequence), sql.Identifier(TENANTS_GROUP)
                    )
                )


async def ensure_schema(conn: AsyncConnection[Any], *, writable: tuple[str, ...] = ("invoices",)) -> None:
    # Several servers may start at once; serialise the DDL with an advisory lock.
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.mcp_sql.schema'))")
        await conn.execute(SCHEMA_SQL)
        await expose_table(conn, "invoices", writable="invoices" in writable)
        await expose_table(conn, "payments", writable="payments" in writable)


def tenant_role(tenant: str) -> str:
    """The login role of ``tenant``: a fixed prefix and a hash, so any tenant id makes a safe name."""
    return "fleet_t_" + hashlib.sha256(tenant.encode()).hexdigest()[:24]


def role_password(secret: bytes, role: str) -> str:
    """The password of a tenant role: the same in every replica that shares ``secret``."""
    return hmac.new(secret, role.encode(), hashlib.sha256).hexdigest()


async def ensure_tenant_role(
    conn: AsyncConnection[Any],
    tenant: str,
    password: str,
    *,
    statement_timeout_ms: int,
    connection_limit: int,
) -> str:
    """Create (or update) ``tenant``'s login role, a member of the tenants group and nothing else, and
    map it to the tenant. ``conn`` is the service's own login."""
    role = tenant_role(tenant)
    ident = sql.Identifier(role)
    async with conn.transaction():
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext('fleet.mcp_sql.role'), hashtext(%s))", (role,)
        )
        exists = await (await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))).fetchone()
        if exists is None:
            await conn.execute(
                sql.SQL(
                    "CREATE ROLE {} LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE NOREPLICATION"
                    " INHERIT IN ROLE {}"
                ).format(ident, sql.Identifier(TENANTS_GROUP))
            )
        await conn.execute(
            sql.SQL("ALTER ROLE {} LOGIN CONNECTION LIMIT {} PASSWORD {}").format(
                ident, sql.Literal(connection_limit), sql.Literal(password)
            )
        )
        # Defaults for every session of the role, on top of what each call sets.
        await conn.execute(
            sql.SQL("ALTER ROLE {} SET statement_timeout = {}").format(
                ident, sql.Literal(statement_timeout_ms)
            )
        )
        await conn.execute(sql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(ident))
        await conn.execute(sql.SQL("ALTER ROLE {} SET row_security = on").format(ident))
        await conn.execute(
            "INSERT INTO fleet_sql.tenant_roles (role_name, tenant_id) VALUES (%s, %s)"
            " ON CONFLICT (role_name) DO NOTHING",
            (role, tenant),
        )
        owner = await (
            await conn.execute("SELECT tenant_id FROM fleet_sql.tenant_roles WHERE role_name = %s", (role,))
        ).fetchone()
    if owner is None or owner[0] != tenant:  # a hash collision: refuse rather than share a role
        raise RuntimeError(f"tenant role {role} belongs to another tenant")
    return role


# (customer, amount, days ago, status): one deliberate outlier per tenant for the demo to find.
DEMO_INVOICES: dict[str, list[tuple[str, float, int, str]]] = {
    "acme": [
        ("Northwind", 1200.00, 3, "paid"),
        ("Northwind", 1150.00, 10, "open"),
        ("Contoso", 980.50, 5, "paid"),
        ("Contoso", 1010.00, 12, "overdue"),
        ("Fabrikam", 1105.25, 7, "open"),
        ("Fabrikam", 9800.00, 2, "open"),
        ("Tailspin", 1060.00, 15, "paid"),
    ],
    "globex": [
        ("Initech", 450.00, 4, "paid"),
        ("Initech", 470.00, 9, "open"),
        ("Hooli", 510.00, 6, "paid"),
        ("Hooli", 3900.00, 1, "overdue"),
        ("Vandelay", 495.00, 11, "paid"),
    ],
}


# (invoice number, amount, days ago): what the bank received for the invoices that the demo's billing
# events report settled. acme: one short payment, one paid twice, one never paid; globex: one short by
# a little (see fleetctl.demo's events).
DEMO_PAYMENTS: dict[str, list[tuple[str, float, int]]] = {
    "acme": [
        ("INV-A-1001", 1180.00, 1),
        ("INV-A-1002", 895.00, 1),
        ("INV-A-1004", 1060.00, 2),
        ("INV-A-1004", 1060.00, 1),
        ("INV-A-1005", 1210.00, 1),
    ],
    "globex": [
        ("INV-G-2001", 460.00, 1),
        ("INV-G-2002", 500.00, 1),
        ("INV-G-2003", 505.00, 2),
    ],
}


async def seed_demo_data(conn: AsyncConnection[Any]) -> None:
    """Insert the demo invoices and payments for each demo tenant that has none yet."""
    today = date.today()
    async with conn.transaction():
        for tenant, rows in DEMO_INVOICES.items():
            # Row-level security is forced on the owner too: act as the tenant being seeded.
            await conn.execute("SELECT set_config(%s, %s, true)", (OWNER_SETTING, tenant))
            async with conn.cursor() as cur:
                if not await _has_rows(conn, "invoices", tenant):
                    await cur.executemany(
                        "INSERT INTO tenant_data.invoices (tenant_id, customer, amount, issued_on, status)"
                        " VALUES (%s, %s, %s, %s, %s)",
                        [(tenant, c, a, today - timedelta(days=d), s) for c, a, d, s in rows],
                    )
                if not await _has_rows(conn, "payments", tenant):
                    await cur.executemany(
                        "INSERT INTO tenant_data.payments (tenant_id, invoice_number, amount, paid_on)"
                        " VALUES (%s, %s, %s, %s)",
                        [
                            (tenant, n, a, today - timedelta(days=d))
                            for n, a, d in DEMO_PAYMENTS.get(tenant, [])
                        ],
                    )


async def _has_rows(conn: AsyncConnection[Any], table: str, tenant: str) -> bool:
    query = sql.SQL("SELECT 1 FROM {} WHERE tenant_id = %s LIMIT 1").format(
        sql.Identifier("tenant_data", table)
    )
    return await (await conn.execute(query, (tenant,))).fetchone() is not None
