"""A specialist forgets finished tasks after a while and keeps a bounded number of them, so that a
caller who sends many tasks cannot grow it without bound; a running task is never forgotten."""

from __future__ import annotations

from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.types.a2a_pb2 import ListTasksRequest, Task, TaskState, TaskStatus

from specialists.task_store import BoundedTaskStore


class _Caller(User):
    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def user_name(self) -> str:
        return self._name


def _context(name: str) -> ServerCallContext:
    return ServerCallContext(user=_Caller(name))


def _task(task_id: str, state: TaskState) -> Task:
    return Task(id=task_id, context_id="c", status=TaskStatus(state=state))


async def test_only_the_newest_finished_tasks_are_kept() -> None:
    store = BoundedTaskStore(keep_s=3600, keep_finished=3)
    a, b = _context("acme/alice"), _context("globex/bob")
    await store.save(_task("running", TaskState.TASK_STATE_WORKING), a)
    for n in range(6):
        await store.save(_task(f"t{n}", TaskState.TASK_STATE_COMPLETED), a if n % 2 else b)
    assert store.finished == 3
    assert await store.get("t0", b) is None and await store.get("t1", a) is None
    assert (await store.get("t5", a)) is not None and (await store.get("t4", b)) is not None
    assert (await store.get("running", a)) is not None
    listed = await store.list(ListTasksRequest(), a)
    assert sorted(t.id for t in listed.tasks) == ["running", "t3", "t5"]


async def test_finished_tasks_are_forgotten_after_keep_s() -> None:
    store = BoundedTaskStore(keep_s=0.0, keep_finished=100)
    caller = _context("acme/alice")
    await store.save(_task("working", TaskState.TASK_STATE_WORKING), caller)
    await store.save(_task("done", TaskState.TASK_STATE_FAILED), caller)
    await store.save(_task("working", TaskState.TASK_STATE_INPUT_REQUIRED), caller)
    assert await store.get("done", caller) is None
    assert (await store.get("working", caller)) is not None
    assert store.finished == 0
