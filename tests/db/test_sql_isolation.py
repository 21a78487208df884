"""The SQL tool against statements written by an attacker, on a real Postgres.

Every statement runs as tenant ``acme`` through the tool's own code path (tenant login role, read-only
cursor or keyed write). Whatever it does, nothing of tenant ``globex`` may come back: not a row, not a
value in an error message, not a count; and no write may touch globex's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fleet.errors import FleetError
from mcp_servers.sql._schema import DEMO_INVOICES, OWNER_SETTING, ensure_schema, seed_demo_data
from mcp_servers.sql.server import SqlServerSettings, SqlTools, TenantPools
from tests.memwatch import PeakGrowth
from tests.raising import raises_code

GLOBEX_MARKERS = ("globex", "Initech", "Hooli", "Vandelay", "3900", "450", "470", "510", "495")
ACME_ROWS = len(DEMO_INVOICES["acme"])


def settings_for(pg_dsn: str, **overrides: Any) -> SqlServerSettings:
    return SqlServerSettings(
        service_id="mcp-sql",
        key_file=Path("/nonexistent"),
        public_url="http://127.0.0.1:1",
        pg_dsn=pg_dsn,
        **{"sql_writable_tables": ["invoices"], **overrides},
    )


@pytest.fixture
async def tools(pg_dsn: str) -> AsyncIterator[SqlTools]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        await ensure_schema(admin, writable=("invoices",))
        await seed_demo_data(admin)
    settings = settings_for(pg_dsn, statement_timeout_ms=2000)
    pools = TenantPools(settings)
    try:
        yield SqlTools(pools, settings)
    finally:
        await pools.aclose()


async def globex_rows(pg_dsn: str) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin, admin.transaction():
        await admin.execute("SELECT set_config(%s, 'globex', true)", (OWNER_SETTING,))
        cursor = await admin.execute(
            "SELECT customer, amount, status FROM tenant_data.invoices WHERE tenant_id = 'globex' ORDER BY id"
        )
        return await cursor.fetchall()


def assert_nothing_of_globex(outcome: object) -> None:
    text = json.dumps(outcome, default=str) if not isinstance(outcome, str) else outcome
    leaked = [marker for marker in GLOBEX_MARKERS if marker in text]
    assert not leaked, f"tenant globex leaked {leaked}: {text[:500]}"


HOSTILE_QUERIES = {
    # Row-level security keyed on a setting falls to any of these: the setting changes mid-statement.
    "cte_sets_the_tenant_first": "WITH s AS MATERIALIZED (SELECT set_config('fleet.tenant', 'globex', true) x)"
    " SELECT i.* FROM s, tenant_data.invoices i",
    "subquery_sets_the_tenant": "SELECT * FROM tenant_data.invoices"
    " WHERE (SELECT set_config('fleet.tenant', 'globex', false)) IS NOT NULL",
    "lateral_sets_the_tenant": "SELECT i.* FROM (SELECT set_config('fleet.tenant', 'globex', true)) s,"
    " LATERAL (SELECT * FROM tenant_data.invoices) i",
    "asks_for_the_other_tenant": "SELECT * FROM tenant_data.invoices WHERE tenant_id = 'globex'",
    "or_true_on_the_tenant": "SELECT * FROM tenant_data.invoices WHERE tenant_id <> 'acme' OR 1 = 1",
    "counts_all_rows": "SELECT count(*) AS n, sum(amount) AS total FROM tenant_data.invoices",
    # Roles: SET ROLE moves current_user (to the group at most), never the login the policy keys on.
    "switches_role_to_the_group": "WITH r AS MATERIALIZED (SELECT set_config('role', 'fleet_sql_tenants', true))"
    " SELECT i.* FROM r, tenant_data.invoices i",
    "switches_session_authorization": "SELECT set_config('session_authorization', 'postgres', true),"
    " * FROM tenant_data.invoices",
    "turns_row_security_off": "WITH r AS MATERIALIZED (SELECT set_config('row_security', 'off', true))"
    " SELECT i.* FROM r, tenant_data.invoices i",
    # Side doors: the role map, statistics, other sessions' statements, the server's files.
    "reads_the_role_map": "SELECT * FROM fleet_sql.tenant_roles",
    "reads_the_write_ledger": "SELECT * FROM fleet_sql.writes",
    "reads_column_statistics": "SELECT most_common_vals::text, histogram_bounds::text FROM pg_stats"
    " WHERE schemaname = 'tenant_data'",
    "reads_other_sessions": "SELECT usename, query FROM pg_stat_activity",
    "reads_a_server_file": "SELECT pg_read_file('postgresql.auto.conf')",
    "reads_the_other_login": "SELECT rolname FROM pg_roles WHERE rolname LIKE 'fleet_t_%'",
    # Error messages: a cast that fails on a value names the value; only the caller's rows may be cast.
    "leaks_through_an_error": "SELECT * FROM tenant_data.invoices WHERE customer::int > 0",
    "leaks_through_a_division": "SELECT 1 / (CASE WHEN tenant_id = 'globex' THEN 0 ELSE 1 END)"
    " FROM tenant_data.invoices",
    # Mapping functions called with arguments: they take none that name a tenant.
    "asks_the_mapping_directly": "SELECT fleet_sql.session_tenant()",
    "claims_a_write_from_a_select": "SELECT * FROM fleet_sql.claim_write('k', 'h', 'x')",
}


@pytest.mark.parametrize("statement", HOSTILE_QUERIES.values(), ids=list(HOSTILE_QUERIES))
async def test_a_hostile_query_sees_nothing_of_another_tenant(tools: SqlTools, statement: str) -> None:
    try:
        outcome: object = await tools.query("acme", statement)
    except FleetError as exc:
        outcome = str(exc)
    assert_nothing_of_globex(outcome)
    if isinstance(outcome, dict):
        for row in outcome["rows"]:
            assert "globex" not in json.dumps(row)
        if outcome["columns"][:1] == ["n"]:
            assert outcome["rows"] == [[ACME_ROWS, pytest.approx(sum(r[1] for r in DEMO_INVOICES["acme"]))]]


async def test_a_hostile_query_does_not_widen_the_next_call(tools: SqlTools) -> None:
    """Whatever a statement set inside the session, the next call of the same tenant starts clean."""
    for statement in HOSTILE_QUERIES.values():
        with contextlib.suppress(FleetError):
            await tools.query("acme", statement)
    result = await tools.query("acme", "SELECT DISTINCT tenant_id FROM tenant_data.invoices")
    assert result["rows"] == [["acme"]]
    result = await tools.query(
        "acme",
        "SELECT current_user, session_user = current_user, current_setting('fleet.tenant', true) FROM (VALUES (1)) v",
    )
    [[user, same, setting]] = result["rows"]
    assert user.startswith("fleet_t_") and same is True and setting in (None, "")


async def test_each_tenant_sees_exactly_its_own_rows(tools: SqlTools) -> None:
    statement = "SELECT customer FROM tenant_data.invoices ORDER BY id"
    acme, globex = await asyncio.gather(tools.query("acme", statement), tools.query("globex", statement))
    assert [r[0] for r in acme["rows"]] == [c for c, *_ in DEMO_INVOICES["acme"]]
    assert [r[0] for r in globex["rows"]] == [c for c, *_ in DEMO_INVOICES["globex"]]
    newcomer = await tools.query("initech-new", statement)
    assert newcomer["rows"] == []


HOSTILE_WRITES = {
    "moves_a_row_to_the_other_tenant": "UPDATE tenant_data.invoices SET tenant_id = 'globex'",
    "inserts_for_the_other_tenant": "INSERT INTO tenant_data.invoices (tenant_id, customer, amount, issued_on,"
    " status) VALUES ('globex', 'Planted', 1, now(), 'open')",
    "deletes_the_other_tenant": "DELETE FROM tenant_data.invoices WHERE tenant_id = 'globex'",
    "updates_the_other_tenant": "UPDATE tenant_data.invoices SET amount = 0 WHERE tenant_id = 'globex'",
    "sets_the_tenant_then_deletes": "WITH s AS (SELECT set_config('fleet.tenant', 'globex', true))"
    " DELETE FROM tenant_data.invoices WHERE EXISTS (SELECT 1 FROM s)",
    "second_statement": "UPDATE tenant_data.invoices SET amount = amount; DELETE FROM tenant_data.invoices",
    "commits_early": "COMMIT",
    "makes_a_table": "CREATE TABLE tenant_data.planted (x int)",
    "changes_a_policy": "DROP POLICY tenant_login ON tenant_data.invoices",
    "writes_the_ledger_directly": "INSERT INTO fleet_sql.writes VALUES ('globex', 'k', 'h', 1, 'x', now())",
}


@pytest.mark.parametrize(("name", "statement"), HOSTILE_WRITES.items(), ids=list(HOSTILE_WRITES))
async def test_a_hostile_write_cannot_touch_another_tenant(
    tools: SqlTools, pg_dsn: str, name: str, statement: str
) -> None:
    before = await globex_rows(pg_dsn)
    try:
        # The key is echoed in the answer: it must hold nothing that looks like a globex marker.
        outcome: object = await tools.execute("acme", statement, f"key-{name}", "attacker")
    except FleetError as exc:
        outcome = str(exc)
    assert_nothing_of_globex(outcome)
    assert await globex_rows(pg_dsn) == before
    acme = await tools.query("acme", "SELECT count(*) FROM tenant_data.invoices WHERE tenant_id = 'acme'")
    assert acme["rows"][0][0] in (ACME_ROWS, 0)  # a delete of its own rows is the caller's business


async def test_the_query_tool_refuses_writes_even_with_write_grants(tools: SqlTools) -> None:
    for statement in (
        "WITH d AS (DELETE FROM tenant_data.invoices RETURNING *) SELECT * FROM d",
        "SELECT 1; DELETE FROM tenant_data.invoices",
        "DELETE FROM tenant_data.invoices",
    ):
        with raises_code("invalid_request"):
            await tools.query("acme", statement)
    assert (await tools.query("acme", "SELECT count(*) FROM tenant_data.invoices"))["rows"] == [[ACME_ROWS]]


async def test_one_idempotency_key_writes_once_even_when_repeated_concurrently(tools: SqlTools) -> None:
    statement = (
        "INSERT INTO tenant_data.invoices (tenant_id, customer, amount, issued_on, status)"
        " VALUES ('acme', 'Once', 10, now(), 'open')"
    )
    results = await asyncio.gather(
        *(tools.execute("acme", statement, "insert-once", "agent") for _ in range(5))
    )
    assert sorted(r["replayed"] for r in results) == [False, True, True, True, True]
    assert {r["row_count"] for r in results} == {1}
    count = await tools.query("acme", "SELECT count(*) FROM tenant_data.invoices WHERE customer = 'Once'")
    assert count["rows"] == [[1]]
    status = await tools.write_status("acme", "insert-once")
    assert (status["status"], status["row_count"]) == ("written", 1)
    assert (await tools.write_status("globex", "insert-once"))["status"] == "unknown"
    with raises_code("conflict"):
        await tools.execute("acme", statement.replace("10", "11"), "insert-once", "agent")


async def test_a_refused_write_leaves_its_key_unused(tools: SqlTools) -> None:
    with raises_code("invalid_request"):
        await tools.execute("acme", "UPDATE tenant_data.invoices SET amount = -1", "bad-then-good", "agent")
    assert (await tools.write_status("acme", "bad-then-good"))["status"] == "unknown"
    result = await tools.execute(
        "acme", "UPDATE tenant_data.invoices SET amount = amount", "bad-then-good", "agent"
    )
    assert (result["row_count"], result["replayed"]) == (ACME_ROWS, False)


async def test_a_table_that_is_not_writable_refuses_writes(pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        await ensure_schema(admin, writable=())
        await seed_demo_data(admin)
    settings = settings_for(pg_dsn, sql_writable_tables=[])
    pools = TenantPools(settings)
    try:
        tools = SqlTools(pools, settings)
        with pytest.raises(FleetError, match="permission denied"):
            await tools.execute("acme", "UPDATE tenant_data.invoices SET amount = amount", "k1", "agent")
        assert (await tools.write_status("acme", "k1"))["status"] == "unknown"
    finally:
        await pools.aclose()


async def test_a_runaway_query_is_stopped_by_the_statement_timeout(tools: SqlTools) -> None:
    with pytest.raises(FleetError, match="statement timeout"):
        await tools.query("acme", "SELECT pg_sleep(30)")
    with pytest.raises(FleetError, match="statement timeout"):
        await tools.query(
            "acme", "SELECT count(*) FROM generate_series(1, 100000) a, generate_series(1, 100000) b"
        )
    # Turning the timeout off inside the statement is refused before it runs.
    with raises_code("sql_refused", r".*set_config"):
        await tools.query(
            "acme",
            "WITH s AS MATERIALIZED (SELECT set_config('statement_timeout', '0', true)) SELECT pg_sleep(30)",
        )


# Statements that reach outside the tenant's rows or outside the statement: each must be refused
# naming the function or relation, before it runs.
REACHING_OUT = {
    "pg_notify": "SELECT pg_notify('fleet_data', 'spoofed')",
    "pg_notify_in_a_cte": "WITH n AS MATERIALIZED (SELECT pg_catalog.pg_notify('fleet_data', 'x')) SELECT * FROM n",
    "pg_notify_quoted_in_where": "SELECT 1 FROM tenant_data.invoices WHERE \"pg_notify\"('fleet_data', customer) IS NULL",
    "pg_notify_in_order_by": "SELECT customer FROM tenant_data.invoices ORDER BY length(pg_notify('c', 'x')::text)",
    "pg_logical_emit_message": "SELECT pg_logical_emit_message(true, 'x', repeat('x', 1000000))",
    "pg_advisory_lock": "SELECT pg_advisory_lock(hashtext('fleet.mcp_sql.schema'))",
    "pg_advisory_lock_shared": "SELECT pg_advisory_lock_shared(1)",
    "pg_advisory_xact_lock": "SELECT pg_advisory_xact_lock(1, 2)",
    "pg_try_advisory_lock": "SELECT * FROM tenant_data.invoices i, LATERAL (SELECT pg_try_advisory_lock(i.id)) l",
    "pg_try_advisory_xact_lock_shared": "SELECT pg_try_advisory_xact_lock_shared(1)",
    "pg_advisory_unlock_all": "SELECT pg_advisory_unlock_all()",
    "txid_current": "SELECT txid_current()",
    "pg_current_xact_id": "SELECT pg_current_xact_id()",
    "pg_current_snapshot": "SELECT pg_current_snapshot()",
    "txid_current_snapshot": "SELECT txid_current_snapshot()",
    "set_config": "SELECT set_config('work_mem', '2GB', true)",
    "nextval": "SELECT nextval('tenant_data.invoices_id_seq')",
    "lo_create": "SELECT lo_create(0)",
    "lo_import": "SELECT lo_import('/etc/passwd')",
    "pg_read_file": "SELECT pg_read_file('postgresql.conf')",
    "pg_read_binary_file": "SELECT pg_read_binary_file('postgresql.conf')",
    "pg_ls_dir": "SELECT * FROM pg_ls_dir('.')",
    "pg_ls_waldir": "SELECT * FROM pg_ls_waldir()",
    "pg_stat_file": "SELECT pg_stat_file('postgresql.conf')",
    "pg_terminate_backend": "SELECT pg_terminate_backend(1)",
    "query_to_xml": "SELECT query_to_xml('SELECT pg_notify(''a'', ''b'')', true, false, '')",
    "table_to_xml": "SELECT table_to_xml('pg_class', true, false, '')",
    "pg_stat_get_live_tuples": "SELECT pg_stat_get_live_tuples('tenant_data.invoices'::regclass)",
    "pg_relation_size": "SELECT pg_relation_size('tenant_data.invoices')",
    "inet_server_addr": "SELECT inet_server_addr()",
    "session_tenant": "SELECT fleet_sql.session_tenant()",
    "query_rows": "SELECT * FROM fleet_sql.query_rows('SELECT pg_notify(''a'', ''b'')', 1, 1) AS q (a text)",
    "pg_stat_user_tables": "SELECT relname, n_live_tup FROM pg_stat_user_tables",
    "pg_class": "SELECT relname, reltuples FROM pg_catalog.pg_class",
    "pg_locks": "SELECT * FROM pg_locks",
    "pg_settings": "SELECT name, setting FROM pg_settings",
}


@pytest.mark.parametrize(("name", "statement"), REACHING_OUT.items(), ids=list(REACHING_OUT))
async def test_a_statement_that_reaches_outside_its_rows_is_refused_naming_what(
    tools: SqlTools, name: str, statement: str
) -> None:
    target = name.split("_in_")[0].split("_quoted")[0]
    with raises_code("sql_refused", rf"the statement uses (function|relation) {target}\b"):
        await tools.query("acme", statement)


async def test_a_refused_notify_and_advisory_lock_have_no_effect(tools: SqlTools, pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        await admin.execute("LISTEN fleet_data")
        for statement in (REACHING_OUT["pg_notify"], REACHING_OUT["pg_notify_in_a_cte"]):
            with raises_code("sql_refused"):
                await tools.query("acme", statement)
        with raises_code("sql_refused"):
            await tools.execute(
                "acme",
                "UPDATE tenant_data.invoices SET amount = amount WHERE pg_notify('fleet_data', 'w') IS NULL",
                "notify-from-a-write",
                "attacker",
            )
        with raises_code("sql_refused"):
            await tools.query("acme", REACHING_OUT["pg_advisory_lock"])
        locks = await (
            await admin.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
        ).fetchone()
        assert locks == (0,)
        # The marker notification, sent after the attacks, is the first to arrive: none came before it.
        await admin.execute("NOTIFY fleet_data, 'marker'")
        received = [n.payload async for n in admin.notifies(timeout=10, stop_after=1)]
        assert received == ["marker"]
    assert (await tools.write_status("acme", "notify-from-a-write"))["status"] == "unknown"


async def test_statistics_do_not_reveal_another_tenants_row_count(tools: SqlTools, pg_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        async with admin.transaction():
            await admin.execute("SELECT set_config(%s, 'globex', true)", (OWNER_SETTING,))
            await admin.execute(
                "INSERT INTO tenant_data.invoices (tenant_id, customer, amount, issued_on, status)"
                " SELECT 'globex', 'Bulk', 1, now(), 'open' FROM generate_series(1, 4321)"
            )
        await admin.execute("ANALYZE tenant_data.invoices")
    total = str(4321 + len(DEMO_INVOICES["globex"]) + ACME_ROWS)
    for statement in (
        "SELECT relname, n_live_tup, n_tup_ins FROM pg_stat_user_tables",
        "SELECT relname, n_live_tup FROM pg_stat_all_tables WHERE schemaname = 'tenant_data'",
        "SELECT relname, n_tup_ins FROM pg_stat_xact_user_tables",
        "SELECT relname, heap_blks_read FROM pg_statio_user_tables",
        "SELECT reltuples, relpages FROM pg_class WHERE relname = 'invoices'",
        "SELECT pg_stat_get_live_tuples('tenant_data.invoices'::regclass)",
        "SELECT pg_stat_get_tuples_inserted('tenant_data.invoices'::regclass)",
        "SELECT pg_relation_size('tenant_data.invoices'), pg_table_size('tenant_data.invoices')",
        "SELECT n_distinct, most_common_freqs::text FROM pg_stats WHERE tablename = 'invoices'",
        "SELECT table_to_xml('pg_class', true, false, '')",
    ):
        with raises_code("sql_refused") as refused:
            await tools.query("acme", statement)
        assert total not in str(refused.value) and "4321" not in str(refused.value)
    assert (await tools.query("acme", "SELECT count(*) FROM tenant_data.invoices"))["rows"] == [[ACME_ROWS]]


async def test_ordinary_queries_still_work(tools: SqlTools) -> None:
    acme = DEMO_INVOICES["acme"]
    by_customer: dict[str, float] = {}
    for customer, amount, _, _ in acme:
        by_customer[customer] = by_customer.get(customer, 0.0) + amount
    result = await tools.query(
        "acme",
        "WITH totals AS (SELECT customer, sum(amount) AS total, count(*) AS n FROM tenant_data.invoices"
        " GROUP BY customer) SELECT customer, total, rank() OVER (ORDER BY total DESC) AS place"
        " FROM totals ORDER BY total DESC;",
    )
    assert result["columns"] == ["customer", "total", "place"]
    expected = sorted(by_customer.items(), key=lambda item: -item[1])
    assert [(r[0], r[1]) for r in result["rows"]] == [(c, pytest.approx(t)) for c, t in expected]
    assert [r[2] for r in result["rows"]] == list(range(1, len(expected) + 1))
    checks = {
        "SELECT 1 AS a, 2 AS a": [[1, 2]],
        "VALUES (1, 'x'), (2, 'y')": [[1, "x"], [2, "y"]],
        "SELECT upper(customer), length(customer) FROM tenant_data.invoices WHERE amount > 9000": [
            ["FABRIKAM", 8]
        ],
        "SELECT count(*) FILTER (WHERE status = 'paid') FROM tenant_data.invoices": [
            [sum(1 for *_, s in acme if s == "paid")]
        ],
        "SELECT string_agg(DISTINCT status, ',' ORDER BY status) FROM tenant_data.invoices": [
            [",".join(sorted({s for *_, s in acme}))]
        ],
        "SELECT i.customer FROM tenant_data.invoices i JOIN tenant_data.payments p"
        " ON p.amount = i.amount WHERE false": [],
        "SELECT g, g * 2 FROM generate_series(1, 3) g": [[1, 2], [2, 4], [3, 6]],
        "SELECT pg_sleep(0.01) IS NULL AS slept, pg_sleep(0) AS nothing": [[False, ""]],
        "SELECT ROW(1, 'a') AS pair, i FROM tenant_data.invoices i WHERE false": [],
        "SELECT jsonb_build_object('n', 1) ->> 'n', date_trunc('day', now()) <= now(), random() < 1": [
            ["1", True, True]
        ],
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'tenant_data'"
        " ORDER BY table_name": [["invoices"], ["payments"]],
        "SELECT * FROM (SELECT customer FROM tenant_data.invoices ORDER BY amount DESC LIMIT 1) t": [
            ["Fabrikam"]
        ],
    }
    for statement, rows in checks.items():
        assert (await tools.query("acme", statement))["rows"] == rows, statement


@pytest.fixture
async def capped_tools(pg_dsn: str) -> AsyncIterator[SqlTools]:
    """The tools with a 64 KiB result cap and a timeout long enough for a 200 MB value to be built."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        await ensure_schema(admin, writable=("invoices",))
        await seed_demo_data(admin)
    settings = settings_for(pg_dsn, statement_timeout_ms=120_000, sql_max_result_bytes=64 * 1024)
    pools = TenantPools(settings)
    try:
        yield SqlTools(pools, settings)
    finally:
        await pools.aclose()


