"""One layer's decode attention + cache write: our fused kernel vs the engine's previous path.

Usage (GPU):
    python bench/decode_attention.py                      # Qwen3-1.7B layer shapes, batches 1,16,64,256
    python bench/decode_attention.py --sweep --batches 64 # every kernel setting at batch 64
    python bench/decode_attention.py --sweep --batches 64 --page-size 32  # the paged cache
Quick check (CPU, interpreted, tiny shapes):
    python bench/decode_attention.py --tiny

Per decode step and layer the engine writes one key and value per row into its
``[B, KV, S, K]`` buffers and attends the row's G query heads per kv head over its
filled entries. Baseline (measured in the same run): two XLA scatters into the buffers,
then JAX's own Pallas kernel (`jax.experimental.pallas.ops.gpu.decode_attention.mqa`,
64-entry blocks, chunked when fewer than 512 (row, kv head) programs; what the engine
ran before). Candidate: `agentrl_jax.models.decode_attention.decode_attention`, which
does both in one kernel. Each timing runs the op `--reps` times inside one jitted loop
(the buffers donated and carried, as the engine's 28 layers do), median of `--trials`.
GB/s counts the K and V bytes a step must read: ``B * KV * context * K * 2 * 2`` (with
``--ragged s`` the rows' lengths are drawn from context x [1 - s, 1 + s], a rollout's mix,
and the bytes summed over rows; ``--min-programs 512,1024`` times the default setting with
each row's entries split into more chunks, which balances ragged rows over the SMs).

With ``--page-size P`` the candidate reads a pool of pages ``[N, KV, P, K]`` through a
shuffled page table (the same entries as the dense buffers, so the same reference); the
baseline stays the dense one. Blocks larger than a page are gathered over whole pages.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from agentrl_jax.models import decode_attention as fused  # noqa: E402
from agentrl_jax.models.decode import kernel_chunks  # noqa: E402
from bench.decode import hbm_bandwidth  # noqa: E402


def _divisor_chunks(programs: int, blocks: int, min_programs: int) -> int:
    """k_splits for JAX's `mqa` (which splits the whole buffer evenly: a divisor of its blocks)."""
    return next((n for n in range(1, blocks + 1) if blocks % n == 0 and programs * n >= min_programs), blocks)


