"""Time of one `Engine.prefill_insert` call for each shape of the warm-up set: rows of
`prefill_row_tokens` tokens x attention window (pages).

A multi-turn rollout's prefill calls cost ~18 ms each on an H200 for ~270 real tokens,
whatever they compute (docs/benchmarks.md, "Where a tick's time goes"). This script runs
every shape the driver's token budget allows (`Engine.prefill_shapes`), with padding rows
(they write the trash page), and prints the median wall time per call, so the cost can be
read against rows and window on any device:

    python bench/prefill_window.py --size tiny            # CPU: the tiny Qwen3
    python bench/prefill_window.py --size 1.7b            # GPU
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
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()

    import jax
    import numpy as np

    from agentrl_jax.rollout import Engine
    from agentrl_jax.rollout.paged_prefill import empty_pack
    from agentrl_jax.sharding import make_mesh
    from decode import qwen3_model

    model, dtype = qwen3_model(args.size)
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=args.slots,
                    max_target_length=args.max_length, max_prefill_length=256, cache_dtype=dtype,
                    page_size=args.page_size)
    params, state = engine.load_params(model), engine.init_decode_state()
    print(f"device: {jax.devices()[0].device_kind} x1  jax {jax.__version__}  size {args.size}")
    rows = []
    for n, width, window in engine.prefill_shapes(args.token_budget):
        packed = empty_pack(rows=n, row_tokens=width, window=window, num_slots=args.slots)
        times = []
        for _ in range(args.calls + 1):  # the first compiles
            t0 = time.perf_counter()
            state, _ = engine._run_prefill(params, state, packed)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
        row = {"rows": n, "row_tokens": width, "window_pages": window,
               "ms_per_call": round(1e3 * float(np.median(times[1:])), 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