async def test_a_giant_value_is_refused_before_it_reaches_the_tool_process(capped_tools: SqlTools) -> None:
    """The tools run in this process: it stands for the server process (tests/e2e measures that one)."""
    await capped_tools.query("acme", "SELECT 1")  # the pool and its connection exist before measuring
    with PeakGrowth() as growth, raises_code("result_too_large") as refused:
        await capped_tools.query("acme", "SELECT repeat('x', 200000000) AS big")
    assert "65536 bytes" in str(refused.value) and "0 rows" in str(refused.value)
    assert growth.mib < 50, f"the tool process grew by {growth.mib} MiB"


async def test_an_error_that_quotes_a_giant_value_does_not_reach_the_tool_process(
    capped_tools: SqlTools,
) -> None:
    await capped_tools.query("acme", "SELECT 1")
    with PeakGrowth() as growth, pytest.raises(FleetError, match="invalid input syntax") as refused:
        await capped_tools.query("acme", "SELECT repeat('x', 50000000)::int")
    assert len(str(refused.value)) < 1000
    assert growth.mib < 50, f"the tool process grew by {growth.mib} MiB"


async def test_many_moderate_rows_are_refused_at_the_cap(capped_tools: SqlTools) -> None:
    row_bytes = len("(" + "x" * 1000 + ")")  # a row's bytes: its text form
    fit = 64 * 1024 // row_bytes
    within = await capped_tools.query("acme", f"SELECT repeat('x', 1000) FROM generate_series(1, {fit})")
    assert within["row_count"] == fit and not within["truncated"]
    with raises_code("result_too_large") as refused:
        await capped_tools.query("acme", "SELECT repeat('x', 1000) FROM generate_series(1, 400)")
    assert f"{fit} rows ({fit * row_bytes} bytes) fit, the next row has {row_bytes} bytes" in str(
        refused.value
    )
    # The rows cap still applies below the byte cap.
    small = await capped_tools.query("acme", "SELECT g FROM generate_series(1, 600) g")
    assert small["row_count"] == 500 and small["truncated"]


async def test_an_error_that_quotes_a_long_value_is_cut_in_the_answer(tools: SqlTools) -> None:
    with raises_code("invalid_request") as refused:
        await tools.query("acme", "SELECT repeat('x', 100000)::int")
    assert len(str(refused.value)) < 1000
    # Settings that name the server's files stay Postgres's to refuse (tenant roles cannot read them).
    with pytest.raises(FleetError, match="permission denied to examine"):
        await tools.query("acme", "SELECT current_setting('data_directory')")
