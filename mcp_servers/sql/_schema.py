"""The tenant-data schema the SQL server serves, created idempotently at start-up, and the small demo
data set (two tenants' invoices) it seeds when asked to."""

from __future__ import annotations

from datetime import date, timedelta

from psycopg import AsyncConnection

READER_ROLE = "fleet_sql_reader"
TENANT_SETTING = "fleet.tenant"

SCHEMA_SQL = f"""
CREATE SCHEMA IF NOT EXISTS tenant_data;
CREATE TABLE IF NOT EXISTS tenant_data.invoices (
    id          bigserial PRIMARY KEY,
    tenant_id   text        NOT NULL,
    customer    text        NOT NULL,
    amount      numeric(12, 2) NOT NULL CHECK (amount >= 0),
    issued_on   date        NOT NULL,
    status      text        NOT NULL CHECK (status IN ('open', 'paid', 'overdue'))
);
CREATE INDEX IF NOT EXISTS invoices_tenant ON tenant_data.invoices (tenant_id);
ALTER TABLE tenant_data.invoices ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenant_data.invoices FORCE ROW LEVEL SECURITY;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        CREATE ROLE {READER_ROLE} NOLOGIN NOSUPERUSER NOBYPASSRLS;
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_policies
        WHERE schemaname = 'tenant_data' AND tablename = 'invoices' AND policyname = 'tenant_isolation'
    ) THEN
        CREATE POLICY tenant_isolation ON tenant_data.invoices
            USING (tenant_id = current_setting('{TENANT_SETTING}', true));
    END IF;
END $$;
-- No temporary tables: a statement must not leave objects that shadow tenant_data for later calls.
DO $$
BEGIN
    EXECUTE format('REVOKE TEMPORARY ON DATABASE %I FROM PUBLIC', current_database());
END $$;
GRANT USAGE ON SCHEMA tenant_data TO {READER_ROLE};
GRANT SELECT ON ALL TABLES IN SCHEMA tenant_data TO {READER_ROLE};
"""

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


async def ensure_schema(conn: AsyncConnection[object]) -> None:
    # Several servers may start at once; serialise the DDL with an advisory lock.
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('fleet.mcp_sql.schema'))")
        await conn.execute(SCHEMA_SQL)


async def seed_demo_data(conn: AsyncConnection[object]) -> None:
    """Insert the demo invoices for each demo tenant that has none yet."""
    today = date.today()
    async with conn.transaction():
        for tenant, rows in DEMO_INVOICES.items():
            # Row-level security is forced on the owner too: act as the tenant being seeded.
            await conn.execute("SELECT set_config(%s, %s, true)", (TENANT_SETTING, tenant))
            found = await (
                await conn.execute(
                    "SELECT 1 FROM tenant_data.invoices WHERE tenant_id = %s LIMIT 1", (tenant,)
                )
            ).fetchone()
            if found is not None:
                continue
            async with conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO tenant_data.invoices (tenant_id, customer, amount, issued_on, status)"
                    " VALUES (%s, %s, %s, %s, %s)",
                    [(tenant, c, a, today - timedelta(days=d), s) for c, a, d, s in rows],
                )
