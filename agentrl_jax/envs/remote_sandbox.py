"""Remote sandbox backend speaking SandboxFusion's HTTP API, with `SandboxPool.run`'s API.

For clusters where tools run on other machines. Request (POST {base_url}/run_code):

    {"code": ..., "language": "python", "run_timeout": s, "compile_timeout": s,
     "memory_limit_MB": mb, "stdin": "", "files": {}, "fetch_files": []}

Response: {"status": "Success" | "Failed" | "SandboxError", "message": ...,
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "execution_time",
"return_code", "stdout", "stderr"}, ...}. Field names follow bytedance/SandboxFusion
(`sandbox/server/sandbox_api.py`, `RunCodeRequest` / `RunCodeResponse`).

Connection failures, HTTP 5xx and `SandboxError` are retried with exponential backoff;
the number of requests in flight is bounded. `run_code` is stateless, so a session is
emulated by replaying the session's earlier cells, output silenced, before the new one
(side effects of earlier cells happen again; keep stateful work local when that matters).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import time
import urllib.error
import urllib.request

from agentrl_jax.envs.sandbox import ExecResult

logger = logging.getLogger(__name__)
_REPLAY_TEMPLATE = (
    "import contextlib as _c, io as _io\n"
    "with _c.redirect_stdout(_io.StringIO()), _c.redirect_stderr(_io.StringIO()):\n"
    "    for _cell in {cells!r}:\n"
    "        try:\n"
    "            exec(_cell, globals())\n"
    "        except BaseException:\n"
    "            pass\n"
    "del _c, _io, _cell\n")


@dataclasses.dataclass(frozen=True)
class RemoteSandboxConfig:
    base_url: str  # e.g. "http://sandbox-host:8080"
    timeout_s: float = 10.0  # run_timeout sent to the server
    memory_mb: int = 1024  # memory_limit_MB
    request_overhead_s: float = 10.0  # HTTP timeout = timeout_s + this
    max_retries: int = 3
    backoff_s: float = 0.5  # first retry delay; doubles each time
    max_concurrency: int = 32

    def __post_init__(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteSandboxConfig.base_url must be http(s)://..., got {self.base_url!r}")
        if self.max_retries < 0 or self.max_concurrency < 1:
            raise ValueError("RemoteSandboxConfig.max_retries must be >= 0 and max_concurrency >= 1")


class _Retryable(Exception):
    pass


def parse_run_code_response(payload: dict, duration_s: float) -> ExecResult:
    """SandboxFusion `RunCodeResponse` JSON -> ExecResult; raises _Retryable on SandboxError."""
    if payload.get("status") == "SandboxError":
        raise _Retryable(f"SandboxError: {payload.get('message', '')[:200]}")
    run = payload.get("run_result") or {}
    timed_out = run.get("status") == "TimeLimitExceeded"
    return ExecResult(stdout=run.get("stdout") or "", stderr=run.get("stderr") or "",
                      exit_status=run.get("return_code"), timed_out=timed_out, duration_s=duration_s,
                      network_isolated=False)


class RemoteSandbox:
    """Same `run` / `close_session` / `metrics` API as `SandboxPool`, over HTTP."""

    def __init__(self, config: RemoteSandboxConfig):
        self.config = config
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._sessions: dict[str, list[str]] = collections.defaultdict(list)
        self._counts = collections.Counter()
        self._latencies: collections.deque = collections.deque(maxlen=10_000)

    async def __aenter__(self) -> "RemoteSandbox":
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def start(self):
        """Nothing to start: the server is remote (kept for API parity with SandboxPool)."""

    def _post(self, body: dict, timeout_s: float) -> dict:
        request = urllib.request.Request(self.config.base_url.rstrip("/") + "/run_code",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code == 429:
                raise _Retryable(f"HTTP {e.code}") from e
            raise
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from e

    async def run(self, code: str, session: str | None = None, timeout_s: float | None = None,
                  memory_mb: int | None = None) -> ExecResult:
        """Runs `code` remotely; never raises for the code or the network (see `error`)."""
        timeout = float(timeout_s if timeout_s is not None else self.config.timeout_s)
        program = code
        if session is not None and self._sessions[session]:
            program = _REPLAY_TEMPLATE.format(cells=self._sessions[session]) + code
        body = {"code": program, "language": "python", "run_timeout": timeout, "compile_timeout": timeout,
                "memory_limit_MB": int(memory_mb or self.config.memory_mb), "stdin": "", "files": {},
                "fetch_files": []}
        start = time.monotonic()
        result, error = None, None
        async with self._semaphore:
            for attempt in range(self.config.max_retries + 1):
                if attempt:
                    self._counts["retries"] += 1
                    await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
                try:
                    payload = await asyncio.to_thread(self._post, body, timeout + self.config.request_overhead_s)
                    result = parse_run_code_response(payload, time.monotonic() - start)
                    break
                except _Retryable as e:
                    error = str(e)
                except (urllib.error.HTTPError, ValueError) as e:  # a 4xx or bad JSON: retrying cannot help
                    error = f"{type(e).__name__}: {e}"
                    break
        if result is None:
            result = ExecResult("", "", None, False, time.monotonic() - start, error=f"remote sandbox: {error}")
        if session is not None and result.ok:
            self._sessions[session].append(code)
        self._record(result)
        return result

    async def close_session(self, session: str):
        self._sessions.pop(session, None)

    def _record(self, result: ExecResult):
        self._counts["executions"] += 1
        self._counts["timeouts"] += int(result.timed_out)
        self._counts["errors"] += int(result.exit_status != 0 and not result.timed_out)
        self._counts["sandbox_errors"] += int(result.error is not None)
        self._latencies.append(result.duration_s)

    def metrics(self) -> dict[str, float]:
        ordered = sorted(self._latencies) or [0.0]
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return {**{f"remote_sandbox/{k}": float(v) for k, v in self._counts.items()},
                "remote_sandbox/latency_p50_s": pick(0.5), "remote_sandbox/latency_p99_s": pick(0.99)}

    async def close(self):
        self._sessions.clear()
