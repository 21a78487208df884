"""The scan pool's shares: a tenant's jobs hold at most its ``max_threads`` scan threads at once, so
another tenant's job finds a thread free however many the first has queued."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from memory.scan_pool import ScanPool, ScanQuota


class Jobs:
    """Jobs that block until released, counting how many of each tenant's run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.running: dict[str, int] = {}
        self.most: dict[str, int] = {}

    def job(self, tenant: str) -> Callable[[], str]:
        def run() -> str:
            with self._lock:
                self.running[tenant] = self.running.get(tenant, 0) + 1
                self.most[tenant] = max(self.most.get(tenant, 0), self.running[tenant])
            self.release.wait(10)
            with self._lock:
                self.running[tenant] -= 1
            return tenant

        return run


async def started(jobs: Jobs, tenant: str) -> None:
    async with asyncio.timeout(5):
        while not jobs.running.get(tenant):  # noqa: ASYNC110  # set by a scan thread: no event
            await asyncio.sleep(0.01)


async def test_a_tenant_holds_at_most_one_thread_by_default_and_another_gets_the_free_one() -> None:
    pool, jobs = ScanPool(threads=2), Jobs()
    try:
        pool.reserve("flooder", ["x"] * 4, ScanQuota())
        pool.reserve("victim", ["x"], ScanQuota())
        flood = [pool.submit("flooder", jobs.job("flooder")) for _ in range(4)]
        await started(jobs, "flooder")
        victim = pool.submit("victim", jobs.job("victim"))
        await started(jobs, "victim")  # a thread was free although the flooder has three queued
        assert jobs.running == {"flooder": 1, "victim": 1}
        jobs.release.set()
        assert await asyncio.gather(victim, *flood) == ["victim"] + ["flooder"] * 4
        assert jobs.most == {"flooder": 1, "victim": 1}
    finally:
        pool.shutdown()


async def test_a_tenant_given_more_threads_uses_them_when_it_is_alone() -> None:
    pool, jobs = ScanPool(threads=2), Jobs()
    try:
        pool.reserve("big", ["x"] * 3, ScanQuota(max_threads=2))
        answers = [pool.submit("big", jobs.job("big")) for _ in range(3)]
        async with asyncio.timeout(5):
            while jobs.running.get("big", 0) < 2:  # noqa: ASYNC110  # set by scan threads
                await asyncio.sleep(0.01)
        jobs.release.set()
        await asyncio.gather(*answers)
        assert jobs.most == {"big": 2}
    finally:
        pool.shutdown()
