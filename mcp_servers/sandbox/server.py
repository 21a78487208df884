"""The sandbox MCP server: untrusted Python, run in bubblewrap (see ``runner``), with a workspace per run.

The workspace of a run is what its calls leave in ``/work``. After each call it is kept as a tar in
the artifact store (content-addressed, in the tenant's space) and the run's head in a KV bucket points
at it; the next call of the same run starts from the head, wherever it lands. So a workspace survives
the server's restart and a run's long wait, holds no process while the run waits, and is found only by
the (tenant, run) of the caller's verified token: no argument can name another run's workspace. A call
whose token names no run gets an empty workspace that is not kept.

Artifacts and heads are sealed with the tenant's key (:mod:`fleet.tenant_keys`), which the server
gets from the registry with the caller's own token. A head is kept under a keyed hash of the run id
and sealed to that name: a head written by anyone without the tenant's key (bus rights are not
enough), or copied from another run, does not open, and the call is refused rather than started from
it, so no file can be planted in a run's workspace.

Each call's result carries its output inline up to ``inline_output_bytes`` (the whole output as an
artifact beyond that) and, as artifacts, the files the call created or changed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import tarfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from pydantic import Field, field_validator
from starlette.applications import Starlette
from typing_extensions import TypedDict  # pydantic nests these only from typing_extensions on 3.11

from fleet.artifacts import BUS_PATIENCE_S, ArtifactRef, NatsArtifactStore
from fleet.errors import ErrorCode, FleetError
from fleet.natsconn import connect, key_value, patiently, service_credentials
from fleet.service import configure_logging
from fleet.settings import ServiceSettings
from fleet.tenant_keys import TenantKey
from mcp_servers._base import (
    READ_ONLY,
    TenantKeys,
    ToolGate,
    fleet_mcp_server,
    serve_mcp,
    tool_server_app,
)
from mcp_servers.sandbox.cgroups import CallCaps
from mcp_servers.sandbox.confinement import LAYERS, Confinement
from mcp_servers.sandbox.runner import (
    Limits,
    Outcome,
    Sandbox,
    find_bwrap,
    find_python,
    preflight,
    prepare_runtime,
)
from registry import RegistryClient

log = logging.getLogger(__name__)

# Listing a run's workspace is a scope of its own: the coordinator lists a run's workspace for its
# debug bundle (names, sizes, digests), and may neither run code nor read what the files hold.
TOOLS = {
    "run_python": ["sandbox:run"],
    "read_artifact": ["sandbox:run"],
    "workspace_files": ["sandbox:list"],
}
WORKSPACES_BUCKET = "fleet_sandbox_workspaces"
HEAD_PURPOSE = "workspace-head"
MAX_CODE_CHARS = 100_000
MAX_REPORTED_FILES = 100
RUNS = ToolAnnotations(
    read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False
)


class SandboxSettings(ServiceSettings):
    sandbox_wall_s: float = Field(default=30.0, description="the longest wall time a call may ask for")
    sandbox_cpu_s: int = 20
    sandbox_memory_bytes: int = Field(
        default=512 * 1024 * 1024, description="address space of each process of a call (RLIMIT_AS)"
    )
    sandbox_processes: int = Field(default=32, description="processes of a call's host uid (RLIMIT_NPROC)")
    sandbox_call_memory_bytes: int = Field(
        default=1024 * 1024 * 1024,
        gt=0,
        description="memory (RAM and swap, /work and /tmp included) of all a call's processes together"
        " (its cgroup); past it the call fails with sandbox_oom",
    )
    sandbox_call_pids: int = Field(
        default=64, gt=3, description="processes and threads of a call together, bubblewrap's 3 included"
    )
    sandbox_call_cpus: float = Field(default=1.0, gt=0, description="CPUs a call may use at once (CFS quota)")
    sandbox_required_layers: str = Field(
        default=",".join(LAYERS),
        description="confinement layers (seccomp, userns, cgroups; comma-separated) the server does not"
        " start without; one not listed that the host cannot give is logged as a warning at start",
    )

    @field_validator("sandbox_required_layers")
    @classmethod
    def _known_layers(cls, value: str) -> str:
        unknown = set(filter(None, value.split(","))) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown sandbox layers {sorted(unknown)}; known: {', '.join(LAYERS)}")
        return value

    def required_layers(self) -> frozenset[str]:
        return frozenset(filter(None, self.sandbox_required_layers.split(",")))

    sandbox_workspace_bytes: int = 64 * 1024 * 1024
    sandbox_output_bytes: int = 1024 * 1024
    sandbox_inline_output_bytes: int = 16 * 1024
    sandbox_slots: int = Field(default=4, description="runs at once; more calls wait for a slot")
    sandbox_uid_base: int = Field(
        default=61000, description="host uids uid_base .. uid_base+slots-1 run the code"
    )
    sandbox_bwrap: str = ""
    sandbox_python: str = ""
    sandbox_runtime_dir: Path | None = None
    sandbox_cache_bytes: int = 256 * 1024 * 1024


class FileRef(TypedDict):
    path: str
    size: int
    artifact: str


class RunResult(TypedDict):
    exit_code: int | None
    signal: int | None
    # which limit the run met: timeout, cpu_limit, output_limit, workspace_too_large (these end it),
    # process_limit (forks were refused at the call's pids limit; the run went on)
    limit: str | None
    stdout: str
    stderr: str
    stdout_artifact: str | None  # the whole output, when it is longer than what is inline
    stderr_artifact: str | None
    truncated: bool  # the output passed the sandbox's output cap: the run was stopped there
    files: list[FileRef]  # created or changed by this call
    workspace: str | None  # the workspace after the call (an artifact), None for a call without a run
    duration_ms: int
    cpu_ms: int


class ArtifactChunk(TypedDict):
    artifact: str
    size: int
    offset: int
    text: str | None
    base64: str | None


class WorkspaceFile(TypedDict):
    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Head:
    sha256: str
    revision: int


def _key(tenant: str, run_id: str) -> str:
    return hashlib.sha256(f"{tenant}\x00{run_id}".encode()).hexdigest()


def head_key(key: TenantKey, run_id: str) -> str:
    """Where the head of run ``run_id`` of ``key``'s tenant is kept (reveals neither)."""
    return key.name(HEAD_PURPOSE, run_id)


