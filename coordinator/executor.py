"""The coordinator's A2A executor: plan the request, run the graph under the task id, stream
progress, and return the results as an artifact."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
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
from a2a.types import InvalidParamsError, TaskState
from langchain_core.runnables import RunnableConfig
from langgraph.graph.state import CompiledStateGraph

from coordinator.delegation import Delegator
from coordinator.plan import Step, plan_request
from coordinator.runs import Lease, PostgresRunStore, RunState
from fleet.a2a_support import claims_of
from fleet.errors import ErrorCode, FleetError
from policy import PolicyEngine

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0


def _request_of(context: RequestContext) -> dict[str, Any]:
    """What the run was asked to do, as recorded on the run."""
    parts = list(context.message.parts) if context.message else []
    return {"text": " ".join(get_text_parts(parts)), "data": get_data_parts(parts)}


class CoordinatorExecutor(AgentExecutor):
    def __init__(
        self,
        graph: CompiledStateGraph[Any, Any, Any, Any],
        delegator: Delegator,
        engine: PolicyEngine,
        runs: PostgresRunStore,
        worker_id: str,
    ) -> None:
        self._graph = graph
        self._delegator = delegator
        self._engine = engine
        self._runs = runs
        self._worker_id = worker_id

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
        await self._runs.create_run(task.id, claims.tenant, claims.sub, _request_of(context))
        lease = await self._runs.acquire_lease(task.id, self._worker_id, LEASE_TTL_S)
        if lease is None:
            raise InvalidParamsError(
                message=f"[{ErrorCode.CONFLICT}] run {task.id} is already being worked on"
            )
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        try:
            async with self._heartbeat(lease):
                await self._execute(task.id, claims.tenant, steps, updater, lease)
        finally:
            await self._runs.release_lease(lease)

    @contextlib.asynccontextmanager
    async def _heartbeat(self, lease: Lease) -> AsyncIterator[None]:
        """Keep the lease alive while this worker advances the run."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(LEASE_TTL_S / 3)
                await self._runs.renew_lease(lease, LEASE_TTL_S)

        task = asyncio.create_task(renew(), name=f"lease-{lease.run_id}")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _execute(
        self, run_id: str, tenant: str, steps: list[Step], updater: TaskUpdater, lease: Lease
    ) -> None:
        actor = self._worker_id
        await self._runs.append(lease, "plan", actor, {"steps": [s.to_dict() for s in steps]})
        await self._runs.transition(lease, RunState.WORKING, actor, {})
        await updater.start_work(
            updater.new_agent_message([new_text_part(f"plan: {' -> '.join(s.skill for s in steps)}")])
        )
        try:
            final = await self._run(run_id, tenant, steps, updater, lease)
        except Exception:
            log.exception("run %s crashed", run_id)
            await self._runs.transition(
                lease, RunState.FAILED, actor, {"message": "the run crashed"}, reason=ErrorCode.INTERNAL
            )
            await updater.failed(
                updater.new_agent_message([new_text_part(f"[{ErrorCode.INTERNAL}] the run crashed")])
            )
            return
        failure = final.get("failure")
        if failure:
            text = f"[{failure['code']}] step {failure['step']} ({failure['skill']}) failed: {failure['message']}"
            await self._runs.transition(lease, RunState.FAILED, actor, {"failure": failure}, failure["code"])
            await updater.failed(
                updater.new_agent_message([new_text_part(text), new_data_part({"failure": failure})])
            )
            return
        results = final.get("results", {})
        summary = "; ".join(f"{o['step']} by {o['agent']}" for o in final.get("outcomes", []))
        await self._runs.append(lease, "artifact", actor, {"name": "result", "steps": sorted(results)})
        await self._runs.transition(lease, RunState.COMPLETED, actor, {"summary": summary})
        await updater.add_artifact(
            [new_text_part(f"completed {len(results)} steps: {summary}"), new_data_part({"steps": results})],
            name="result",
            last_chunk=True,
        )
        await updater.complete()

    async def _run(
        self, run_id: str, tenant: str, steps: list[Step], updater: TaskUpdater, lease: Lease
    ) -> dict[str, Any]:
        config: RunnableConfig = {"configurable": {"thread_id": run_id}}
        initial = {
            "run_id": run_id,
            "tenant": tenant,
            "steps": [s.to_dict() for s in steps],
            "cursor": 0,
            "results": {},
            "assignment": None,
            "failure": None,
        }
        final: dict[str, Any] = {}
        stream = self._graph.astream(initial, config, stream_mode=["custom", "values"], version="v2")
        async for part in stream:
            if part["type"] == "custom":
                report = part["data"]
                await self._runs.append(lease, report["event"], self._worker_id, report["payload"])
                if report["text"]:
                    await updater.update_status(
                        TaskState.TASK_STATE_WORKING,
                        message=updater.new_agent_message([new_text_part(report["text"])]),
                    )
            elif part["type"] == "values":
                final = dict(part["data"])
        return final

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        if context.current_task is not None:
            updater = TaskUpdater(event_queue, context.current_task.id, context.current_task.context_id)
            await updater.cancel()
