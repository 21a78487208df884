"""The coordinator's A2A executor: plan the request, create the run (its id is the task id), hand it
to the workers, and relay the run's progress and result to the caller."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from a2a.helpers import (
    get_data_parts,
    get_text_parts,
    new_data_part,
    new_task_from_user_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import InvalidParamsError, TaskNotCancelableError, TaskNotFoundError, TaskState

from coordinator.delegation import Delegator
from coordinator.plan import Step, plan_request
from coordinator.runs import TERMINAL_STATES, PostgresRunStore, RunState
from fleet.a2a_support import claims_of
from fleet.errors import ErrorCode, FleetError
from policy import PolicyEngine

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 60.0
TERMINAL_NAMES = {state.value for state in TERMINAL_STATES}


def _request_of(context: RequestContext) -> dict[str, Any]:
    """What the run was asked to do, as recorded on the run."""
    parts = list(context.message.parts) if context.message else []
    return {"text": " ".join(get_text_parts(parts)), "data": get_data_parts(parts)}


class CoordinatorExecutor(AgentExecutor):
    """The A2A side of a run: plan, create the run, hand it to the workers, and relay its event log
    to the caller. The run itself is advanced by a worker, so it outlives this process and this
    connection: closing the stream never cancels it."""

    def __init__(
        self,
        delegator: Delegator,
        engine: PolicyEngine,
        runs: PostgresRunStore,
        submit: Callable[[str], Awaitable[None]],
        listen_dsn: str,
    ) -> None:
        self._delegator = delegator
        self._engine = engine
        self._runs = runs
        self._submit = submit
        self._listen_dsn = listen_dsn

    async def _plan(self, context: RequestContext, tenant: str) -> list[Step]:
        """Plan and check that every skill has a specialist, before the run is accepted."""
        message = context.message
        parts = list(message.parts) if message else []
        try:
            steps = plan_request(get_data_parts(parts), " ".join(get_text_parts(parts)), self._engine, tenant)
            for step in steps:
                if not await self._delegator.discover(step.skill):
                    raise FleetError(ErrorCode.NO_SPECIALIST, f"no specialist offers skill {step.skill!r}")
        except FleetError as exc:
            raise InvalidParamsError(
                message=f"[{exc.code}] {exc.message}", data={"code": str(exc.code)}
            ) from exc
        return steps

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        claims = claims_of(context.call_context)
        steps = await self._plan(context, claims.tenant)
        assert context.message is not None
        task = context.current_task or new_task_from_user_message(context.message)
        plan = [s.to_dict() for s in steps]
        await self._runs.create_run(task.id, claims.tenant, claims.sub, _request_of(context), plan)
        try:
            await self._submit(task.id)
        except Exception:  # the run is durable already: the workers' sweep re-submits it
            log.warning("could not submit run %s; the stranded-run sweep will", task.id, exc_info=True)
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await self._relay(task.id, claims.tenant, steps, updater)

    async def _relay(self, run_id: str, tenant: str, steps: list[Step], updater: TaskUpdater) -> None:
        """Turn the run's events into A2A updates until the run ends."""
        artifact: dict[str, Any] = {}
        async for event in self._runs.follow(run_id, tenant, 0, self._listen_dsn):
            payload = event.payload
            if event.type == "run.working":
                plan_text = f"plan: {' -> '.join(s.skill for s in steps)}"
                await updater.start_work(updater.new_agent_message([new_text_part(plan_text)]))
            elif event.type.startswith("step.") and payload.get("text"):
                await updater.update_status(
                    TaskState.TASK_STATE_WORKING,
                    message=updater.new_agent_message([new_text_part(str(payload["text"]))]),
                )
            elif event.type == "artifact":
                artifact = payload
            elif event.type == "run.completed":
                await updater.add_artifact(
                    [
                        new_text_part(str(artifact.get("text", ""))),
                        new_data_part({"steps": artifact.get("steps", {})}),
                    ],
                    name="result",
                    last_chunk=True,
                )
                await updater.complete()
            elif event.type == "run.failed":
                parts = [new_text_part(str(payload.get("text", "the run failed")))]
                if "failure" in payload:
                    parts.append(new_data_part({"failure": payload["failure"]}))
                await updater.failed(updater.new_agent_message(parts))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """Ask the run to cancel and wait until it has stopped: the task then ends ``canceled``, or,
        if the run finished first, keeps the one terminal state it reached."""
        task = context.current_task
        if task is None:
            raise TaskNotFoundError
        claims = claims_of(context.call_context)
        await self._runs.request_cancel(task.id, claims.tenant, claims.sub)
        state = RunState.CANCELED
        async with asyncio.timeout(CANCEL_TIMEOUT_S):
            async for event in self._runs.follow(task.id, claims.tenant, 0, self._listen_dsn):
                if event.type.startswith("run.") and event.type.removeprefix("run.") in TERMINAL_NAMES:
                    state = RunState(event.type.removeprefix("run."))
        if state != RunState.CANCELED:
            raise TaskNotCancelableError(message=f"the run already ended {state.value}")
        await TaskUpdater(event_queue, task.id, task.context_id).cancel()
