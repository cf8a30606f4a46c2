"""RL update throughput on a variable-length batch: padded rows vs packed token-budget rows.

One RL update as the trainer runs it, at a Qwen3 shape with random weights, on a batch of
``--episodes`` trajectories with ragged lengths (prompt 40-120 tokens, response 64-900):

- padded: one trajectory per row, rows padded to the bucketed longest (1024), a separate
  old-logprob forward, micro-batches of ``--micro-rows`` rows (what ``train()`` did);
- packed: first-fit-decreasing rows of ``--row-tokens`` tokens, cuDNN's packed
  flash-attention kernel, micro-batches of ``--micro-tokens`` tokens, and the old logprobs
  taken from the update's own forward (on-policy, one minibatch);
- dense: ``bench/train_step.py``'s shape (``--dense`` rows x ``--row-tokens``, every token
  real), the ceiling the RL update is compared with.

Tokens/s counts real (non-padding) tokens over the whole update (old pass included). Then,
per row length in ``--memory-rows`` and segment bound in ``--memory-segments``, the compiled
peak memory (arguments + temporaries) of one packed update on a single row of that many
tokens (bound 1: one trajectory in the row, which the trainer runs mask-free; bound M > 1:
cuDNN's packed kernel compiled for up to M trajectories).

    python bench/packing.py --size 1.7b
    python bench/packing.py --only memory --memory-rows 16384 --memory-segments 1,2,64  # the bound's cost
    python bench/packing.py --size tiny --episodes 8 --row-tokens 512 --memory-rows 256  # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from agentrl_jax.losses import global_normalizer  # noqa: E402
from agentrl_jax.models import Decoder, DecoderConfig, split_params  # noqa: E402
from agentrl_jax.train.batch import TokenRecord, build_batch  # noqa: E402
from agentrl_jax.train.packing import pack_arrays, packing_stats, plan_packing  # noqa: E402
from agentrl_jax.train.step import (  # noqa: E402
    LossSettings,
    TrainState,
    forward_logprobs,
    init_train_state,
    update_step,
)
from bench.train_step import SHAPES  # noqa: E402

FIELDS = ("input_ids", "positions", "segment_ids", "targets", "loss_mask", "advantages", "sequence_ids",
          "rollout_logprobs")
HPARAMS = (("eps_high", 0.28), ("eps_low", 0.2))


def rl_batch(episodes: int, vocab: int, max_response: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Padded arrays of ``episodes`` ragged trajectories (loss on the response only)."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(episodes):
        prompt, response = int(rng.integers(40, 121)), int(rng.integers(64, max_response + 1))
        n = prompt + response
        mask = (np.arange(n) >= prompt).astype(int)
        records.append(TokenRecord(rng.integers(0, vocab, n).tolist(), mask.tolist(), (-2.0 * mask).tolist(),
                                   [0] * n, (mask * rng.normal()).tolist()))
    batch = build_batch(records)
    return {k: np.asarray(getattr(batch, k)) for k in FIELDS}


# The Decoder options of every model a run builds (--remat, --lm-head-dtype).
MODEL_OPTIONS = {"remat": "full", "lm_head_dtype": "param"}


def _model(cfg: DecoderConfig, attention: str | None):
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    model = Decoder(cfg, dtype=jnp.bfloat16 if on_accelerator else jnp.float32, attention_impl=attention,
                    rngs=nnx.Rngs(0), **MODEL_OPTIONS)
    return split_params(model)


def _timed(fn, steps: int) -> tuple[float, float]:
    """(compile + first call s, median of ``steps`` later calls s)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


def _update(graphdef, optimizer, settings, micro: int, num_sequences):
    return jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=optimizer, settings=settings,
                                     num_micro_batches=micro, num_sequences=num_sequences), donate_argnums=(0,))


