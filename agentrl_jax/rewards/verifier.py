"""Math answer verification under a hard timeout, in worker processes.

A math-verify / sympy comparison of a model's answer can run for hours (`9^{9^{9^9}}`,
`(10^{10})!`). The trainer must not: `MathVerifier.verify` gives each comparison
`timeout_s`, and on expiry kills the worker, starts a replacement and returns
`VerifyResult(correct=False, timed_out=True)`, counted in `stats["timeouts"]`. Cheap
cases (string or plain-number equality, `math_equiv.quick_equal`) never leave the
caller. What counts as equal is documented in `math_equiv` and docs/verifier.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time

from agentrl_jax.rewards.boxed import extract_boxed
from agentrl_jax.rewards.math_equiv import quick_equal

_WORKER_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    correct: bool
    timed_out: bool = False
    error: str | None = None
    duration_s: float = 0.0


class _Worker:
    def __init__(self, memory_mb: int):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentrl_jax.rewards._verify_worker", str(memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=root,
            env={**_WORKER_ENV, "PYTHONPATH": root})
        self.ready = False

    def readline(self, timeout_s: float) -> str | None:
        """One reply line, or None when none arrives within `timeout_s`."""
        ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, timeout_s))
        return self.process.stdout.readline() if ready else None

    def kill(self):
        self.process.kill()
        self.process.wait()


class MathVerifier:
    """Thread-safe pool of verifier workers; `verify` never takes much longer than `timeout_s`.

    A call that follows a timeout may also wait for the replacement worker to start
    (about 2 s: sympy and math-verify's LaTeX grammar load), up to `startup_timeout_s`.
    `tolerance` is the relative tolerance for golds written as decimals (`math_equal`).
    """

    def __init__(self, num_workers: int = 1, timeout_s: float = 5.0, memory_mb: int = 2048,
                 startup_timeout_s: float = 60.0, tolerance: float = 1e-6):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"MathVerifier: num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.timeout_s, self.memory_mb = timeout_s, memory_mb
        self.startup_timeout_s, self.tolerance = startup_timeout_s, tolerance
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(_Worker(memory_mb))
        self.stats = {"calls": 0, "fast_path": 0, "timeouts": 0, "worker_restarts": 0, "errors": 0}
        self._lock = threading.Lock()

    def _count(self, key: str):
        with self._lock:
            self.stats[key] += 1

    def verify(self, prediction: str | None, reference: str) -> VerifyResult:
        """Whether `prediction` equals the gold `reference` (see `math_equiv.math_equal`)."""
        start = time.monotonic()
        self._count("calls")
        if prediction is None or not str(prediction).strip():
            return VerifyResult(False, duration_s=time.monotonic() - start)
        quick = quick_equal(prediction, reference)
        if quick is not None:
            self._count("fast_path")
            return VerifyResult(quick, duration_s=time.monotonic() - start)
        worker = self._idle.get()
        try:
            if not worker.ready:
                line = worker.readline(self.startup_timeout_s)
                if not line or not json.loads(line).get("ready"):
                    raise RuntimeError("verifier worker failed to start")
                worker.ready = True
            request = {"prediction": str(prediction), "reference": str(reference), "tolerance": self.tolerance}
            worker.process.stdin.write(json.dumps(request) + "\n")
            worker.process.stdin.flush()
            line = worker.readline(self.timeout_s)
            if line is None:
                self._count("timeouts")
                worker = self._replace(worker)
                return VerifyResult(False, timed_out=True, error="verification timed out",
                                    duration_s=time.monotonic() - start)
            if not line:
                raise RuntimeError("verifier worker died")
            reply = json.loads(line)
            if reply.get("error"):
                self._count("errors")
            return VerifyResult(bool(reply["equal"]), error=reply.get("error"), duration_s=time.monotonic() - start)
        except (OSError, RuntimeError, ValueError) as e:
            self._count("errors")
            worker = self._replace(worker)
            return VerifyResult(False, error=f"{type(e).__name__}: {e}", duration_s=time.monotonic() - start)
        finally:
            self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self._count("worker_restarts")
        return _Worker(self.memory_mb)

    async def averify(self, prediction: str | None, reference: str) -> VerifyResult:
        """`verify` off the event loop thread."""
        return await asyncio.to_thread(self.verify, prediction, reference)

    def verify_response(self, response_text: str, reference: str) -> VerifyResult:
        """Verifies the last `\\boxed{}` of a response against the reference answer."""
        return self.verify(extract_boxed(response_text), reference)

    def close(self):
        while not self._idle.empty():
            self._idle.get().kill()

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc):
        self.close()
