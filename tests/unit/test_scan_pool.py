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
        self.order: list[str] = []  # the tenants of the jobs in the order they started

    def job(self, tenant: str) -> Callable[[], str]:
        def run() -> str:
            with self._lock:
                self.running[tenant] = self.running.get(tenant, 0) + 1
                self.order.append(tenant)
                self.most[tenant] = max(self.most.get(tenant, 0), self.running[tenant])
            self.release.wait(10)
            with self._lock:
                self.running[tenant] -= 1
            return tenant

        return run


async def started(jobs: Jobs, tenant: str, count: int = 1) -> None:
    async with asyncio.timeout(5):
        while jobs.running.get(tenant, 0) < count:  # noqa: ASYNC110  # set by scan threads: no event
            await asyncio.sleep(0.01)


async def test_a_tenant_alone_scans_on_every_thread() -> None:
    pool, jobs = ScanPool(threads=2), Jobs()
    try:
        pool.reserve("big", ["x"] * 3, ScanQuota())
        answers = [pool.submit("big", jobs.job("big")) for _ in range(3)]
        await started(jobs, "big", 2)  # no other tenant waits: its share is no limit
        jobs.release.set()
        await asyncio.gather(*answers)
        assert jobs.most == {"big": 2}
    finally:
        pool.shutdown()


async def test_once_another_tenant_waits_a_flooder_holds_no_more_than_its_share() -> None:
    pool, flood_jobs, victim_jobs = ScanPool(threads=2), Jobs(), Jobs()
    victim_jobs.order = flood_jobs.order  # one record of the order jobs started in
    try:
        pool.reserve("flooder", ["x"] * 6, ScanQuota())
        pool.reserve("victim", ["x"] * 2, ScanQuota())
        flood = [pool.submit("flooder", flood_jobs.job("flooder")) for _ in range(6)]
        await started(flood_jobs, "flooder", 2)  # alone: both threads
        victim = [pool.submit("victim", victim_jobs.job("victim")) for _ in range(2)]
        await asyncio.sleep(0.1)
        assert not victim_jobs.running  # no thread is free yet
        flood_jobs.release.set()  # the flooder's jobs end as soon as they start from now on
        assert await asyncio.gather(*flood) == ["flooder"] * 6
        victim_jobs.release.set()
        assert await asyncio.gather(*victim) == ["victim"] * 2
        # The first thread that freed up went to the victim (under its share), the next ones to the
        # flooder (the victim at its share while the flooder waited) until the flooder had no more.
        assert flood_jobs.order == ["flooder"] * 2 + ["victim"] + ["flooder"] * 4 + ["victim"]
    finally:
        pool.shutdown()
