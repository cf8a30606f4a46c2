"""GRPO update throughput and MFU: agentrl_jax vs HF transformers (PyTorch), same run.

For Qwen3 shapes with random weights (no download), one optimizer update over
``--rows`` x ``--seq`` tokens: forward, chunked tempered logprobs, PPO-clip loss with a
loss mask, backward, AdamW. The baseline does the same in PyTorch with
``transformers.Qwen3ForCausalLM`` (bf16 autocast, SDPA attention, gradient checkpointing,
full logits, the same masked PPO loss, torch.optim.AdamW), measured in the same process.

    python bench/train_step.py --sizes 1.7b,4b --seq 4096 --rows 4
    python bench/train_step.py --sizes 1.7b --rows 4,8 --remat full,dots_saveable,none   # a sweep
    python bench/train_step.py --tiny          # seconds on CPU, checks the script runs

``--rows`` and ``--remat`` take comma-separated lists: every (rows, remat) pair is one JAX
measurement, and PyTorch (always full gradient checkpointing) runs once per row count.

MFU counts model FLOPs (6 N per token for the matmuls incl. the lm head, plus causal
attention 6 L T H K per token), not the rematerialized recompute, over the card's dense
bf16 peak.
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

from agentrl_jax.losses import global_normalizer
from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.decoder import REMAT_POLICIES
from agentrl_jax.train.step import LossSettings, init_train_state, update_step

SHAPES = {
    # Qwen3 dense configs (published config.json values).
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
}

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def device_peak() -> tuple[str, float | None]:
    d = jax.devices()[0]
    name = getattr(d, "device_kind", d.platform)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return name, peak
    return name, None


def model_flops_per_token(cfg: DecoderConfig, seq: int) -> float:
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    H, KV, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = D * H * K * 2 + D * KV * K * 2 + 3 * D * F  # q,o + k,v + mlp
    matmul_params = L * per_layer + D * V  # + lm head
    attention = L * 2 * seq * H * K  # QK^T and PV, causal half of 2*T*H*K*2, per token forward
    return 6 * matmul_params + 3 * attention


def make_batch(rows: int, seq: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, seq)).astype(np.int32)
    prompt = seq // 8
    mask = np.zeros((rows, seq), np.float32)
    mask[:, prompt:-1] = 1.0
    adv = rng.normal(size=(rows, 1)).astype(np.float32) * mask
    return ids, mask, adv


def build_update(cfg: DecoderConfig, rows: int, seq: int, param_dtype, remat: str,
                 attention: str | None = None, chunk_size: int = 2048, lm_head_dtype: str = "param"):
    """``(step, state, batch, normalizer)``: the jitted update of this benchmark and its inputs."""
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=param_dtype, remat=remat, attention_impl=attention,
                    lm_head_dtype=lm_head_dtype, rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    del model
    ids, mask, adv = make_batch(rows, seq, cfg.vocab_size)
    batch = {
        "input_ids": jnp.asarray(ids),
        "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
        "segment_ids": jnp.ones((rows, seq), jnp.int32),
        "targets": jnp.asarray(np.roll(ids, -1, axis=1)),
        "loss_mask": jnp.asarray(mask),
        "advantages": jnp.asarray(adv),
        "old_logprobs": jnp.full((rows, seq), -5.0, jnp.float32) * jnp.asarray(mask),
        "rollout_logprobs": jnp.zeros((rows, seq), jnp.float32),
        "sequence_ids": jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, seq)),
    }
    optimizer = optax.adamw(1e-6)
    state = init_train_state(params, optimizer, 0)
    settings = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)), chunk_size=chunk_size)
    step = jax.jit(
        functools.partial(update_step, graphdef=graphdef, optimizer=optimizer, settings=settings,
                          num_micro_batches=1, num_sequences=None),
        donate_argnums=(0,),
    )
    return step, state, batch, global_normalizer(batch["loss_mask"], "token-mean")


def bench_jax(cfg: DecoderConfig, rows: int, seq: int, steps: int, param_dtype, remat: str,
              attention: str | None = None, chunk_size: int = 2048, lm_head_dtype: str = "param") -> dict:
    step, state, batch, z = build_update(cfg, rows, seq, param_dtype, remat, attention, chunk_size, lm_head_dtype)
    t0 = time.perf_counter()
    state, metrics = step(state, batch, z)
    jax.block_until_ready(metrics["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, batch, z)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    peak = jax.devices()[0].memory_stats() or {}
    return {"step_s": float(np.median(times)), "compile_s": compile_s, "loss": float(metrics["loss"]),
            "peak_gib": peak.get("peak_bytes_in_use", 0) / 2**30}


def bench_torch(cfg: DecoderConfig, rows: int, seq: int, steps: int, param_dtype: str) -> dict:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=max(seq, 4096), attn_implementation="sdpa", use_cache=False,
    )
    torch_dtype = torch.float32 if param_dtype == "float32" else torch.bfloat16
    model = transformers.Qwen3ForCausalLM(hf_cfg).to(device=device, dtype=torch_dtype)
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")
    ids, mask, adv = make_batch(rows, seq, cfg.vocab_size)
    ids_t = torch.tensor(ids, device=device)
    targets = torch.tensor(np.roll(ids, -1, axis=1), device=device, dtype=torch.long)
    mask_t = torch.tensor(mask, device=device)
    adv_t = torch.tensor(adv, device=device)
    old = -5.0 * mask_t

    def one_step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=ids_t).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv_t, torch.clamp(ratio, 0.8, 1.28) * adv_t)
        loss = -(surrogate * mask_t).sum() / mask_t.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    one_step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = one_step()
        sync()
        times.append(time.perf_counter() - t0)
    out = {"step_s": float(np.median(times)), "loss": float(loss.detach())}
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _run_worker(kind: str, size: str, rows: int, remat: str, args) -> dict:
    """One measurement in a fresh process, so JAX's and PyTorch's allocators never share the card."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--sizes", size, "--seq", str(args.seq),
           "--rows", str(rows), "--steps", str(args.steps), "--param-dtype", args.param_dtype,
           "--remat", remat, "--attention", args.attention, "--chunk-size", str(args.chunk_size),
           "--lm-head-dtype", args.lm_head_dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{kind} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1.7b,4b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rows", default="4", help="rows per update (comma-separated list)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--remat", default="full", help=f"comma-separated list of {REMAT_POLICIES}")
    p.add_argument("--chunk-size", type=int, default=2048, help="tokens per logprob chunk")
    p.add_argument("--lm-head-dtype", default="param", choices=["param", "compute"],
                   help="model.lm_head_dtype: the logits matmul reads the embedding as stored (param: "
                        "float32) or in the compute dtype (compute: bfloat16)")
    p.add_argument("--worker-timeout", type=float, default=600, help="seconds per measurement")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn", "splash"])
    p.add_argument("--tiny", action="store_true", help="tiny shape, short sequence: a CPU smoke run")
    p.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.tiny:
        args.sizes, args.seq, args.rows, args.steps = "tiny", 128, "2", 2
    remats = args.remat.split(",")
    unknown = sorted(set(remats) - set(REMAT_POLICIES))
    if unknown:
        p.error(f"--remat: unknown {unknown}; choose from {REMAT_POLICIES}")
    if args.worker:
        cfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[args.sizes])
        if args.worker == "jax":
            pdt = jnp.float32 if args.param_dtype == "float32" else jnp.bfloat16
            impl = None if args.attention == "auto" else args.attention
            result = bench_jax(cfg, int(args.rows), args.seq, args.steps, pdt, args.remat, impl, args.chunk_size,
                               args.lm_head_dtype)
        else:
            result = bench_torch(cfg, int(args.rows), args.seq, args.steps, args.param_dtype)
        print("RESULT " + json.dumps(result))
        return
    name, peak = device_peak()
    print(f"device: {name} x{jax.device_count()}  jax {jax.__version__}  peak bf16: {peak}", flush=True)
    rows_out = []
    for size in args.sizes.split(","):
        cfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[size])
        for rows in (int(r) for r in args.rows.split(",")):
            rows_out += _measure(size, cfg, rows, remats, peak, args)
    print("\n| shape | tokens/update | remat | agentrl_jax tok/s | MFU | HF torch tok/s | MFU | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        if "jax_step_s" not in r:
            continue
        print(f"| {r['size']} | {r['rows']}x{r['seq']} | {r['remat']} | {r['jax_tokens_per_s']:.0f} "
              f"| {r.get('jax_mfu', float('nan')):.1%} | {r.get('torch_tokens_per_s', float('nan')):.0f} "
              f"| {r.get('torch_mfu', float('nan')):.1%} | {r.get('speedup', float('nan')):.2f}x |")


def _measure(size: str, cfg: DecoderConfig, rows: int, remats: list[str], peak: float | None, args) -> list[dict]:
    """One JAX measurement per remat policy and one PyTorch baseline, at ``rows`` x ``--seq``."""
    tokens = rows * args.seq
    flops = model_flops_per_token(cfg, args.seq) * tokens
    torch_row = {}
    if not args.no_torch:
        try:
            t = _run_worker("torch", size, rows, "full", args)
            torch_row = dict(torch_step_s=t["step_s"], torch_tokens_per_s=tokens / t["step_s"])
            if peak:
                torch_row["torch_mfu"] = flops / t["step_s"] / peak
        except Exception as e:  # a one-shot device run reports every measurement it can
            torch_row = {"torch_error": f"{type(e).__name__}: {str(e)[-400:]}"}
    out = []
    for remat in remats:
        row = {"size": size, "seq": args.seq, "rows": rows, "param_dtype": args.param_dtype, "remat": remat,
               "attention": args.attention, "chunk_size": args.chunk_size,
               "lm_head_dtype": args.lm_head_dtype, **torch_row}
        try:
            j = _run_worker("jax", size, rows, remat, args)
            row.update(jax_step_s=j["step_s"], jax_tokens_per_s=tokens / j["step_s"], jax_compile_s=j["compile_s"],
                       jax_peak_gib=j["peak_gib"])
            if peak:
                row["jax_mfu"] = flops / j["step_s"] / peak
            if "torch_step_s" in row:
                row["speedup"] = row["torch_step_s"] / j["step_s"]
        except Exception as e:
            row["jax_error"] = f"{type(e).__name__}: {str(e)[-400:]}"
        print(json.dumps(row), flush=True)
        out.append(row)
    return out

if __name__ == "__main__":
    main()