def baseline_step(qkv, positions, k_cache, v_cache, *, block_k=64, min_programs=512):
    """The engine's path before the fused kernel: slice q/k/v, scatter, then JAX's Pallas `mqa`."""
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_kernel

    B, KV, R, K = qkv.shape
    G, S = R - 2, k_cache.shape[2]
    q, k_new, v_new = qkv[:, :, :G], qkv[:, :, G], qkv[:, :, G + 1]
    rows = jnp.arange(B)
    k_cache = k_cache.at[rows, :, positions].set(k_new, mode="drop")
    v_cache = v_cache.at[rows, :, positions].set(v_new, mode="drop")
    out = jax_kernel.mqa(
        q.reshape(B * KV, G, K), k_cache.reshape(B * KV, S, K), v_cache.reshape(B * KV, S, K),
        kv_seq_len=jnp.repeat(positions + 1, KV), block_k=block_k,
        k_splits=_divisor_chunks(B * KV, S // block_k, min_programs), num_warps=4, num_stages=2,
        interpret=jax.default_backend() != "gpu",
    )
    return out.reshape(B, KV, G, K), k_cache, v_cache


def fused_step(qkv, positions, k_cache, v_cache, *, block_k, min_programs, method, warps, stages, page_table=None):
    B, KV = qkv.shape[:2]
    S = k_cache.shape[2] if page_table is None else page_table.shape[1] * k_cache.shape[2]
    chunks = kernel_chunks(B * KV, S // block_k, min_programs)
    return fused.decode_attention(qkv, positions, k_cache, v_cache, block_k=block_k, chunks=chunks,
                                  method=method, num_warps=warps, num_stages=stages, page_table=page_table)


def paged(k_cache, v_cache, page_size: int, seed=0):
    """The dense ``[B, KV, S, K]`` buffers as pools of pages ``[B * T + 1, KV, P, K]`` in a
    shuffled order (page 0 spare, as the engine's trash page) and the ``[B, T]`` table."""
    B, KV, S, K = k_cache.shape
    T = S // page_size
    table = 1 + np.random.default_rng(seed).permutation(B * T).reshape(B, T)

    def pool(cache):
        pages = cache.reshape(B, KV, T, page_size, K).transpose(0, 2, 1, 3, 4).reshape(B * T, KV, page_size, K)
        out = jnp.zeros((B * T + 1, KV, page_size, K), cache.dtype)
        return out.at[table.reshape(-1)].set(pages)

    return pool(k_cache), pool(v_cache), jnp.asarray(table, jnp.int32)


def sweep_settings(page_size: int) -> list[dict]:
    """The settings a sweep tries: dense, the old grid (method x block x warps x stages x
    chunking); paged, the tensor-core method only (faster at every dense setting), blocks
    of 1, 2 or 4 pages (less than a page lost 15% at pages of 16) x 4 or 8 warps x 2 or 3
    stages, and per block 4 stages (up to 64 entries) and 2 chunks per row."""
    if not page_size:
        return [dict(method=m, block_k=b, warps=w, stages=st, min_programs=mp) for m, b, w, st, mp in
                itertools.product(fused.METHODS, (16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3), (512, 1024))
                if not (m == "dot" and (w < 4 or b < 32)) and not (m == "vector" and st > 1 and mp > 512)]
    blocks = [b for b in (16, 32, 64, 128, 256) if page_size <= b <= 4 * page_size]
    grid = [(b, w, st, 512) for b, w, st in itertools.product(blocks, (4, 8), (2, 3))]
    grid += [(b, 4, 4, 512) for b in blocks if b <= 64] + [(b, 4, 3, 1024) for b in blocks]
    return [dict(method="dot", block_k=b, warps=w, stages=st, min_programs=mp) for b, w, st, mp in grid]


def time_op(step, inputs, reps: int, trials: int) -> tuple[float, np.ndarray]:
    """Seconds per call of ``step`` (median over trials of a jitted ``reps``-call loop) and its output."""

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def loop(qkv, positions, k_cache, v_cache):
        def body(_, carry):
            acc, k_cache, v_cache = carry
            out, k_cache, v_cache = step(qkv, positions, k_cache, v_cache)
            return acc + out.astype(jnp.float32), k_cache, v_cache

        acc = jnp.zeros((*qkv.shape[:2], qkv.shape[2] - 2, qkv.shape[3]), jnp.float32)
        return jax.lax.fori_loop(0, reps, body, (acc, k_cache, v_cache))

    qkv, positions, k_cache, v_cache = inputs
    acc, k_cache, v_cache = jax.block_until_ready(loop(qkv, positions, k_cache, v_cache))  # compile
    out = np.asarray(acc) / reps
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        acc, k_cache, v_cache = jax.block_until_ready(loop(qkv, positions, k_cache, v_cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / reps, out


def _reference(qkv, positions, k_cache, v_cache) -> np.ndarray:
    """float32 XLA: scatter, then `grouped_attention` over the whole buffer with a length mask."""
    from agentrl_jax.models.cache_attention import xla_attend_and_write

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    S = k_cache.shape[2]
    write_pos = positions[:, None]
    visible = jnp.arange(S)[None, None, :] <= write_pos[:, :, None]
    out, _, _ = jax.jit(functools.partial(xla_attend_and_write, attend_len=S, dtype=jnp.float32))(
        write_pos, visible, f32(qkv)[:, None], f32(k_cache), f32(v_cache))
    return np.asarray(out[:, 0])


def make_inputs(batch, kv, g, s, k, context, dtype, seed=0, ragged=0.0):
    """Random q/k/v and caches; every row at ``context`` filled entries, or with ``ragged`` s > 0 each
    row's drawn uniformly from context x [1 - s, 1 + s] (a rollout's mix of lengths, the same mean)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    qkv = jax.random.normal(keys[0], (batch, kv, g + 2, k), dtype)
    k_cache, v_cache = (jax.random.normal(key, (batch, kv, s, k), dtype) for key in keys[1:])
    if not 0 <= ragged < 1:
        raise SystemExit(f"--ragged {ragged}: the spread must be in [0, 1)")
    if ragged:
        low, high = round(context * (1 - ragged)), round(context * (1 + ragged))
        if high > s:
            raise SystemExit(f"--ragged {ragged}: rows up to {high} entries do not fit --cache {s}")
        lengths = np.random.default_rng(seed).integers(max(low, 1), high + 1, batch)
        positions = jnp.asarray(lengths - 1, jnp.int32)
    else:
        positions = jnp.full((batch,), context - 1, jnp.int32)
    return qkv, positions, k_cache, v_cache


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1024, help="filled entries per row incl. the new one")
    parser.add_argument("--cache", type=int, default=1792, help="S, entries per row's buffer")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=2, help="G, query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=28)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="every method/block/warps/stages/chunking setting")
    parser.add_argument("--page-size", type=int, default=0, help="read a paged pool of this page size (0: dense)")
    parser.add_argument("--ragged", type=float, default=0.0,
                        help="rows of ragged lengths: each drawn from context x [1 - s, 1 + s] (0: all at --context)")
    parser.add_argument("--min-programs", default="",
                        help="comma list: the default setting at each of these min_programs (row chunking) values")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batches, args.context, args.cache, args.kv_heads, args.head_dim, args.reps, args.trials = (
            "2", 100, 256, 2, 16, 2, 1)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    device = jax.devices()[0].device_kind
    bandwidth = hbm_bandwidth(device)
    print(f"device: {device}; HBM {bandwidth / 1e12 if bandwidth else '?'} TB/s; jax {jax.__version__}; "
          f"KV={args.kv_heads} G={args.group} K={args.head_dim} S={args.cache} context={args.context} {dtype.__name__}"
          f"{f'; ragged rows, context x [1 - {args.ragged}, 1 + {args.ragged}]' if args.ragged else ''}"
          f"{f'; pages of {args.page_size}' if args.page_size else ''}")
    from agentrl_jax.models.decode import DecodeKernel, kernel_block

    engine = DecodeKernel()  # the engine's settings
    default = dict(method=engine.method, block_k=engine.block_k, warps=engine.warps, stages=engine.stages,
                   min_programs=engine.min_programs)
    if args.page_size:
        default["block_k"] = kernel_block(args.cache, args.page_size, engine.block_k)
    settings = sweep_settings(args.page_size) if args.sweep else [default]
    if args.min_programs:
        settings = [dict(default, min_programs=int(m)) for m in args.min_programs.split(",")]
    if args.tiny:  # a smoke run checks the plumbing, not the speed
        settings = settings[:2]
    rows = []
    print("| batch | impl | setting | us/call | GB/s | % HBM | vs baseline | max abs diff to f32 XLA |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = make_inputs(batch, args.kv_heads, args.group, args.cache, args.head_dim, args.context, dtype,
                             ragged=args.ragged)
        filled = int(np.sum(np.asarray(inputs[1]) + 1))  # entries attended, the new one included
        kv_bytes = args.kv_heads * filled * args.head_dim * 2 * jnp.dtype(dtype).itemsize
        copy = functools.partial(jax.tree.map, functools.partial(jnp.array, copy=True), inputs)  # the loop donates
        ref = _reference(*inputs)
        base_s, base_out = time_op(baseline_step, copy(), args.reps, args.trials)
        results = [("jax mqa + 2 scatters (before)", "block 64", base_s, base_out)]
        impl, table = "agentrl_jax fused", None
        if args.page_size:
            pools = paged(*inputs[2:], args.page_size)
            table = pools[2]
            copy = functools.partial(jax.tree.map, functools.partial(jnp.array, copy=True), (*inputs[:2], *pools[:2]))
            impl = f"agentrl_jax fused, pages of {args.page_size}"
        row = functools.partial(_row, batch=batch, device=device, kv_bytes=kv_bytes, base_s=base_s, ref=ref)
        for setting in settings:
            label = ",".join(f"{k}={v}" for k, v in setting.items())
            try:
                step = functools.partial(fused_step, **setting, page_table=table)
                seconds, out = time_op(step, copy(), args.reps, args.trials)
            except Exception as e:  # noqa: BLE001  (a setting that does not compile must not end the sweep)
                print(f"| {batch} | fused | {label} | error: {type(e).__name__}: {str(e)[:120]} | | | | |")
                continue
            results.append((impl, label, seconds, out))
            print(f"# {label}: {1e6 * seconds:.1f} us", flush=True)
            _dump(args.json, rows + [row(*r) for r in results])  # so far: a sweep cut short keeps its results
        for result in sorted(results, key=lambda r: r[2]):
            rows.append(row(*result))
            r = rows[-1]
            pct = f"{100 * r['GBps'] * 1e9 / bandwidth:.0f}%" if bandwidth else "?"
            print(f"| {batch} | {r['impl']} | {r['setting']} | {r['us']:.1f} | {r['GBps']:.0f} | {pct} | "
                  f"{r['ratio']:.2f}x | {r['diff']:.1e} |", flush=True)
    _dump(args.json, rows)


def _row(impl, label, seconds, out, *, batch, device, kv_bytes, base_s, ref) -> dict:
    return {"batch": batch, "impl": impl, "setting": label, "us": 1e6 * seconds, "GBps": kv_bytes / seconds / 1e9,
            "device": device, "ratio": base_s / seconds, "diff": float(np.max(np.abs(out - ref)))}


def _dump(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
