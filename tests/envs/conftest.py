"""A sandbox pool shared by the env tests, driven from a background event loop thread."""

import asyncio
import threading

import pytest

from agentrl_jax.envs.sandbox import SandboxPoolConfig, SandboxPool


class LoopThread:
    """Runs coroutines on one long-lived loop so a pool can outlive a single test."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="session")
def pool(loop_thread):
    config = SandboxPoolConfig(num_servers=1, max_concurrency=8, timeout_s=2.0, memory_mb=256,
                           output_limit_bytes=4096, max_processes=16, preimport=("numpy",))
    sandbox = SandboxPool(config)
    loop_thread.run(sandbox.start())
    yield sandbox
    loop_thread.run(sandbox.close())
