"""``fleet up`` in the background: a supervisor started as a process of its own session, and the
wait for its report that the stack is healthy (``fleet up --detach`` and ``fleet demo`` use it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fleet.errors import ErrorCode, FleetError
from fleetctl.cli_common import EXIT_FAILED, EXIT_OK, report_error
from fleetctl.layout import StackLayout


def up_detached(layout: StackLayout, *, tls: bool = False, manifest: Path | None = None) -> int:
    """Start a supervisor in the background (of the fleet ``manifest`` declares, if given) and
    return once it reports the stack healthy."""
    layout.prepare()
    read_fd, write_fd = os.pipe()
    with layout.log_file("supervisor").open("a") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleetctl",
                "up",
                "--data-dir",
                str(layout.home),
                "--ready-fd",
                str(write_fd),
                *(["--tls"] if tls else []),
                *(["--manifest", str(manifest)] if manifest is not None else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    os.close(write_fd)
    with os.fdopen(read_fd) as ready:
        line = ready.readline()
        while line and "progress" in (step := json.loads(line)):  # a line per step, as it comes
            print(f"fleet: {step['progress']}", file=sys.stderr, flush=True)
            line = ready.readline()
    if not line:
        code = process.wait()
        print(
            f"fleet: the supervisor exited ({code}) before the stack was up; see "
            f"{layout.log_file('supervisor')}:\n{layout.log_tail('supervisor')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    report: dict[str, Any] = json.loads(line)
    if not report.get("ok"):  # the supervisor's error, as data
        return report_error(
            FleetError.from_dict(report.get("error"), fallback=ErrorCode.STACK_FAILED), as_json=False
        )
    print_endpoints(report["endpoints"])
    print(f"fleet: stack is up in the background (pid {process.pid}); `fleet down` stops it")
    return EXIT_OK


def print_endpoints(endpoints: dict[str, Any]) -> None:
    print(f"data dir     {endpoints['data_dir']}")
    print(f"nats         {endpoints['nats']}")
    print(f"registry     {endpoints['registry']}")
    print(f"coordinator  {endpoints['coordinator']}")
    if "console" in endpoints:
        print(f"console      {endpoints['console']}  (sign in: fleet console)")
    for name, url in endpoints["specialists"].items():
        print(f"specialist   {name:<14} {url}")
    for name, url in endpoints["mcp_servers"].items():
        print(f"mcp server   {name:<14} {url}")
    print(f"endpoints    {Path(endpoints['data_dir']) / 'endpoints.json'}", flush=True)
