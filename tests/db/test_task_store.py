"""A2A tasks derived from runs, and push configs, on a real Postgres: the fold of every kind of event,
tenancy and ownership in SQL (with the real policy deciding reach), context ownership, paging,
retention, and the push URL policy."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from a2a.server.context import ServerCallContext
from a2a.types import (
    AuthenticationInfo,
    ListTasksRequest,
    Message,
    Part,
    Role,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError
from psycopg_pool import AsyncConnectionPool

from coordinator.a2a_surface.push import PostgresPushConfigStore, PushUrlPolicy
from coordinator.a2a_surface.task_events import event_id_of
from coordinator.a2a_surface.task_store import PostgresTaskStore
from coordinator.record.access import RunAccess
from coordinator.record.runs import Lease, PostgresRunStore, RunState
from fleet.a2a_support import error_of_a2a
from fleet.errors import FleetError
from fleet.tokens import Claims
from policy import Bundle, RegorusEngine

ACCESS = RunAccess(RegorusEngine(Bundle.load()))


def caller(tenant: str, sub: str = "operator", *scopes: str) -> ServerCallContext:
    claims = Claims(sub, tenant, "coordinator", frozenset({"agent:invoke", *scopes}), "jti", 0, {})
    return ServerCallContext(state={"claims": claims})


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True}
    )
    async with pool:
        yield pool


@pytest.fixture
async def runs(pool: AsyncConnectionPool[Any]) -> PostgresRunStore:
    store = PostgresRunStore(pool)
    await store.setup()
    return store


@pytest.fixture
async def tasks(pool: AsyncConnectionPool[Any], runs: PostgresRunStore) -> PostgresTaskStore:
    store = PostgresTaskStore(pool, runs, ACCESS)
    await store.setup()
    await store.setup()  # idempotent
    return store


async def new_task(
    runs: PostgresRunStore, tasks: PostgresTaskStore, task_id: str, tenant: str = "acme"
) -> Lease:
    """A run with its A2A record, leased by a worker."""
    await runs.create_run(task_id, tenant, "operator", {"text": "hi"}, [{"id": "s", "skill": "x"}])
    request = Message(role=Role.ROLE_USER, message_id="m1", parts=[Part(text="hi")])
    await tasks.save(Task(id=task_id, context_id=f"ctx-{task_id}", history=[request]), caller(tenant))
    lease = await runs.acquire_lease(task_id, "w", ttl_s=30)
    assert lease is not None
    return lease


def texts(task: Task) -> list[str]:
    return [part.text for message in [*task.history, task.status.message] for part in message.parts]


async def test_a_task_is_the_fold_of_its_runs_events_of_every_kind(
    runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    lease = await new_task(runs, tasks, "r1")
    await runs.transition(lease, RunState.WORKING, "w", {})
    await runs.append(
        lease, "step.started", "w", {"step": "s", "skill": "x", "agent": "a1"}
    )  # text made here
    await runs.append(lease, "operation.intent", "w", {"operation": "op1"})  # nothing to show
    await runs.append(lease, "operation.needs_human", "w", {"text": "cannot tell if op1 ran"})
    await runs.transition(lease, RunState.WAITING, "w", {"text": "approve the refund?"})
    task = await tasks.get("r1", caller("acme"))
    assert task is not None
    assert task.context_id == "ctx-r1"
    assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert texts(task) == [
        "hi",
        "plan: x",
        "step s: x -> a1",
        "cannot tell if op1 ran",
        "approve the refund?",
    ]
    assert event_id_of(task.metadata) == 6

    # A person's answer hands the run back (it names the state it moves the run to), then it works.
    await runs.append(lease, "operation.resolved", "w", {"state": "submitted", "text": "resolved: ok"})
    resolved = await tasks.get("r1", caller("acme"))
    assert resolved is not None and resolved.status.state == TaskState.TASK_STATE_SUBMITTED
    await runs.transition(lease, RunState.WORKING, "w", {})
    await runs.append(lease, "artifact", "w", {"name": "result", "text": "done", "steps": {"s": 1}})
    await runs.transition(lease, RunState.COMPLETED, "w", {})
    task = await tasks.get("r1", caller("acme"))
    assert task is not None and task.status.state == TaskState.TASK_STATE_COMPLETED
    [artifact] = task.artifacts
    assert (artifact.name, artifact.parts[0].text) == ("result", "done")
    assert artifact.parts[1].data.struct_value["steps"]["s"] == 1
    # The same fold, stopped at an earlier event, is the task as it stood then.
    earlier = await tasks.fold("r1", "acme", upto=4)
    assert earlier is not None and earlier.state == TaskState.TASK_STATE_WORKING
    assert earlier.seq == 4


async def test_another_tenant_finds_no_task_and_saves_nothing(
    runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    await new_task(runs, tasks, "r1")
    assert await tasks.get("r1", caller("globex")) is None
    assert await tasks.fold("r1", "globex") is None
    await tasks.save(Task(id="r1", context_id="hijack"), caller("globex"))
    task = await tasks.get("r1", caller("acme"))
    assert task is not None and task.context_id == "ctx-r1"
    assert (await tasks.list(ListTasksRequest(), caller("globex"))).tasks == []


async def test_list_pages_by_last_update_and_filters_in_sql(
    runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    leases = [await new_task(runs, tasks, f"r{n}") for n in range(5)]
    await new_task(runs, tasks, "theirs", tenant="globex")
    await runs.transition(leases[1], RunState.WORKING, "w", {})  # r1 is now the most recently updated
    page = await tasks.list(ListTasksRequest(page_size=2), caller("acme"))
    assert [t.id for t in page.tasks] == ["r1", "r4"]
    assert page.total_size == 5
    ids = [t.id for t in page.tasks]
    while page.next_page_token:
        page = await tasks.list(
            ListTasksRequest(page_size=2, page_token=page.next_page_token), caller("acme")
        )
        ids += [t.id for t in page.tasks]
    assert ids == ["r1", "r4", "r3", "r2", "r0"]
    working = await tasks.list(ListTasksRequest(status=TaskState.TASK_STATE_WORKING), caller("acme"))
    assert [t.id for t in working.tasks] == ["r1"]
    by_context = await tasks.list(ListTasksRequest(context_id="ctx-r3"), caller("acme"))
    assert [t.id for t in by_context.tasks] == ["r3"]
    with pytest.raises(InvalidParamsError):
        await tasks.list(ListTasksRequest(page_token="garbage"), caller("acme"))


async def test_retention_folds_old_events_into_a_snapshot_and_keeps_the_end(
    runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    lease = await new_task(runs, tasks, "r1")
    await runs.transition(lease, RunState.WORKING, "w", {})
    await runs.append(lease, "step.progress", "w", {"text": "halfway"})
    await runs.append(lease, "artifact", "w", {"name": "result", "text": "done"})
    await runs.transition(lease, RunState.COMPLETED, "w", {})
    before = await tasks.get("r1", caller("acme"))
    assert await tasks.compact(older_than_s=0) == 1
    assert await tasks.compact(older_than_s=0) == 0  # nothing left to prune
    assert await tasks.get("r1", caller("acme")) == before
    assert [e.type for e in await runs.events_after("r1", "acme", 0)] == ["run.completed"]
    fold = await tasks.fold("r1", "acme", upto=2)
    assert fold is not None and fold.base == 4 and fold.seq == 4  # cannot go back before retention


async def test_push_configs_are_tenant_scoped_and_hide_credentials(pool: AsyncConnectionPool[Any]) -> None:
    store = PostgresPushConfigStore(pool, PushUrlPolicy(["127.0.0.1:9000"]), ACCESS)
    await PostgresRunStore(pool).setup()
    await store.setup()
    config = TaskPushNotificationConfig(
        url="http://127.0.0.1:9000/hook", authentication=AuthenticationInfo(scheme="Bearer", credentials="s")
    )
    shown = await store.set_info("t1", config, caller("acme"))
    assert (shown.id, shown.task_id, shown.authentication.credentials) == ("t1", "t1", "")
    assert [c.url for c in await store.get_info("t1", caller("acme"))] == ["http://127.0.0.1:9000/hook"]
    assert await store.get_info("t1", caller("globex")) == []
    await store.delete_info("t1", caller("globex"))
    assert len(await store.get_info("t1", caller("acme"))) == 1
    await store.delete_info("t1", caller("acme"), "t1")
    await store.delete_info("t1", caller("acme"), "t1")
    assert await store.get_info("t1", caller("acme")) == []
    with pytest.raises(InvalidParamsError) as refused:
        await store.set_info("t1", TaskPushNotificationConfig(url="http://127.0.0.1:9001/"), caller("acme"))
    assert error_of_a2a(refused.value).code == "push_url_refused"


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://127.0.0.1:9000/x", True),  # allowed host:port
        ("http://127.0.0.1:9001/x", False),  # same host, another port
        ("https://10.0.0.1/x", False),
        ("http://169.254.169.254/", False),
        ("http://[::ffff:127.0.0.1]:9000/", False),  # an IPv4-mapped loopback is still loopback
        ("ftp://127.0.0.1:9000/", False),
        ("http://a:b@127.0.0.1:9000/", False),
        ("http://hooks.internal/x", True),  # allowed host, any port
    ],
)
async def test_the_push_url_policy_refuses_internal_targets_unless_allowed(url: str, allowed: bool) -> None:
    policy = PushUrlPolicy(["127.0.0.1:9000", "hooks.internal", " "])
    if allowed:
        await policy.check(url)
    else:
        with pytest.raises(FleetError) as caught:
            await policy.check(url)
        assert caught.value.code == "push_url_refused"


async def test_another_principal_of_the_tenant_finds_no_task_and_lists_none_but_an_admin_does(
    runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    await new_task(runs, tasks, "mine")  # started by "operator"
    bob, admin = caller("acme", "bob"), caller("acme", "auditor", "runs:admin")
    assert await tasks.get("mine", bob) is None  # as for a task that does not exist
    assert await tasks.get("nothing", bob) is None
    listed = await tasks.list(ListTasksRequest(), bob)
    assert (list(listed.tasks), listed.total_size) == ([], 0)
    by_context = await tasks.list(ListTasksRequest(context_id="ctx-mine"), bob)
    assert list(by_context.tasks) == []
    assert await runs.events_after("mine", "acme", 0, owner="bob") == []
    assert (found := await tasks.get("mine", admin)) is not None and found.id == "mine"
    assert [t.id for t in (await tasks.list(ListTasksRequest(), admin)).tasks] == ["mine"]
    assert [t.id for t in (await tasks.list(ListTasksRequest(), caller("acme"))).tasks] == ["mine"]


async def test_a_context_belongs_to_the_principal_and_tenant_that_made_it(
    runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    await tasks.claim_context("c-1", "acme", "alice")
    await tasks.claim_context("c-1", "acme", "alice")  # its own: again and again
    for tenant, owner in (("acme", "bob"), ("globex", "alice")):
        with pytest.raises(FleetError) as caught:
            await tasks.claim_context("c-1", tenant, owner)
        assert caught.value.code == "context_refused"
    # A context recorded before contexts were owned is its first task's principal's.
    await new_task(runs, tasks, "old")  # operator's, in context ctx-old, with no claim yet
    with pytest.raises(FleetError):
        await tasks.claim_context("ctx-old", "acme", "bob")
    await tasks.claim_context("ctx-old", "acme", "operator")


async def test_push_configs_of_another_principals_task_are_neither_set_nor_shown(
    pool: AsyncConnectionPool[Any], runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    store = PostgresPushConfigStore(pool, PushUrlPolicy(["127.0.0.1:9000"]), ACCESS)
    await store.setup()
    await new_task(runs, tasks, "theirs")  # started by "operator"
    hook = TaskPushNotificationConfig(url="http://127.0.0.1:9000/hook")
    await store.set_info("theirs", hook, caller("acme", "bob"))  # the SDK refuses first; this too
    assert await store.get_info("theirs", caller("acme", "operator")) == []
    await store.set_info("theirs", hook, caller("acme"))
    assert await store.get_info("theirs", caller("acme", "bob")) == []
    await store.delete_info("theirs", caller("acme", "bob"))
    assert len(await store.get_info("theirs", caller("acme", "auditor", "runs:admin"))) == 1


async def _recorded(pool: AsyncConnectionPool[Any], task_id: str) -> int:
    async with pool.connection() as conn:
        row = await (
            await conn.execute("SELECT count(*) FROM fleet_runs.a2a_tasks WHERE task_id = %s", (task_id,))
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_task_is_recorded_by_its_first_save_and_the_saves_after_write_nothing(
    pool: AsyncConnectionPool[Any], runs: PostgresRunStore, tasks: PostgresTaskStore
) -> None:
    """The SDK saves a task at every event it relays; only the first save writes. A save before
    the task's run exists records nothing and is not remembered as done."""
    request = Message(role=Role.ROLE_USER, message_id="m1", parts=[Part(text="hi")])
    task = Task(id="saved-once", context_id="ctx-saved-once", history=[request])
    await tasks.save(task, caller("acme"))  # no run yet: nothing recorded
    assert await _recorded(pool, "saved-once") == 0
    await runs.create_run("saved-once", "acme", "operator", {"text": "hi"}, [{"id": "s", "skill": "x"}])
    await tasks.save(task, caller("acme"))
    assert await _recorded(pool, "saved-once") == 1
    async with pool.connection() as conn:  # the record gone behind the store's back ...
        await conn.execute("DELETE FROM fleet_runs.a2a_tasks WHERE task_id = %s", ("saved-once",))
    for _ in range(3):
        await tasks.save(task, caller("acme"))
    assert await _recorded(pool, "saved-once") == 0  # ... is not written again: no statement was sent
    # Another store (another coordinator process) knows nothing of it, and writes.
    await PostgresTaskStore(pool, runs, ACCESS).save(task, caller("acme"))
    assert await _recorded(pool, "saved-once") == 1
