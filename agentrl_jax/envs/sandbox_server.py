"""One fork-server process of the sandbox pool, seen from the pool: start it, read its replies, stop it.

`SandboxPool` (sandbox.py) holds `num_servers` of these. The process runs `_forkserver.py`
as a script, so the trainer never forks itself; a request goes to its stdin as one JSON
line, and each reply line completes the future waiting for it in `pending`. Its stderr goes
to the log, and its last lines into the error when it fails to start.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl_jax.envs.sandbox import SandboxPoolConfig

logger = logging.getLogger(__name__)
SERVER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_forkserver.py")
_SERVER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
_STDERR_LINES = 50


class ForkServerProcess:
    """One fork-server process and the requests waiting on it."""

    def __init__(self, process, info):
        self.process = process
        self.info = info
        self.pending: dict[int, asyncio.Future] = {}
        self.reader_task: asyncio.Task | None = None
        self.stderr_task: asyncio.Task | None = None

    @classmethod
    async def start(cls, cfg: SandboxPoolConfig) -> ForkServerProcess:
        """Starts a server and waits for its ready line (which protections it got); raises with its stderr."""
        server_config = {k: getattr(cfg, k) for k in (
            "preimport", "isolate_network", "isolate_filesystem", "tmpfs_mb", "run_as_unprivileged", "uid_base")}
        process = await asyncio.create_subprocess_exec(
            cfg.python, "-E", "-s", SERVER_SCRIPT, json.dumps(server_config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=dict(_SERVER_ENV), limit=8 * cfg.output_limit_bytes + 2**20, close_fds=True)
        stderr_tail: collections.deque = collections.deque(maxlen=_STDERR_LINES)
        stderr_task = asyncio.create_task(cls._forward_stderr(process, stderr_tail))
        line = b""
        try:
            line = await asyncio.wait_for(process.stdout.readline(), timeout=120)
            info = json.loads(line) if line else None
        except (asyncio.TimeoutError, ValueError):
            info = None
        if not isinstance(info, dict) or not info.get("ready"):
            if process.returncode is None:
                process.kill()
            status = await process.wait()
            await asyncio.gather(stderr_task, return_exceptions=True)
            said = "\n".join(stderr_tail) or "(nothing on stderr)"
            raise RuntimeError(f"sandbox fork server failed to start ({cfg.python} {SERVER_SCRIPT}, exit "
                               f"{status}; first line {line[:200]!r}); its stderr:\n{said}")
        server = cls(process, info)
        server.stderr_task = stderr_task
        server.reader_task = asyncio.create_task(server._read_replies())
        return server

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def fail_pending(self, reason: str):
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ConnectionError(reason))
        self.pending.clear()

    @staticmethod
    async def _forward_stderr(process, tail: collections.deque):
        """The server's stderr (failed pre-imports, a child that died before its cell) to the log."""
        pending = b""
        while chunk := await process.stderr.read(1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            pending = pending[-4096:]  # a line without end is cut, never buffered without bound
            for raw in lines:
                tail.append(raw.decode("utf-8", "replace").rstrip())
                logger.warning("sandbox fork server %d: %s", process.pid, tail[-1])
        if pending:
            tail.append(pending.decode("utf-8", "replace").rstrip())
            logger.warning("sandbox fork server %d: %s", process.pid, tail[-1])

    async def _read_replies(self):
        try:
            while True:
                line = await self.process.stdout.readline()
                if not line:
                    break
                reply = json.loads(line)
                future = self.pending.pop(reply.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (ValueError, asyncio.LimitOverrunError) as e:
            logger.error("sandbox: bad reply from fork server: %s", e)
        finally:
            self.fail_pending("sandbox fork server died")
            if self.alive:
                self.process.kill()

    async def stop(self, grace_s: float):
        """Kills the process, fails what waits on it, and waits up to ``grace_s`` for its stderr to end."""
        if self.alive:
            self.process.kill()
        await self.process.wait()
        self.fail_pending("sandbox fork server stopped")
        if self.reader_task is not None:
            await asyncio.gather(self.reader_task, return_exceptions=True)
        if self.stderr_task is not None:  # EOF unless a straggler inherited the pipe
            done, _ = await asyncio.wait([self.stderr_task], timeout=grace_s)
            if not done:
                self.stderr_task.cancel()
