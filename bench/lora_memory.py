"""Memory and update throughput of one GRPO update on one device: full fine-tuning vs LoRA (docs/lora.md).

For Qwen3 shapes with random weights (no download), the update of ``--rows`` x ``--seq`` tokens
(forward, chunked logprobs, PPO-clip loss, backward, AdamW; remat "full") is compiled for the
full model (float32 params, the optimizer's master copy) and for LoRA adapters of each ``--ranks``
on all seven projections, in both forms (``model.lora.impl``: ``in_layer``, ``merged``), the base
stored in ``--base-dtype``. Each row reports, from the shapes and XLA's memory analysis of the
compiled update (no allocation needed):

- ``params_gib`` (base + trained params), ``optimizer_gib`` (AdamW moments),
  ``temp_gib`` (activations, gradients, and for ``merged`` the merged copies),
  ``update_gib``: the update's whole footprint (arguments + outputs + temporaries - donated);
- ``engine_gib``: the colocated engine's own merged copy of the weights (``--engine-dtype``);
- ``kv_gib``: what is left for the engine's KV page pool on a device of ``budget_gib``, and
  ``kv_tokens``: how many tokens of KV cache that holds (bfloat16 K and V of every layer);
  ``fits``: at least ``--min-kv-tokens`` of them. The engine's weights and KV pool stay
  allocated through the update (the hybrid trainer keeps them), so they add up;
- with ``--time``, where the update alone fits: ``tokens_per_s`` of the update (median of
  ``--steps``), and ratios to the full fine-tuning row of the same size, measured in the same run.

Then, for each way (full, and LoRA at the smallest rank in each form), the largest Qwen3 shape
(0.6B ... 32B) that fits by this estimate; shapes whose state alone exceeds the budget are not
compiled. One JSON with everything goes to ``--out``.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python bench/lora_memory.py --time --out lora_memory.json
    python bench/lora_memory.py --tiny --out /tmp/lora_memory.json   # CPU: checks the script (~2 min)
    python bench/lora_memory.py --sizes cpu --ranks 16 --rows 2 --seq 256 --steps 5 --time --no-fit-search \\
        --budget-gib 80 --out /tmp/lora_cpu.json                       # CPU: in_layer vs merged
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_step import SHAPES, make_batch

from agentrl_jax.config import LoraConfig
from agentrl_jax.losses import global_normalizer
from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.lora import attach, trainable
from agentrl_jax.train.step import LossSettings, TrainState, update_step

SETTINGS = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)))
GiB = 1024**3
_QWEN3_LARGE = dict(vocab_size=151936, num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
#: Qwen3 dense shapes (published config.json values), and two for CPU checks: "tiny", and "cpu"
#: (large enough that the projections, not the overheads, dominate an update's time on CPU).
QWEN3 = {
    **{size: SHAPES[size] for size in ("0.6b", "1.7b", "4b")},
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, **_QWEN3_LARGE),
    "14b": dict(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40, **_QWEN3_LARGE),
    "32b": dict(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64, **_QWEN3_LARGE),
    "tiny": SHAPES["tiny"],
    "cpu": dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4,
                head_dim=64, tie_word_embeddings=True),
}
LADDER = ("0.6b", "1.7b", "4b", "8b", "14b", "32b")  # the fit search's sizes, smallest first


def model_config(size: str) -> DecoderConfig:
    return DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **QWEN3[size])


def state_builder(cfg: DecoderConfig, rank: int, impl: str, args):
    """``(graphdef, make)``: ``make()`` builds the train state (under jit, or ``jax.eval_shape``)."""
    param_dtype = jnp.float32 if rank == 0 else jnp.dtype(args.base_dtype)
    decoder = functools.partial(Decoder, cfg, dtype=jnp.bfloat16, param_dtype=param_dtype, remat="full",
                                attention_impl=args.attention_impl, lm_head_dtype=args.lm_head_dtype)
    graphdef = split_params(nnx.eval_shape(lambda: decoder(rngs=nnx.Rngs(0))))[0]

    def make():
        params = split_params(decoder(rngs=nnx.Rngs(0)))[1]
        if rank:
            params = attach(params, cfg, LoraConfig(rank=rank, alpha=2.0 * rank, impl=impl), jax.random.key(1),
                            compute_dtype=jnp.bfloat16)
        # init_train_state's finiteness check cannot run under a trace; this is its state.
        return TrainState(params=params, opt_state=optax.adamw(1e-6).init(trainable(params)),
                          step=jnp.zeros((), jnp.int32), rng=jax.random.key_data(jax.random.key(0)))

    return graphdef, make


def make_inputs(rows: int, seq: int, vocab: int):
    ids, mask, adv = make_batch(rows, seq, vocab)
    batch = {"input_ids": ids, "targets": np.roll(ids, -1, axis=1), "loss_mask": mask, "advantages": adv,
             "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), ids.shape),
             "segment_ids": np.ones_like(ids), "old_logprobs": np.zeros_like(mask),
             "rollout_logprobs": np.zeros_like(mask)}
    batch = jax.tree.map(jnp.asarray, batch)
    return batch, global_normalizer(batch["loss_mask"], "token-mean", max_response_length=seq)


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measure(size: str, rank: int, impl: str, args, budget: int, *, timed: bool) -> dict:
    """One row: the memory budget of the update (compiled, not run) and, with ``timed``, tokens/s."""
    cfg = model_config(size)
    graphdef, make = state_builder(cfg, rank, impl, args)
    abstract = jax.eval_shape(make)
    params = abstract.params
    trained = getattr(params, "adapters", params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(getattr(params, "base", params)))
    row = {"size": size, "way": "full" if rank == 0 else f"lora_{impl}", "rank": rank,
           "trained_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trained)),
           "params_gib": nbytes(params) / GiB, "optimizer_gib": nbytes(abstract.opt_state) / GiB,
           "engine_gib": n_params * jnp.dtype(args.engine_dtype).itemsize / GiB}
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    if nbytes(abstract) + row["engine_gib"] * GiB > budget:  # the state alone does not fit: nothing to compile
        return {**row, "fits": False, "kv_tokens": 0, "note": "state + engine weights exceed the budget"}
    batch, normalizer = make_inputs(args.rows, args.seq, cfg.vocab_size)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=optax.adamw(1e-6), settings=SETTINGS,
                                     num_micro_batches=1, num_sequences=None), donate_argnums=(0,))
    t0 = time.perf_counter()
    compiled = step.lower(abstract, batch, normalizer).compile()
    row["compile_s"] = time.perf_counter() - t0
    stats = compiled.memory_analysis()
    update = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
              - stats.alias_size_in_bytes)
    kv = budget - update - row["engine_gib"] * GiB
    row.update(temp_gib=stats.temp_size_in_bytes / GiB, update_gib=update / GiB, kv_gib=kv / GiB,
               kv_tokens=max(0, int(kv // kv_per_token)))
    row["fits"] = row["kv_tokens"] >= args.min_kv_tokens
    if timed and update <= budget:  # the bench allocates no engine: the update alone must fit to run
        try:
            state = jax.jit(make)()
            times = []
            for _ in range(args.steps + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                state, metrics = compiled(state, batch, normalizer)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
            row["tokens_per_s"] = args.rows * args.seq / float(np.median(times[1:]))
            row["loss_finite"] = bool(np.isfinite(float(metrics["loss"])))
            del state
        except jax.errors.JaxRuntimeError as error:  # out of memory after all: the row keeps its estimate
            row["time_error"] = str(error).splitlines()[0][:300]
    return row


def largest_fitting(way: tuple[int, str], start: str, rows: dict, args, budget: int) -> dict:
    """The largest shape of the ladder from ``start`` that fits, walking up until one does not."""
    rank, impl = way
    best = None
    for size in LADDER[LADDER.index(start):] if start in LADDER else [start]:
        row = rows.get((size, rank, impl)) or measure(size, rank, impl, args, budget, timed=False)
        if not row["fits"]:
            return {"largest": best, "first_not_fitting": size, "its_row": row}
        best = size
    return {"largest": best, "first_not_fitting": None}


def with_ratios(rows: list[dict]) -> list[dict]:
    full = {r["size"]: r for r in rows if r["rank"] == 0}
    for r in rows:
        base = full.get(r["size"])
        if r["rank"] and base and base.get("update_gib") and r.get("update_gib"):
            r["update_gib_vs_full"] = r["update_gib"] / base["update_gib"]
        if r["rank"] and base and base.get("tokens_per_s") and r.get("tokens_per_s"):
            r["tokens_per_s_vs_full"] = r["tokens_per_s"] / base["tokens_per_s"]
    return rows


def table(rows: list[dict]) -> str:
    columns = [("params_gib", "params GiB", "{:.3g}"), ("optimizer_gib", "optimizer GiB", "{:.3g}"),
               ("temp_gib", "temp GiB", "{:.3g}"), ("update_gib", "update GiB", "{:.3g}"),
               ("engine_gib", "engine GiB", "{:.3g}"), ("kv_tokens", "KV tokens", "{}"),
               ("tokens_per_s", "update tok/s", "{:.0f}"), ("update_gib_vs_full", "update GiB vs full", "{:.3g}"),
               ("tokens_per_s_vs_full", "tok/s vs full", "{:.3g}")]
    lines = ["| size | way | rank | " + " | ".join(title for _, title, _ in columns) + " |",
             "|---" * (3 + len(columns)) + "|"]
    for r in rows:
        cells = [form.format(r[key]) if r.get(key) is not None else "-" for key, _, form in columns]
        lines.append(f"| {r['size']} | {r['way']} | {r['rank']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1.7b,4b", help=f"of {', '.join(QWEN3)}")
    parser.add_argument("--ranks", default="16,64", help="LoRA ranks; the full model (rank 0) always runs first")
    parser.add_argument("--impls", default="in_layer,merged", help="model.lora.impl forms to measure")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed updates per row (after one warm-up)")
    parser.add_argument("--base-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--engine-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--attention-impl", choices=("cudnn", "xla"), default=None,
                        help="default: cudnn on GPUs, xla elsewhere")
    parser.add_argument("--lm-head-dtype", choices=("param", "compute"), default="compute",
                        help="compute: every row's lm head in bfloat16, so float32 full-model params do not "
                             "slow its baseline (docs/benchmarks.md)")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="device memory for the estimate; default: the device's bytes_limit, else 80")
    parser.add_argument("--min-kv-tokens", type=int, default=65536, help="KV cache a run needs to 'fit'")
    parser.add_argument("--no-fit-search", action="store_true")
    parser.add_argument("--time", action="store_true", help="also run the updates and report tokens/s")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape, 2 x 64 tokens, a 1 GiB budget (CPU)")
    parser.add_argument("--out", default="lora_memory.json")
    args = parser.parse_args()
    device = jax.devices()[0]
    args.attention_impl = args.attention_impl or ("cudnn" if device.platform == "gpu" else "xla")
    if args.tiny:
        args.sizes, args.rows, args.seq, args.time, args.min_kv_tokens = "tiny", 2, 64, True, 1024
        args.budget_gib = args.budget_gib or 1.0
    limit = (device.memory_stats() or {}).get("bytes_limit")
    budget = int(args.budget_gib * GiB) if args.budget_gib else (limit or 80 * GiB)
    ranks = [int(r) for r in args.ranks.split(",")]
    impls = args.impls.split(",")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip() or None
    except OSError:
        commit = None
    header = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__, "commit": commit,
              "rows": args.rows, "seq": args.seq, "budget_gib": budget / GiB, "base_dtype": args.base_dtype,
              "engine_dtype": args.engine_dtype, "attention_impl": args.attention_impl,
              "lm_head_dtype": args.lm_head_dtype, "min_kv_tokens": args.min_kv_tokens}
    print(json.dumps(header), flush=True)
    rows: dict[tuple, dict] = {}
    fit: dict[str, dict] = {}

    def write() -> list[dict]:  # after every row, so a run cut short still leaves its results
        measured = with_ratios(list(rows.values()))
        Path(args.out).write_text(json.dumps({**header, "rows": measured, "largest_fitting": fit}, indent=1))
        return measured

    sizes = args.sizes.split(",")
    for size in sizes:
        for rank, impl in [(0, "-"), *((r, i) for r in ranks for i in impls)]:
            rows[(size, rank, impl)] = measure(size, rank, impl, args, budget, timed=args.time)
            print(json.dumps(rows[(size, rank, impl)]), flush=True)
            write()
    if not args.no_fit_search:
        for rank, impl in [(0, "-"), *((min(ranks), i) for i in impls)]:
            way = "full" if rank == 0 else f"lora_{impl}_r{rank}"
            fit[way] = largest_fitting((rank, impl), sizes[0], rows, args, budget)
            print(json.dumps({"largest_fitting": way, **fit[way]}), flush=True)
            write()
    print(table(write()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
