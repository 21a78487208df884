"""Memory's tests scan and embed in threads, and a cyclic garbage collection can start in any
thread. A policy engine (regorus) left over from an earlier test must not be collected there: it may
only be dropped on the thread that made it. So garbage is collected here, on the main thread, before
and after each test."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def collect_on_the_main_thread() -> Iterator[None]:
    gc.collect()
    yield
    gc.collect()
