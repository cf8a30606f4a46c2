"""Time of one `Engine.prefill_insert` call against the size of the KV page pool.

A prefill call should cost what its tokens cost. If its program copies the pool (XLA does
so when it cannot update the donated pool in place), the call grows with the KV budget
instead: on an H200 with a 17.5 GB pool that was ~20 ms a call, a quarter of a multi-turn
rollout's device time (docs/benchmarks.md, "Prefill"). This script runs the
same 40-token prefill of a 4-layer tiny Qwen3 into pools of different sizes and prints the
median time per call; run it against two trees to compare them (the package is imported
from PYTHONPATH, so the script may come from either tree):

    PYTHONPATH=<tree> JAX_PLATFORMS=cpu python bench/prefill_pool.py --pages 64,8192
"""

from __future__ import annotations

import argparse
import json
import time


def time_prefill(num_pages: int, calls: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from agentrl_jax.models import Decoder, DecoderConfig
    from agentrl_jax.rollout.engine import Engine
    from agentrl_jax.rollout.paged_prefill import Admission, PrefillRow
    from agentrl_jax.rollout.sampling import SamplingParams, request_key
    from agentrl_jax.sharding import make_mesh

    config = DecoderConfig(architecture="qwen3", vocab_size=128, hidden_size=256, intermediate_size=512,
                           num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32, qk_norm=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=16,
                    max_target_length=16384, max_prefill_length=64, page_size=32, num_pages=num_pages,
                    cache_dtype=None)
    params, state = engine.load_params(model), engine.init_decode_state()
    times = []
    for i in range(calls + 2):  # the first two compile and settle
        pages = engine.pages.alloc(0, 2)
        admission = Admission(i % 16, pages, np.asarray(request_key(0, i)), 0, SamplingParams(1.0))
        row = PrefillRow(0, pages, 0, np.arange(1, 41, dtype=np.int32), [admission])
        started = time.perf_counter()
        state, _ = engine.prefill_insert(params, state, [row])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - started)
        engine.pages.release_slot(i % 16)
    return {"pages": num_pages, "pool_bytes_per_layer": int(state.cache.k[0].nbytes) * 2,
            "ms_per_call_median": round(1e3 * float(np.median(times[2:])), 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", default="64,8192", help="pool sizes in pages (comma-separated)")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)
    for pages in (int(p) for p in args.pages.split(",")):
        print(json.dumps(time_prefill(pages, args.calls)))


if __name__ == "__main__":
    main()
