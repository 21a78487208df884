"""A specialist built with the kit and served by the test itself (in its process, on a port of its
own), enrolled with a one-time token from the operator and registered with the stack's registry as
any specialist is: for tests that need a specialist the fleet does not ship (a broken release, a
skill that asks a person, one with a small budget)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import uvicorn

from fleet.settings import ServiceSettings
from fleetctl.testing.e2e import Stack, fleet
from specialists.kit import Skill, build_specialist_app


@contextlib.asynccontextmanager
async def kit_agent(
    stack: Stack,
    home: Path,
    skills: Sequence[Skill],
    *,
    version: str = "1.0.0",
    scopes: Sequence[str] = (),
) -> AsyncIterator[str]:
    """Serve ``skills`` as a new specialist (with ``scopes`` beyond the registry's; its enrollment
    names the skills, as the operator's would); yields its id once discovery offers it, and stops
    it after."""
    agent_id = f"kit-{uuid.uuid4().hex[:6]}"
    wanted = ["registry:read", "registry:write", *scopes]
    issued = fleet(
        "keys", "enrollment-token", agent_id, "--data-dir", stack.data_dir, "--tenant", "*",
        *[arg for scope in wanted for arg in ("--scope", scope)],
        *[arg for skill in skills for arg in ("--skill", skill.id)], timeout=60,
    )  # fmt: skip
    assert issued.returncode == 0, issued.stderr
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    settings = ServiceSettings(
        service_id=agent_id,
        home=home,
        key_file=home / f"{agent_id}.key",
        public_url=base,
        registry_url=stack.endpoints["registry"],
        nats_url=stack.endpoints["nats"],
        enrollment_token=issued.stdout.strip(),
        operator_jwk_file=stack.layout.operator_jwk_file,
        heartbeat_s=0,
    )
    app = build_specialist_app(
        settings, name=agent_id, description="a test's", version=version, skills=skills
    )
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        token = stack.token("registry", scopes=("registry:read",))
        async with asyncio.timeout(60), httpx.AsyncClient() as http:
            while True:
                found = await http.get(
                    f"{stack.endpoints['registry']}/v1/agents",
                    params={"skill": skills[0].id},
                    headers={"Authorization": f"Bearer {token}"},
                )
                if any(a["id"] == agent_id for a in found.json()["agents"]):
                    break
                await asyncio.sleep(0.1)  # registration is another process's; nothing to wait on
        yield agent_id
    finally:
        server.should_exit = True
        await serving
