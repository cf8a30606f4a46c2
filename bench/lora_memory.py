"""Memory and update throughput of one GRPO update: full fine-tuning vs LoRA (docs/lora.md).

For Qwen3 shapes with random weights (no download): the update of ``--rows`` x ``--seq`` tokens
(forward, chunked logprobs, PPO-clip loss, backward, AdamW) compiled for the full model and for
LoRA adapters of each ``--ranks`` on all seven projections. From XLA's memory analysis of the
compiled program: the state it is given (base + trained params + optimizer state) and its
temporaries (activations, gradients, the merged weights); with ``--time``, update tokens/s.

    python bench/lora_memory.py --sizes 1.7b,4b --ranks 16,64 --rows 4 --seq 4096 --time
    python bench/lora_memory.py --tiny          # seconds on CPU, checks the script runs

The LoRA base is stored in ``--base-dtype`` (bfloat16 by default), the full model's params in
float32 (the optimizer's master copy), as a run configures them (``model.param_dtype``).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_step import SHAPES, make_batch

from agentrl_jax.config import LoraConfig
from agentrl_jax.losses import global_normalizer
from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.lora import attach
from agentrl_jax.train.step import LossSettings, init_train_state, update_step

SETTINGS = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)))
GiB = 1024**3


def build_state(cfg: DecoderConfig, rank: int, base_dtype, optimizer):
    """(graphdef, train state): the full model in float32, or a ``base_dtype`` base with rank-``rank`` adapters."""
    dtype = jnp.float32 if rank == 0 else base_dtype
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=dtype, remat="full", rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    if rank:
        params = attach(params, cfg, LoraConfig(rank=rank, alpha=2.0 * rank), jax.random.key(1),
                        compute_dtype=jnp.bfloat16)
    return graphdef, init_train_state(params, optimizer, 0)


def measure(cfg: DecoderConfig, rank: int, rows: int, seq: int, base_dtype, timed: bool) -> dict:
    optimizer = optax.adamw(1e-6)
    graphdef, state = build_state(cfg, rank, base_dtype, optimizer)
    ids, mask, adv = make_batch(rows, seq, cfg.vocab_size)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, axis=1), "loss_mask": mask, "advantages": adv,
             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape),
             "segment_ids": np.ones_like(ids), "old_logprobs": np.zeros_like(mask),
             "rollout_logprobs": np.zeros_like(mask)}
    batch = jax.tree.map(jnp.asarray, batch)
    normalizer = global_normalizer(batch["loss_mask"], "token-mean", max_response_length=seq)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=optimizer, settings=SETTINGS,
                                     num_micro_batches=1, num_sequences=None), donate_argnums=(0,))
    compiled = step.lower(state, batch, normalizer).compile()
    stats = compiled.memory_analysis()
    row = {"rank": rank, "state_gib": sum(x.nbytes for x in jax.tree.leaves(state)) / GiB,
           "trained_params": int(sum(x.size for x in jax.tree.leaves(getattr(state.params, "adapters", state.params)))),
           "temp_gib": stats.temp_size_in_bytes / GiB if stats else None}
    if timed:
        state, metrics = compiled(state, batch, normalizer)
        jax.block_until_ready(metrics)
        t0, n = time.perf_counter(), 3
        for _ in range(n):
            state, metrics = compiled(state, batch, normalizer)
        jax.block_until_ready(metrics)
        row["tokens_per_s"] = rows * seq * n / (time.perf_counter() - t0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1.7b,4b")
    parser.add_argument("--ranks", default="16,64", help="LoRA ranks; the full model (rank 0) always runs first")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--base-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--time", action="store_true", help="also run the update and report tokens/s")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, 2 x 64 tokens (a CPU check)")
    args = parser.parse_args()
    sizes, rows, seq = (["tiny"], 2, 64) if args.tiny else (args.sizes.split(","), args.rows, args.seq)
    print(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows, "seq": seq, "base_dtype": args.base_dtype}))
    for size in sizes:
        cfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[size])
        for rank in [0, *(int(r) for r in args.ranks.split(","))]:
            row = measure(cfg, rank, rows, seq, jnp.dtype(args.base_dtype), args.time or args.tiny)
            print(json.dumps({"size": size, **row}), flush=True)


if __name__ == "__main__":
    main()
