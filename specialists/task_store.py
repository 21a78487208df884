"""The specialist's A2A task store: tasks in memory, finished ones kept for a while and then dropped.

The SDK's :class:`InMemoryTaskStore` keeps every task for the life of the process, so a caller who
sends enough tasks grows the specialist without bound. Here a finished task (completed, failed,
canceled, rejected) is kept for ``keep_s`` seconds and at most ``keep_finished`` of them are kept,
the oldest dropped first; a running task is never dropped. What a task did is not lost with it: an
operation's outcome lives in the journal (:mod:`specialists.journal`), which a caller asks by
operation id.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from a2a.server.context import ServerCallContext
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import a2a_pb2
from a2a.types.a2a_pb2 import Task, TaskState

KEEP_S = 3600.0
KEEP_FINISHED = 10_000
FINISHED = frozenset(
    {
        TaskState.TASK_STATE_COMPLETED,
        TaskState.TASK_STATE_FAILED,
        TaskState.TASK_STATE_CANCELED,
        TaskState.TASK_STATE_REJECTED,
    }
)


class BoundedTaskStore(InMemoryTaskStore):
    """An in-memory task store that forgets finished tasks after ``keep_s`` seconds, and keeps at most
    ``keep_finished`` of them."""

    def __init__(self, keep_s: float = KEEP_S, keep_finished: int = KEEP_FINISHED) -> None:
        super().__init__()
        self._keep_s = keep_s
        self._keep_finished = keep_finished
        # (task id, owner's context) of finished tasks, oldest first, with when each finished.
        self._finished: OrderedDict[str, tuple[float, ServerCallContext]] = OrderedDict()

    async def save(self, task: Task, context: ServerCallContext) -> None:
        await super().save(task, context)
        if task.status.state in FINISHED:
            self._finished.pop(task.id, None)
            self._finished[task.id] = (time.monotonic(), context)
        await self._forget(time.monotonic())

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        self._finished.pop(task_id, None)
        await super().delete(task_id, context)

    async def list(
        self, params: a2a_pb2.ListTasksRequest, context: ServerCallContext
    ) -> a2a_pb2.ListTasksResponse:
        await self._forget(time.monotonic())
        return await super().list(params, context)

    @property
    def finished(self) -> int:
        """How many finished tasks are kept now."""
        return len(self._finished)

    async def _forget(self, now: float) -> None:
        while self._finished:
            task_id, (finished_at, context) = next(iter(self._finished.items()))
            if len(self._finished) <= self._keep_finished and now - finished_at < self._keep_s:
                return
            del self._finished[task_id]
            await super().delete(task_id, context)
