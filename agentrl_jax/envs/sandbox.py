"""Host-side asyncio pool of Python sandboxes (docs/environments.md).

`SandboxPool` keeps `num_servers` pre-warmed fork servers (`_forkserver.py`, numpy and
sympy imported once; the pool's handle on each is `sandbox_server.py`) and forks one child
per execution, so a cell costs milliseconds, not an interpreter start. What a child gets,
and what it cannot do, is documented in `_forkserver.py`, `_sandbox_child.py` and
`_sandbox_isolation.py`; in short, as root without containers:

- own uid, process group, CPU/address-space/process/file-size limits, wall-clock
  deadline with the whole process group and uid killed, output byte cap;
- no network (new network namespace, loopback down);
- its own mount namespace in which a private 0700 directory is /tmp, /var/tmp, /dev/shm,
  HOME and the working directory, removed when the cell (or session) ends; closed
  directories such as /root are empty, the interpreter's paths are read-only, root-owned
  paths are not writable by the cell's uid. World-readable host files stay readable; the
  environment is scrubbed.

Each of the three protections (`PROTECTIONS`) needs privileges (root, CAP_SYS_ADMIN).
A missing one is logged at start with the reason, listed in `protections_missing` and
counted in `metrics()`; `SandboxPoolConfig.require_isolation` refuses to start without all
three. The trainer is never the parent of a cell (the fork server is), so
`os.kill(os.getppid(), 9)` hits the server, which the pool replaces. A server that dies
or wedges (no answer within timeout + grace) is killed and restarted; the requests it
held come back as `ExecResult(error=...)`, never raise. A server that fails to start
raises with its own stderr.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from agentrl_jax.envs.sandbox_server import ForkServerProcess

if TYPE_CHECKING:
    from agentrl_jax.config import Config
    from agentrl_jax.envs.remote_sandbox import RemoteSandbox

logger = logging.getLogger(__name__)
# What a cell can do when a protection is missing (the keys are the fork server's names).
PROTECTIONS = {
    "uid_separation": "cells run as the trainer's own user: they can signal its processes and read or "
                      "write its files, and max_processes is not enforced",
    "network_namespace": "cells can reach the network",
    "mount_namespace": "cells share the host's /tmp, /var/tmp and /dev/shm with each other and the host, "
                       "and closed directories (/root) are as visible as their permissions allow",
}


class SandboxIsolationError(RuntimeError):
    """`require_isolation` is set and the machine cannot give every protection."""


@dataclasses.dataclass(frozen=True)
class SandboxPoolConfig:
    """Limits and shape of a `SandboxPool`. Per-call overrides go to `SandboxPool.run`."""

    num_servers: int = 1  # fork servers; each runs any number of children at once
    max_concurrency: int = 8  # executions in flight across the pool (semaphore)
    timeout_s: float = 10.0  # wall clock per execution
    cpu_s: float | None = None  # RLIMIT_CPU per execution; None -> timeout_s
    memory_mb: int = 512  # address space a cell may add on top of the warm interpreter
    session_memory_mb: int | None = None  # the same, for a whole stateful session; None -> memory_mb
    session_cpu_s: float = 600.0  # hard CPU budget of a session over all its cells
    output_limit_bytes: int = 16_384  # stdout+stderr kept; the rest is cut with a marker
    drain_limit_bytes: int = 32 * 2**20  # output after which the cell is killed
    max_processes: int = 32  # RLIMIT_NPROC of the cell's own uid (threads count)
    max_file_mb: int = 64  # RLIMIT_FSIZE
    preimport: tuple[str, ...] = ("numpy", "sympy")
    isolate_network: bool = True
    isolate_filesystem: bool = True
    tmpfs_mb: int = 512  # size of each server's private /tmp
    run_as_unprivileged: bool = True  # a fresh uid per child (needs root)
    uid_base: int = 200_000
    require_isolation: bool = False  # refuse to start unless every protection in PROTECTIONS works
    grace_s: float = 5.0  # extra wait before a silent server is declared wedged
    python: str = sys.executable

    def __post_init__(self):
        for name in ("num_servers", "max_concurrency", "memory_mb", "output_limit_bytes", "max_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxPoolConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.session_memory_mb is not None and self.session_memory_mb < 1:
            raise ValueError(f"SandboxPoolConfig.session_memory_mb must be >= 1 or None, got {self.session_memory_mb}")
        if self.timeout_s <= 0:
            raise ValueError(f"SandboxPoolConfig.timeout_s must be > 0, got {self.timeout_s}")


@dataclasses.dataclass
class ExecResult:
    """What one execution produced. `exit_status` < 0 is death by signal -exit_status."""

    stdout: str
    stderr: str
    exit_status: int | None
    timed_out: bool
    duration_s: float
    truncated: bool = False
    network_isolated: bool = False
    session_restarted: bool = False  # the session's process had died; state was lost
    error: str | None = None  # sandbox-side failure (worker died or wedged), not the cell's

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and not self.timed_out and self.error is None


class SandboxPool:
    """Async pool of sandboxed Python executions. Use `async with SandboxPool(cfg) as pool`."""

    def __init__(self, config: SandboxPoolConfig | None = None):
        self.config = config or SandboxPoolConfig()
        self._servers: list[ForkServerProcess | None] = [None] * self.config.num_servers
        self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        self._ids = itertools.count()
        self._session_server: dict[str, int] = {}
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._restart_lock = asyncio.Lock()
        self._latencies: collections.deque = collections.deque(maxlen=10_000)
        self._counts = collections.Counter()
        self._closed = False

    async def __aenter__(self) -> "SandboxPool":
        await self.start()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def start(self):
        """Starts the fork servers; reports (or, with `require_isolation`, refuses) missing protections."""
        for index in range(self.config.num_servers):
            self._servers[index] = await self._start_server()
        missing = self.protections_missing
        for name, reason in missing.items():
            logger.warning("sandbox: no %s (%s): %s", name, reason, PROTECTIONS[name])
        for path in self._servers[0].info.get("unreadable", []):
            logger.warning("sandbox: the cells' uid cannot read %s: packages there fail to import in cells", path)
        if missing and self.config.require_isolation:
            await self.close()
            raise SandboxIsolationError(
                f"environment.sandbox.require_isolation=True but the sandbox lacks {sorted(missing)}: "
                + "; ".join(f"{name}: {reason}" for name, reason in missing.items())
                + ". Run as root with CAP_SYS_ADMIN (a VM or a privileged container), use the remote "
                "backend, or set environment.sandbox.require_isolation=False to run without them.")

    @property
    def protections_missing(self) -> dict[str, str]:
        """{protection: why it is missing} over the running servers (see `PROTECTIONS`)."""
        missing = {}
        for server in self._servers:
            if server is not None:
                missing.update(server.info.get("missing", {}))
        return missing

    @property
    def network_isolated(self) -> bool:
        return all(s is not None and s.info["network_isolated"] for s in self._servers)

    @property
    def filesystem_isolated(self) -> bool:
        return all(s is not None and s.info["filesystem_isolated"] for s in self._servers)

    async def _start_server(self) -> ForkServerProcess:
        server = await ForkServerProcess.start(self.config)
        self._counts["servers_started"] += 1
        return server

    async def _server(self, index: int) -> ForkServerProcess:
        async with self._restart_lock:
            server = self._servers[index]
            if server is None or not server.alive or server.reader_task.done():
                if server is not None:
                    self._counts["servers_replaced"] += 1
                    self._drop_sessions_of(index)
                    await server.stop(self.config.grace_s)
                server = self._servers[index] = await self._start_server()
            return server

    def _drop_sessions_of(self, index: int):
        for sid, owner in list(self._session_server.items()):
            if owner == index:
                del self._session_server[sid]

    def _limits(self, timeout_s, memory_mb, session):
        cfg = self.config
        timeout = float(timeout_s if timeout_s is not None else cfg.timeout_s)
        default_mb = (cfg.session_memory_mb or cfg.memory_mb) if session is not None else cfg.memory_mb
        return {"timeout_s": timeout, "cpu_s": float(cfg.cpu_s or timeout),
                "memory_mb": int(memory_mb or default_mb),
                "session_cpu_s": cfg.session_cpu_s, "output_limit_bytes": cfg.output_limit_bytes,
                "drain_limit_bytes": cfg.drain_limit_bytes, "max_processes": cfg.max_processes,
                "max_file_mb": cfg.max_file_mb}

    async def run(self, code: str, session: str | None = None, timeout_s: float | None = None,
                  memory_mb: int | None = None) -> ExecResult:
        """Runs `code` (a Python program, or a cell of `session`) and returns what it did.

        Never raises for anything the code does; sandbox-side failures come back in
        `ExecResult.error`. Cells of one session run one at a time, in order.
        """
        if self._closed:
            raise RuntimeError("SandboxPool.run after close()")
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        limits = self._limits(timeout_s, memory_mb, session)
        if session is None:
            async with self._semaphore:
                return await self._request(self._pick_server(), code, None, limits, False)
        lock = self._session_locks.setdefault(session, asyncio.Lock())
        async with lock, self._semaphore:
            known = session in self._session_server
            index = self._session_server.setdefault(session, self._pick_server())
            return await self._request(index, code, session, limits, known)

    def _pick_server(self) -> int:
        loads = [len(s.pending) if s is not None else 0 for s in self._servers]
        return int(np.argmin(loads))

    async def _request(self, index, code, session, limits, known) -> ExecResult:
        started = time.monotonic()
        server = await self._server(index)
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        server.pending[request_id] = future
        message = {"op": "run", "id": request_id, "code": code, "limits": limits,
                   "session": session, "known_session": known}
        try:
            server.process.stdin.write((json.dumps(message) + "\n").encode())
            await server.process.stdin.drain()
            reply = await asyncio.wait_for(future, limits["timeout_s"] + self.config.grace_s)
            if "error" in reply:  # the server refused the request (e.g. every uid of its block in use)
                result = ExecResult("", "", None, timed_out=False, duration_s=time.monotonic() - started,
                                    network_isolated=server.info["network_isolated"],
                                    error=f"sandbox refused: {reply['error']}")
            else:
                result = ExecResult(
                    stdout=reply["stdout"], stderr=reply["stderr"], exit_status=reply["exit_status"],
                    timed_out=reply["timed_out"], duration_s=time.monotonic() - started,
                    truncated=reply["truncated"], network_isolated=server.info["network_isolated"],
                    session_restarted=reply["session_restarted"])
        except (ConnectionError, BrokenPipeError, asyncio.TimeoutError) as e:
            wedged = isinstance(e, asyncio.TimeoutError)
            server.pending.pop(request_id, None)
            if wedged:  # the server missed its own deadline: replace it
                self._counts["servers_wedged"] += 1
                server.process.kill()
            if session is not None:
                self._session_server.pop(session, None)
            result = ExecResult("", "", None, timed_out=wedged, duration_s=time.monotonic() - started,
                                network_isolated=server.info["network_isolated"],
                                error=f"sandbox worker {'wedged' if wedged else 'died'}: {e or type(e).__name__}")
        self._record(result)
        return result

    async def close_session(self, session: str):
        """Ends a session: kills its process (and anything it spawned) and removes its dir."""
        index = self._session_server.pop(session, None)
        self._session_locks.pop(session, None)
        server = self._servers[index] if index is not None else None
        if server is None or not server.alive:
            return
        future = asyncio.get_running_loop().create_future()
        request_id = next(self._ids)
        server.pending[request_id] = future
        try:
            server.process.stdin.write((json.dumps({"op": "close_session", "id": request_id, "session": session})
                                        + "\n").encode())
            await server.process.stdin.drain()
            await asyncio.wait_for(future, self.config.grace_s)
        except (ConnectionError, BrokenPipeError, asyncio.TimeoutError):
            server.pending.pop(request_id, None)

    def _record(self, result: ExecResult):
        self._counts["executions"] += 1
        self._counts["timeouts"] += int(result.timed_out)
        self._counts["errors"] += int(result.exit_status != 0 and not result.timed_out)
        self._counts["sandbox_errors"] += int(result.error is not None)
        self._counts["truncated"] += int(result.truncated)
        self._latencies.append(result.duration_s)

    def metrics(self) -> dict[str, float]:
        """Counters and latency percentiles (seconds) over the last 10k executions."""
        latencies = np.asarray(self._latencies) if self._latencies else np.zeros(1)
        return {**{f"sandbox/{k}": float(v) for k, v in self._counts.items()},
                "sandbox/latency_p50_s": float(np.percentile(latencies, 50)),
                "sandbox/latency_p99_s": float(np.percentile(latencies, 99)),
                "sandbox/protections_missing": float(len(self.protections_missing)),
                "sandbox/network_isolated": float(self.network_isolated),
                "sandbox/filesystem_isolated": float(self.filesystem_isolated)}

    async def close(self):
        self._closed = True
        for index, server in enumerate(self._servers):
            if server is not None:
                server.process.stdin.close()
                try:
                    await asyncio.wait_for(server.process.wait(), 5)
                except asyncio.TimeoutError:
                    pass
                await server.stop(self.config.grace_s)
                self._servers[index] = None


def make_sandbox(config: Config) -> SandboxPool | RemoteSandbox:
    """The run's code sandbox (``environment.sandbox``); ``memory_mb`` bounds cells and whole sessions alike."""
    sb = config.environment.sandbox
    if sb.backend == "remote":
        from agentrl_jax.envs.remote_sandbox import RemoteSandbox, RemoteSandboxConfig  # it imports this module

        return RemoteSandbox(RemoteSandboxConfig(base_url=sb.url, timeout_s=sb.timeout_s, memory_mb=sb.memory_mb,
                                                 max_concurrency=sb.workers))
    return SandboxPool(
        SandboxPoolConfig(
            max_concurrency=sb.workers,
            timeout_s=sb.timeout_s,
            memory_mb=sb.memory_mb,
            session_memory_mb=sb.memory_mb,
            output_limit_bytes=sb.max_output_bytes,
            require_isolation=sb.require_isolation,
        )
    )
