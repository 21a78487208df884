"""The coordinator's A2A request handler: the SDK's, with cancel made idempotent."""

from __future__ import annotations

from a2a.server.context import ServerCallContext
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.types import CancelTaskRequest, GetTaskRequest, Task, TaskState


class CoordinatorRequestHandler(DefaultRequestHandler):
    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task | None:
        """Canceling a canceled task answers with the task as it is (the SDK would refuse): a client
        that retries a cancel after a lost response must not see an error."""
        current: Task | None = await self.on_get_task(GetTaskRequest(id=params.id), context)
        if current is not None and current.status.state == TaskState.TASK_STATE_CANCELED:
            return current
        result: Task | None = await super().on_cancel_task(params, context)
        return result
