"""One layer's paged prefill attention: the Pallas kernel (`models/prefill_attention.py`) vs the
XLA path (`cache_attention.paged_xla_attend_and_write`'s gather of the window + `grouped_attention`).

Usage (GPU):
    python bench/prefill_attention.py                 # Qwen3-1.7B heads, 16 rows x 64 tokens, windows 32, 80 pages
    python bench/prefill_attention.py --sweep         # + every (block_q, block_k, warps, stages) setting
Quick check (CPU, interpreted, tiny shapes):
    python bench/prefill_attention.py --tiny

Every row is a piece of C new tokens ending at its window's last entry (the prefill's full
rows, as `bench/prefill_window.py` builds them), with its own shuffled pages. Each timing
runs the attention `--reps` times in one jitted loop (the output fed back as the next
queries, so no call is hoisted), median of `--trials`, in ms per call. The scatter of the
new keys/values is the same in both paths and left out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.models import prefill_attention as kernel
from agentrl_jax.models.cache_attention import grouped_attention


def xla_attention(q, k_pool, v_pool, table, starts, lengths):
    """The XLA path's attention: gather every row's window of pages, mask, einsums."""
    R, C, KV, _, K = q.shape
    W = table.shape[1] * k_pool.shape[2]

    def window(pool):
        return pool[table].transpose(0, 2, 1, 3, 4).reshape(R, KV, W, K)

    visible = jnp.arange(W)[None, None, :] <= (starts[:, None] + jnp.arange(C))[:, :, None]
    return grouped_attention(q, window(k_pool), window(v_pool), visible)


def time_op(fn, inputs, reps: int, trials: int) -> tuple[float, np.ndarray]:
    """Median ms per call of ``fn`` over ``trials`` jitted loops of ``reps`` calls; one call's output."""

    @jax.jit
    def loop(q, *rest):
        return jax.lax.fori_loop(0, reps, lambda _, q: fn(q, *rest).astype(q.dtype), q)

    jax.block_until_ready(loop(*inputs))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*inputs))
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times), np.asarray(jax.jit(fn)(*inputs), np.float32)


def inputs(rows, tokens, window, *, kv, g, k, page_size, dtype, seed=0):
    rng = np.random.default_rng(seed)
    N = rows * window + 1
    table = (1 + rng.permutation(rows * window)).reshape(rows, window).astype(np.int32)
    starts = np.full((rows,), window * page_size - tokens, np.int32)
    lengths = np.full((rows,), tokens, np.int32)
    q = rng.normal(size=(rows, tokens, kv, g, k))
    pools = [rng.normal(size=(N, kv, page_size, k)) for _ in range(2)]
    return (jnp.asarray(q, dtype), *(jnp.asarray(p, dtype) for p in pools), *map(jnp.asarray, (table, starts, lengths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--windows", default="32,80", help="window pages per row, comma-separated")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--reps", type=int, default=28)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--block-k", type=int, default=kernel.BLOCK_K, help="the first setting's block_k")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU: tiny shapes, interpreted")
    parser.add_argument("--json")
    args = parser.parse_args()
    shape = {"kv": 8, "g": 2, "k": 128, "page_size": args.page_size, "dtype": jnp.bfloat16}
    if args.tiny:
        args.rows, args.tokens, args.windows, args.reps, args.trials = 2, 8, "2", 1, 1
        shape = {"kv": 2, "g": 2, "k": 16, "page_size": 8, "dtype": jnp.float32}
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}", flush=True)
    settings = [{"block_q": kernel.BLOCK_Q, "block_k": args.block_k, "num_warps": kernel.NUM_WARPS,
                 "num_stages": kernel.NUM_STAGES}]
    if args.sweep:
        settings += [{"block_q": bq, "block_k": bk, "num_warps": w, "num_stages": s}
                     for bq, bk, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]
    rows = []
    for window in map(int, args.windows.split(",")):
        data = inputs(args.rows, args.tokens, window, **shape)
        xla_ms, want = time_op(xla_attention, data, args.reps, args.trials)
        row = {"rows": args.rows, "tokens": args.tokens, "window_pages": window, "xla_ms": round(xla_ms, 3)}
        print(json.dumps(row), flush=True)
        for setting in settings:
            try:
                ms, got = time_op(functools.partial(kernel.prefill_attention, **setting), data, args.reps,
                                  args.trials)
            except Exception as e:  # noqa: BLE001 (a setting Triton rejects: shared memory, registers)
                print(json.dumps({**setting, "error": str(e)[:200]}), flush=True)
                continue
            result = {**row, **setting, "pallas_ms": round(ms, 3), "ratio": round(xla_ms / ms, 2),
                      "max_abs_diff": float(np.abs(got - want).max())}
            rows.append(result)
            print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
