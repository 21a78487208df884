"""Fixtures shared by every test: a real Postgres and a real NATS, started by the tests themselves."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from deploy.infra import as_user, prepare_postgres

# The folders whose tests start a whole stack (or a cluster of them, or hosts of namespaces): marked e2e, so that
# ``-m "not e2e"`` (``scripts/dev fast``) runs the rest, which start at most NATS or Postgres.
STACK_FOLDERS = ("e2e", "cluster", "netlab")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "measure: minutes of CPU and no stack; the full suite runs it, the fast tier does not"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).parent
    for item in items:
        if item.path.relative_to(tests_dir).parts[0] in STACK_FOLDERS:
            item.add_marker(pytest.mark.e2e)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(dsn: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            psycopg.connect(dsn, connect_timeout=2).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The DSN of a Postgres superuser: ``FLEET_TEST_PG_DSN`` if set, else an embedded server."""
    given = os.environ.get("FLEET_TEST_PG_DSN")
    if given:
        yield given
        return
    launch = prepare_postgres(tmp_path_factory.mktemp("pg") / "data", _free_port(), "test-password")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    process = subprocess.Popen(launch.argv, **as_user(launch.user), **quiet)
    try:
        _wait_for(launch.dsn)
        yield launch.dsn
    finally:
        process.send_signal(2)  # SIGINT: fast shutdown
        process.wait(timeout=30)


@pytest.fixture
def pg_dsn(pg_server: str) -> Iterator[str]:
    """A fresh, empty database for one test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(pg_server, dbname=name)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """A real NATS server with JetStream, started for the session (``fleetctl/testing/nats.py``)."""
    from fleetctl.testing.nats import embedded_nats

    with embedded_nats() as url:
        yield url
