"""The data-dir lock: who holds it can be asked without taking it, and it dies with its holder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetctl import stacklock

HOLD = """
import sys, time
from pathlib import Path
from fleetctl import stacklock
stacklock.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder_process(tmp_path: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "lock")], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "held"
    return process


def test_nobody_holds_a_lock_that_was_never_taken(tmp_path: Path) -> None:
    assert stacklock.holder(tmp_path / "lock") is None


def test_holder_is_reported_and_a_second_acquire_fails(
    tmp_path: Path, holder_process: subprocess.Popen[str]
) -> None:
    try:
        assert stacklock.holder(tmp_path / "lock") == holder_process.pid
        with pytest.raises(BlockingIOError):
            stacklock.acquire(tmp_path / "lock")
    finally:
        holder_process.kill()
        holder_process.wait()
        assert holder_process.stdout is not None
        holder_process.stdout.close()
    assert stacklock.holder(tmp_path / "lock") is None
    stacklock.release(stacklock.acquire(tmp_path / "lock"))