def tar_files(data: bytes) -> dict[str, tuple[int, str]]:
    """path -> (size, sha256) of the regular files in a workspace tar."""
    files: dict[str, tuple[int, str]] = {}
    if not data:
        return files
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive:
            if member.isfile():
                handle = archive.extractfile(member)
                content = handle.read() if handle is not None else b""
                files[member.name] = (member.size, hashlib.sha256(content).hexdigest())
    return files


def file_bytes(data: bytes, path: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        handle = archive.extractfile(path)
        return handle.read() if handle is not None else b""


class Workspaces:
    """The heads of the runs' workspaces (KV), their bytes (artifacts) and a local cache of them."""

    def __init__(
        self, heads: KeyValue, artifacts: NatsArtifactStore, cache_dir: Path, cache_bytes: int
    ) -> None:
        self._heads = heads
        self._artifacts = artifacts
        self._cache = cache_dir
        self._cache_bytes = cache_bytes
        self._locks: dict[str, asyncio.Lock] = {}
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def head(self, key: TenantKey, run_id: str) -> Head | None:
        """The run's head, if it has one; ``integrity_failed`` if what is there was not sealed for
        this run with its tenant's key (forged, or moved from another run)."""
        name = head_key(key, run_id)
        try:
            entry = await self._heads.get(name)
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            value = json.loads(key.open(HEAD_PURPOSE, name, entry.value))
        except FleetError:
            log.warning("the workspace head of a run of tenant %s does not verify; not used", key.tenant)
            raise FleetError(
                ErrorCode.INTEGRITY_FAILED,
                "this run's workspace head does not verify with its tenant's key: it was not used",
            ) from None
        if value.get("run_id") != run_id:
            raise FleetError(ErrorCode.INTEGRITY_FAILED, "this run's workspace head names another run")
        return Head(str(value["sha256"]), int(entry.revision or 0))

    async def load(self, key: TenantKey, head: Head | None) -> bytes:
        if head is None:
            return b""
        cached = self._cache / head.sha256
        with contextlib.suppress(OSError):
            data = cached.read_bytes()
            if hashlib.sha256(data).hexdigest() == head.sha256:
                os.utime(cached)
                return data
        data = await self._artifacts.get(key, head.sha256)
        self._remember(head.sha256, data)
        return data

    async def save(self, key: TenantKey, run_id: str, data: bytes, previous: Head | None) -> ArtifactRef:
        ref = await self._artifacts.put(key, data, "application/x-tar")
        if previous is not None and previous.sha256 == ref.sha256:
            return ref
        name = head_key(key, run_id)
        value = key.seal(
            HEAD_PURPOSE,
            name,
            json.dumps(
                {"sha256": ref.sha256, "size": ref.size, "run_id": run_id, "at": time.time()}
            ).encode(),
        )

        async def write() -> None:
            if previous is None:
                await self._heads.create(name, value)
            else:
                await self._heads.update(name, value, last=previous.revision)

        try:
            # A bucket without a leader for a moment (a node of the bus back from a partition)
            # answers no one: wait for it rather than fail the call.
            await patiently("saving the workspace's head", write, patience_s=BUS_PATIENCE_S)
        except KeyWrongLastSequenceError as exc:
            if await self._head_is(name, value):
                self._remember(ref.sha256, data)  # a repeat of a write that had been taken
                return ref
            raise FleetError(
                ErrorCode.CONFLICT,
                "another call of this run changed the workspace at the same time; nothing of"
                " this call's workspace was kept",
            ) from exc
        self._remember(ref.sha256, data)
        return ref

    async def _head_is(self, name: str, value: bytes) -> bool:
        try:
            entry = await self._heads.get(name)
        except KeyNotFoundError:
            return False
        return entry.value == value

    def _remember(self, sha256: str, data: bytes) -> None:
        path = self._cache / sha256
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        entries = sorted((p for p in self._cache.iterdir() if p.is_file()), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in entries)
        for old in entries:
            if total <= self._cache_bytes:
                break
            total -= old.stat().st_size
            old.unlink(missing_ok=True)


class SandboxTools:
    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.sandbox: Sandbox | None = None
        self.workspaces: Workspaces | None = None
        self.artifacts: NatsArtifactStore | None = None

    def limits(self, timeout_s: float) -> Limits:
        s = self.settings
        wall = min(max(timeout_s, 0.1), s.sandbox_wall_s)
        return Limits(
            wall_s=wall,
            cpu_s=max(1, min(s.sandbox_cpu_s, int(wall) + 1)),
            memory_bytes=s.sandbox_memory_bytes,
            processes=s.sandbox_processes,
            workspace_bytes=s.sandbox_workspace_bytes,
            output_bytes=s.sandbox_output_bytes,
            file_bytes=s.sandbox_workspace_bytes,
            call=CallCaps(s.sandbox_call_memory_bytes, s.sandbox_call_pids, s.sandbox_call_cpus),
        )

    async def _output(self, key: TenantKey, data: bytes) -> tuple[str, str | None]:
        inline = self.settings.sandbox_inline_output_bytes
        text = data[:inline].decode(errors="replace")
        if len(data) <= inline:
            return text, None
        assert self.artifacts is not None
        return text, (await self.artifacts.put(key, data, "text/plain")).uri

    async def run(self, key: TenantKey, run_id: str, code: str, timeout_s: float) -> RunResult:
        assert self.sandbox is not None and self.workspaces is not None and self.artifacts is not None
        limits = self.limits(timeout_s)
        if not run_id:  # no run: a scratch workspace, gone after the call
            outcome = await self.sandbox.run(code, b"", limits)
            return await self._result(key, outcome, b"", None)
        async with self.workspaces.lock(_key(key.tenant, run_id)):
            head = await self.workspaces.head(key, run_id)
            before = await self.workspaces.load(key, head)
            outcome = await self.sandbox.run(code, before, limits)
            saved = None
            if outcome.workspace is not None:
                saved = await self.workspaces.save(key, run_id, outcome.workspace, head)
            return await self._result(key, outcome, before, saved)

    async def _result(
        self, key: TenantKey, outcome: Outcome, before: bytes, saved: ArtifactRef | None
    ) -> RunResult:
        assert self.artifacts is not None
        files: list[FileRef] = []
        if outcome.workspace:
            old, new = tar_files(before), tar_files(outcome.workspace)
            changed = [path for path, meta in sorted(new.items()) if old.get(path) != meta]
            for path in changed[:MAX_REPORTED_FILES]:
                ref = await self.artifacts.put(key, file_bytes(outcome.workspace, path))
                files.append(FileRef(path=path, size=ref.size, artifact=ref.uri))
        stdout, stdout_ref = await self._output(key, outcome.stdout)
        stderr, stderr_ref = await self._output(key, outcome.stderr)
        return RunResult(
            exit_code=outcome.exit_code,
            signal=outcome.signal,
            limit=outcome.reason,
            stdout=stdout,
            stderr=stderr,
            stdout_artifact=stdout_ref,
            stderr_artifact=stderr_ref,
            truncated=outcome.stdout_truncated or outcome.stderr_truncated,
            files=files,
            workspace=saved.uri if saved is not None else None,
            duration_ms=int(outcome.duration_s * 1000),
            cpu_ms=int(outcome.cpu_s * 1000),
        )

    async def read_artifact(self, key: TenantKey, ref: str, offset: int, length: int) -> ArtifactChunk:
        assert self.artifacts is not None
        data = await self.artifacts.get(key, ref)
        chunk = data[offset : offset + length]
        try:
            text: str | None = chunk.decode()
            encoded = None
        except UnicodeDecodeError:
            text, encoded = None, base64.b64encode(chunk).decode()
        return ArtifactChunk(artifact=ref, size=len(data), offset=offset, text=text, base64=encoded)

    async def files(self, key: TenantKey, run_id: str) -> list[WorkspaceFile]:
        assert self.workspaces is not None
        if not run_id:
            return []
        head = await self.workspaces.head(key, run_id)
        data = await self.workspaces.load(key, head)
        return [WorkspaceFile(path=p, size=s, sha256=h) for p, (s, h) in sorted(tar_files(data).items())]


def build_server(
    settings: SandboxSettings, registry: RegistryClient, gate: ToolGate, tools: SandboxTools
) -> MCPServer:
    mcp = fleet_mcp_server(
        "fleet-sandbox",
        settings,
        registry,
        "Runs Python in an isolated sandbox: no network, a private /work kept between the calls"
        " of one run, limits on time, memory, processes and output.",
    )
    keys = TenantKeys(registry)

    @mcp.tool(annotations=RUNS)
    async def run_python(code: str, timeout_s: float = 10.0) -> RunResult:
        """Run Python 3 code in the sandbox (cwd /work, kept between calls of your run; no network).
        Returns exit code, output (long output as an artifact) and the files it created or changed."""
        claims = await gate.allow("run_python", {"code_length": len(code), "timeout_s": timeout_s})
        if len(code) > MAX_CODE_CHARS:
            raise FleetError(ErrorCode.INVALID_REQUEST, f"code is at most {MAX_CODE_CHARS} characters")
        try:
            key = await keys.for_caller(claims)
            result = await tools.run(key, claims.run_id, code, timeout_s)
        except FleetError as exc:
            if exc.code == ErrorCode.SANDBOX_OOM:
                log.warning("sandbox call of %s/%s refused: %s", claims.tenant, claims.sub, exc.code)
            raise
        if result["limit"] is not None:
            log.info("sandbox call of %s/%s met its %s", claims.tenant, claims.sub, result["limit"])
        return result

    @mcp.tool(annotations=READ_ONLY)
    async def read_artifact(artifact: str, offset: int = 0, length: int = 65536) -> ArtifactChunk:
        """Read part of an artifact of your tenant (artifact:sha256:...), as text or base64."""
        claims = await gate.allow("read_artifact", {})
        if offset < 0 or not 0 < length <= 1024 * 1024:
            raise FleetError(ErrorCode.INVALID_REQUEST, "offset >= 0 and 0 < length <= 1048576")
        return await tools.read_artifact(await keys.for_caller(claims), artifact, offset, length)

    @mcp.tool(annotations=READ_ONLY)
    async def workspace_files() -> list[WorkspaceFile]:
        """The files in your run's workspace."""
        claims = await gate.allow("workspace_files", {})
        return await tools.files(await keys.for_caller(claims), claims.run_id)

    return mcp


def build_app_for(settings: SandboxSettings) -> Starlette:
    tools = SandboxTools(settings)
    state = settings.local_state_dir()
    runtime = (
        settings.sandbox_runtime_dir or Path("/tmp") / f"fleet-sandbox-{_key(str(state.resolve()), '')[:12]}"
    )

    @contextlib.asynccontextmanager
    async def resources() -> AsyncIterator[None]:
        python = find_python(settings.sandbox_python)
        bwrap, launcher = await asyncio.to_thread(
            prepare_runtime, runtime, find_bwrap(settings.sandbox_bwrap), python
        )
        required = settings.required_layers()
        tools.sandbox = Sandbox(
            bwrap,
            launcher,
            python,
            uid_base=settings.sandbox_uid_base,
            slots=settings.sandbox_slots,
            confinement=await asyncio.to_thread(Confinement.build, bwrap, required=required),
        )
        try:
            await preflight(tools.sandbox, tools.limits(10.0), required=required)
            await tools.sandbox.prestart(tools.limits(10.0))  # every slot's first call starts warm
            client: NATS = await connect(
                settings.nats_url,
                settings.service_id,
                replicas=settings.nats_replicas,
                credentials=service_credentials(settings),
            )
        except BaseException:
            await tools.sandbox.close()
            raise
        try:
            tools.artifacts = await NatsArtifactStore.open(client)
            heads = await key_value(client, WORKSPACES_BUCKET, history=1)
            tools.workspaces = Workspaces(
                heads, tools.artifacts, state / "workspaces", settings.sandbox_cache_bytes
            )
            yield
        finally:
            await tools.sandbox.close()  # the sandboxes started ahead end with the server
            await client.close()

    return tool_server_app(
        settings,
        tools=TOOLS,
        make_server=lambda registry, gate: build_server(settings, registry, gate, tools),
        resources=resources,
    )


async def main(settings: ServiceSettings) -> None:
    sandbox_settings = SandboxSettings.from_env(settings.service_id)
    configure_logging(sandbox_settings.service_id, sandbox_settings.log_level)
    await serve_mcp(build_app_for(sandbox_settings), sandbox_settings)