def run_padded(cfg, padded, micro_rows: int, steps: int, attention, separate_old: bool = True) -> dict:
    graphdef, params = _model(cfg, attention)
    optimizer = optax.adamw(1e-6)
    holder = {"state": init_train_state(params, optimizer, 0)}
    rows = padded["input_ids"].shape[0]
    settings = LossSettings(loss="ppo", hparams=HPARAMS, chunk_size=2048)
    logprob = jax.jit(functools.partial(forward_logprobs, graphdef, temperature=1.0, chunk_size=2048))
    update = _update(graphdef, optimizer, settings, rows // micro_rows, None)
    arrays = {k: jnp.asarray(v) for k, v in padded.items()}
    z = global_normalizer(arrays["loss_mask"], "token-mean")

    def one():
        state = holder["state"]
        if separate_old:
            old = jnp.concatenate([logprob(state.params, {k: v[s : s + micro_rows] for k, v in arrays.items()})
                                   for s in range(0, rows, micro_rows)])
        else:
            old = arrays["rollout_logprobs"]
        holder["state"], metrics = update(state, dict(arrays, old_logprobs=old), z)
        return metrics["loss"]

    first, step_s = _timed(one, steps)
    return {"layout": "padded", "rows": rows, "row_tokens": padded["input_ids"].shape[1], "first_s": first,
            "step_s": step_s}


def run_packed(cfg, padded, row_tokens: int, micro_tokens: int, steps: int, attention,
               segments: int | None = None) -> dict:
    """``segments``: the kernel's segment bound; None: the plan's (what the trainer runs), 0: the
    segment mask instead of cuDNN's packed kernel."""
    graphdef, params = _model(cfg, attention)
    optimizer = optax.adamw(1e-6)
    holder = {"state": init_train_state(params, optimizer, 0)}
    lengths = padded["segment_ids"].sum(axis=1)
    plan = plan_packing(lengths, row_tokens, padded_length=padded["input_ids"].shape[1],
                        micro_batch_tokens=micro_tokens, max_segments=64)
    segments = plan.segment_bound if segments is None else segments
    arrays = {k: jnp.asarray(v) for k, v in pack_arrays(plan, padded).items()}
    settings = LossSettings(loss="ppo", hparams=HPARAMS, chunk_size=2048, packed=True, max_segments=segments,
                            old_from_current=True)
    update = _update(graphdef, optimizer, settings, plan.num_micro_batches, len(lengths))
    z = global_normalizer(jnp.asarray(padded["loss_mask"]), "token-mean")

    def one():
        holder["state"], metrics = update(holder["state"], arrays, z)
        return metrics["loss"]

    first, step_s = _timed(one, steps)
    return {"layout": "packed", "rows": plan.num_rows, "row_tokens": row_tokens, "first_s": first,
            "step_s": step_s, "segment_bound": segments, **packing_stats(plan)}


def run_dense(cfg, rows: int, row_tokens: int, steps: int, attention) -> dict:
    """train_step.py's update: ``rows`` full rows, one sequence each, no old-logprob pass."""
    ones = np.ones(row_tokens, int)
    records = [TokenRecord(np.arange(row_tokens).tolist(), ones.tolist(), (-2.0 * ones).tolist(),
                           [0] * row_tokens, ones.tolist()) for _ in range(rows)]
    batch = build_batch(records, row_length=row_tokens)
    out = run_padded(cfg, {k: np.asarray(getattr(batch, k)) for k in FIELDS}, rows, steps, attention,
                     separate_old=False)
    return dict(out, layout="dense")


def peak_bytes(cfg, row_tokens: int, attention, segments: int = 2, packed: bool = True) -> dict:
    """Compiled memory of one update on one row of ``row_tokens`` tokens (nothing runs).

    ``packed``: the row as a packed row with segment bound ``segments`` (1: one trajectory,
    run mask-free; > 1: cuDNN's packed kernel; 0: the segment mask); otherwise as one padded
    trajectory (the mask-free ``lengths`` path, unpacked losses).
    """
    graphdef, params = nnx.eval_shape(lambda: _model(cfg, attention))
    optimizer = optax.adamw(1e-6)
    state = jax.eval_shape(lambda p: TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32),
                                                jax.random.key_data(jax.random.key(0))), params)
    ints = jax.ShapeDtypeStruct((1, row_tokens), jnp.int32)
    floats = jax.ShapeDtypeStruct((1, row_tokens), jnp.float32)
    batch = {k: ints for k in ("input_ids", "positions", "segment_ids", "targets", "sequence_ids")}
    batch.update({k: floats for k in ("loss_mask", "advantages", "rollout_logprobs")})
    settings = LossSettings(loss="ppo", hparams=HPARAMS, chunk_size=2048, packed=packed,
                            max_segments=segments if packed else 0, old_from_current=True)
    update = _update(graphdef, optimizer, settings, 1, 64 if packed else None)
    mem = update.lower(state, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile().memory_analysis()
    peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    return {"row_tokens": row_tokens, "packed": packed, "segment_bound": segments if packed else None,
            "peak_gib": peak / 2**30, "temp_gib": mem.temp_size_in_bytes / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.7b", choices=sorted(SHAPES))
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--max-response", type=int, default=900)
    p.add_argument("--micro-rows", type=int, default=8)
    p.add_argument("--row-tokens", type=int, default=4096)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--dense", type=int, default=4, help="rows of the dense baseline (0: skip)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--memory-rows", default="8192,16384,32768", help="row lengths for the memory table ('': skip)")
    p.add_argument("--memory-sizes", default="", help="shapes for the memory table (default: --size)")
    p.add_argument("--memory-layouts", default="packed", help="'packed', 'padded' or both (comma-separated)")
    p.add_argument("--memory-segments", default="1,2", help="segment bounds of the packed memory rows")
    p.add_argument("--segments", type=int, default=None,
                   help="segment bound of the packed throughput run (default: the plan's, as the trainer)")
    p.add_argument("--only", default="padded,packed,dense,memory")
    p.add_argument("--out", default=None, help="append result lines (JSON) to this file")
    p.add_argument("--remat", default="full", help="model.remat of every model")
    p.add_argument("--lm-head-dtype", default="param", choices=["param", "compute"], help="model.lm_head_dtype")
    p.add_argument("--masked-packed", action="store_true",
                   help="packed rows through the segment mask instead of cuDNN's packed kernel (GPU)")
    args = p.parse_args()
    MODEL_OPTIONS.update(remat=args.remat, lm_head_dtype=args.lm_head_dtype)
    # the fused kernel of each accelerator (train.build.attention_implementation's "auto")
    attention = {"gpu": "cudnn", "tpu": "splash"}.get(jax.default_backend(), "xla")
    cfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[args.size])
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  shape {args.size}  {MODEL_OPTIONS}",
          flush=True)

    segments = 0 if args.masked_packed else args.segments

    def emit(row):
        row = dict(row, **MODEL_OPTIONS)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    def attempt(name, fn):
        try:
            emit(fn())
        except Exception as e:  # a one-shot device run reports every measurement it can
            emit({"layout": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})

    padded = rl_batch(args.episodes, cfg.vocab_size, min(args.max_response, args.row_tokens - 120))
    real = float(padded["segment_ids"].sum())
    only = args.only.split(",")
    def throughput(r):
        return dict(r, size=args.size, real_tokens=real, tokens_per_s=real / r["step_s"])

    if "padded" in only:
        attempt("padded", lambda: throughput(run_padded(cfg, padded, args.micro_rows, args.steps, attention)))
    if "packed" in only:
        attempt("packed", lambda: throughput(run_packed(cfg, padded, args.row_tokens, args.micro_tokens, args.steps,
                                                        attention, segments)))
    if "dense" in only and args.dense:
        attempt("dense", lambda: dict(r := run_dense(cfg, args.dense, args.row_tokens, args.steps, attention),
                                      size=args.size, tokens_per_s=args.dense * args.row_tokens / r["step_s"]))
    if "memory" in only and args.memory_rows:
        for size in (args.memory_sizes or args.size).split(","):
            mcfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[size])
            for n in (int(x) for x in args.memory_rows.split(",")):
                variants = [(layout == "packed", int(m)) for layout in args.memory_layouts.split(",")
                            for m in (args.memory_segments.split(",") if layout == "packed" else "0")]
                for packed, m in variants:
                    attempt("memory", lambda: dict(peak_bytes(mcfg, n, attention, 0 if args.masked_packed else m,
                                                              packed), size=size, layout="memory"))


if __name__ == "__main__":
    main()
