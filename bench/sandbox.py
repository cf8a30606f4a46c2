"""Sandbox throughput and latency: the fork-server pool against `python -c` per execution.

    .venv/bin/python bench/sandbox.py            # ~1-2 minutes on 2 cores

Prints a markdown table (executions/s, p50 and p99 latency) for a trivial cell and a
numpy/sympy cell at concurrency 1, 8 and 32.
"""

import argparse
import asyncio
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from agentrl_jax.envs.sandbox import SandboxPoolConfig, SandboxPool  # noqa: E402

CELLS = {
    "trivial": "print(1 + 1)",
    "numpy+sympy": ("import numpy as np, sympy as sp\n"
                    "print(np.linalg.det(np.eye(3) * 2), sp.factorint(360), sp.expand('(x+1)**3'))"),
}


async def spawn_python(code: str, timeout_s: float):
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    stdout, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    assert process.returncode == 0, stdout


async def measure(run_one, concurrency: int, count: int):
    semaphore = asyncio.Semaphore(concurrency)
    latencies = []

    async def one():
        async with semaphore:
            start = time.perf_counter()
            await run_one()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    elapsed = time.perf_counter() - start
    return count / elapsed, np.percentile(latencies, 50) * 1e3, np.percentile(latencies, 99) * 1e3


async def main(args):
    config = SandboxPoolConfig(num_servers=args.servers, max_concurrency=32, timeout_s=60, preimport=("numpy", "sympy"))
    rows = []
    async with SandboxPool(config) as pool:
        for name, code in CELLS.items():
            async def pool_run(code=code):
                result = await pool.run(code)
                assert result.ok, result
            await pool_run()  # warm the first lazy imports of the server
            for concurrency in (1, 8, 32):
                count = max(args.pool_runs, 2 * concurrency)
                rows.append((name, "pool (fork server)", concurrency, count,
                             *await measure(pool_run, concurrency, count)))
            for concurrency in (1, 8, 32):
                heavy = name != "trivial"
                count = min(concurrency, args.spawn_heavy_runs) if heavy else max(16, 2 * concurrency)
                count = max(count, 4)
                rows.append((name, "`python -c` per run", concurrency, count,
                             *await measure(lambda code=code: spawn_python(code, 600), concurrency, count)))
        network = pool.network_isolated
    print(f"network isolated: {network}; servers: {args.servers}")
    print("| cell | backend | concurrency | runs | exec/s | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, backend, concurrency, count, rate, p50, p99 in rows:
        print(f"| {name} | {backend} | {concurrency} | {count} | {rate:.1f} | {p50:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--pool-runs", type=int, default=48)
    parser.add_argument("--spawn-heavy-runs", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
