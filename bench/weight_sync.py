"""Weight push from the trainer's layout into the rollout engine's, at a Qwen3 shape.

Times, for float32 params (what the trainer holds):
- colocated: `jax.device_put` from the training sharding (FSDP over every device) into the
  engine's inference sharding (tensor-parallel only, so replicated over FSDP) on the same
  devices, vs a jitted identity with `out_shardings` (an on-device all-gather);
- disaggregated: `jax.device_put` from one device's training layout onto another device.

    python bench/weight_sync.py --size 1.7b        # >= 2 GPUs
    python bench/weight_sync.py --size tiny        # CPU smoke run

Prints seconds per push (median of `--repeats`, after one warm-up) and GB/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.rl_step import SHAPES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.7b", choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentrl_jax.models import Decoder, DecoderConfig, param_shardings, split_params
    from agentrl_jax.sharding import DEFAULT_RULES, inference_rules, make_mesh

    cfg = DecoderConfig(architecture="qwen3", qk_norm=True, tie_word_embeddings=True, **SHAPES[args.size])
    devices = jax.devices()
    model = jax.jit(lambda: split_params(Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32))[1],
                    out_shardings=None)()
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model))

    def timed(fn):
        jax.block_until_ready(fn())  # warm-up (compiles)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    print(f"device: {len(devices)} x {devices[0].device_kind}; {args.size} params {nbytes / 1e9:.2f} GB float32")
    mesh = make_mesh({"fsdp": -1}, devices=devices)
    train = jax.device_put(model, param_shardings(model, mesh, DEFAULT_RULES))
    engine = param_shardings(model, mesh, inference_rules())
    rows = [("colocated, device_put", timed(lambda: jax.device_put(train, engine)))]
    identity = jax.jit(lambda t: t, out_shardings=engine)
    rows.append(("colocated, jit identity out_shardings", timed(lambda: identity(train))))
    if len(devices) >= 2:
        src = make_mesh({"fsdp": -1}, devices=devices[1:2])
        dst = make_mesh({"data": -1}, devices=devices[:1])
        on_src = jax.device_put(model, param_shardings(model, src, DEFAULT_RULES))
        dst_shardings = param_shardings(model, dst, inference_rules())
        rows.append(("disaggregated (device 1 -> device 0), device_put",
                     timed(lambda: jax.device_put(on_src, dst_shardings))))
    print("| push | seconds | GB/s |")
    print("|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.4f} | {nbytes / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
