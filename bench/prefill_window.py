"""Time of one `Engine.prefill_insert` call for each shape of the warm-up set: rows of
`prefill_row_tokens` tokens x attention window (pages) x tokens the dense layers compute.

A multi-turn rollout's prefill calls cost ~18 ms each on an H200 for ~270 real tokens,
whatever they compute (docs/benchmarks.md, "Prefill"). This script runs
every shape the driver's token budget allows (`Engine.prefill_shapes`) with every row a
real piece that reaches the window's end (its own pages, no admission; the shape's tokens
spread evenly over its rows: ``C`` each in an uncompacted shape, fewer in a compacted one,
as a session's next turn fills half a row), and prints the median wall time per call, so
the cost can be read against rows, window and computed tokens on any device (``--padding``:
padding rows instead, which write nothing; what `Engine.warmup` runs):

    python bench/prefill_window.py --size tiny            # CPU: the tiny Qwen3
    python bench/prefill_window.py --size 1.7b            # GPU
    python bench/prefill_window.py --size 1.7b --shapes 8x32,16x80 --profile /tmp/pw   # + device kernels
    python bench/prefill_window.py --size 1.7b --prefill-attention xla   # the XLA attention (default: the engine's)
    python bench/prefill_window.py --size 1.7b --shapes 8x32x384,8x32 --no-compaction  # A/B: 8 rows of 48 tokens

A shape ``RxW`` is R packed rows reaching W pages each, ``RxWxN`` the same rows holding N real
tokens (a compacted shape computes N; ``--no-compaction``, `Engine(prefill_compaction=False)`,
computes the rows' R x C whatever they hold). The XLA attention compiles one program per window
bucket, so W is also the compiled window; the "pallas" prefill compiles the whole table's width
only (``table_pages`` in the output) and W is then only how far the rows reach.

``--profile DIR`` traces ``--calls`` more calls of each shape with ``jax.profiler`` and
reduces the trace to a table of device milliseconds per call by HLO instruction
(`profile_step`'s summary), written to ``DIR/<rows>x<window>.txt``; on CPU the trace has no
device plane and the table is empty.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=2560)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=1024, help="the driver's prefill tokens per tick")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--shapes", help="only these, as ROWSxWINDOW_PAGES[xTOKENS],... (default: every warm-up shape)")
    parser.add_argument("--profile", help="trace each shape's calls and write a kernel table per shape here")
    parser.add_argument("--top", type=int, default=25, help="ops in each profile table")
    parser.add_argument("--padding", action="store_true", help="padding rows (warm-up's calls), not real pieces")
    parser.add_argument("--prefill-attention", choices=("xla", "pallas"),
                        help="Engine(prefill_attention=...) (default: the engine's choice)")
    parser.add_argument("--no-compaction", action="store_true",
                        help="Engine(prefill_compaction=False): the dense layers compute every row's C tokens")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()

    import jax
    import numpy as np
    from decode import qwen3_model

    from agentrl_jax.rollout import Engine
    from agentrl_jax.rollout.paged_prefill import call_layout, empty_pack
    from agentrl_jax.sharding import make_mesh

    model, dtype = qwen3_model(args.size)
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=args.slots,
                    max_target_length=args.max_length, max_prefill_length=256, cache_dtype=dtype,
                    page_size=args.page_size, prefill_attention=args.prefill_attention,
                    prefill_compaction=not args.no_compaction)
    params, state = engine.load_params(model), engine.init_decode_state()
    print(f"device: {jax.devices()[0].device_kind} x1  jax {jax.__version__}  size {args.size}  "
          f"prefill attention {engine.prefill_attention}  compaction {engine.prefill_compaction}")
    rows = []
    compiled = engine.prefill_shapes(args.token_budget)
    width = compiled[0].row_tokens
    shapes = [(s.rows, s.window, s.tokens) for s in compiled]  # (rows, pages the rows reach, real tokens)
    if args.shapes:
        buckets = sorted({s.rows for s in compiled})
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
        shapes = [(n, w, *rest) if rest else (n, w, n * width) for n, w, *rest in shapes]
        for n, w, tokens in shapes:
            if n not in buckets or not 1 <= w <= engine.table_width or not n <= tokens <= n * width:
                raise SystemExit(f"--shapes {args.shapes}: rows must be one of {buckets}, pages 1 to "
                                 f"{engine.table_width} (the page table's width) and tokens in [rows, rows x "
                                 f"{width}]")
    for n, window, tokens in shapes:
        table = engine._prefill_window(window * engine.page_size)  # the compiled window
        if args.padding:
            computed = call_layout(n, tokens, row_tokens=width, row_cap=n, compaction=engine.prefill_compaction)[1]
            packed = empty_pack(rows=n, row_tokens=width, window=table, num_slots=args.slots, tokens=computed)
        else:
            packed = _full_rows(engine, n, width, window, tokens)
        times = []
        for _ in range(args.calls + 1):  # the first compiles
            t0 = time.perf_counter()
            state, _ = engine._run_prefill(params, state, packed)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
        row = {"rows": n, "row_tokens": width, "window_pages": window, "table_pages": table,
               "tokens": 0 if args.padding else tokens, "computed_tokens": packed.computed_tokens,
               "attention": engine.prefill_attention,
               "ms_per_call": round(1e3 * float(np.median(times[1:])), 2)}
        if args.profile:
            row.update(_profile(engine, params, state, packed, args, f"{n}x{window}"))
            state = row.pop("state")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _full_rows(engine, n: int, width: int, window: int, tokens: int):
    """``n`` rows holding ``tokens`` new tokens (spread evenly, at most ``width`` each), each row's
    ending at the last entry of ``window`` pages, each with its own pages (shard 0), packed as
    `Engine.prefill_insert` packs them (no admission)."""
    import numpy as np

    from agentrl_jax.rollout.paged_prefill import PrefillRow

    P = engine.page_size
    reach = min(window * P, engine.max_target_length - 1)
    first = 1  # page 0 is the trash page
    if first + n * window > engine.memory_plan.pages_per_shard:
        raise SystemExit(f"{n} rows x {window} pages do not fit the pool of {engine.memory_plan.pages_per_shard}")
    rng = np.random.default_rng(0)
    sizes = [tokens // n + (i < tokens % n) for i in range(n)]
    rows = [PrefillRow(shard=0, pages=list(range(first + i * window, first + (i + 1) * window)), start=reach - size,
                       tokens=rng.integers(1, engine.config.vocab_size, size).astype(np.int32))
            for i, size in enumerate(sizes)]
    packed = engine._pack(rows, row_cap=n)
    table = engine._prefill_window(reach)
    assert packed.tokens.shape == (n, width) and packed.tables.shape[1] == table, (packed.tokens.shape, packed.tables.shape)
    return packed


def _profile(engine, params, state, packed, args, name: str) -> dict:
    """Trace ``args.calls`` prefill calls of one shape; write the kernel table; device ms per call."""
    import jax
    from profile_step import device_kernels, parse_hlo, render, summarize

    fn, call_args = engine._prefill_call(params, engine._sync(state), packed)
    hlo_ops = parse_hlo(fn.lower(*call_args).compile().as_text())
    trace_dir = os.path.join(args.profile, f"trace_{name}")
    times = []
    with jax.profiler.trace(trace_dir):
        for _ in range(args.calls):
            t0 = time.perf_counter()
            state, _ = engine._run_prefill(params, state, packed)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
    kernels, _ = device_kernels(trace_dir)
    wall = sorted(times)[len(times) // 2]
    summary = summarize(kernels, hlo_ops, args.calls, wall, args.top)
    header = f"{jax.devices()[0].device_kind}: prefill call {name} (rows x window pages), size {args.size}"
    with open(os.path.join(args.profile, f"{name}.txt"), "w") as f:
        f.write(render(summary, header))
    print(render(summary, header), flush=True)
    return {"state": state, "traced_ms_per_call": round(1e3 * wall, 2),
            "device_ms_per_call": round(summary["device_busy_ms_per_step"], 2),
            "kernels_per_call": len(kernels) // max(args.calls, 1)}


if __name__ == "__main__":
    main()
