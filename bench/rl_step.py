"""Step-time breakdown of real RL steps at a Qwen3 shape (default 1.7B), through `train()`.

The whole product path: HF checkpoint load onto the mesh, the rollout engine and driver
(continuous batching, 64 slots), the sandbox pool and the arithmetic environment, rewards,
advantages, the old-logprob forward, the jitted PPO update, the weight sync. Weights are
random (no download), so the policy writes noise: each episode is one turn of
`--new-tokens` tokens (no stop string is ever sampled), which makes the rollout the
worst case of decoding for that budget. The tokenizer is the demo's tiny one; ids beyond
its vocabulary decode to nothing.

    python bench/rl_step.py --size 1.7b --steps 3
    python bench/rl_step.py --size tiny --steps 2     # CPU smoke run
    python bench/rl_step.py --size 1.7b --steps 3 --pack   # packed rows (algorithm.pack_rows)
    python bench/rl_step.py --size 1.7b --steps 3 --pack --remat dots_attention_saveable --lm-head-dtype compute

Prints the per-step `time/*` metrics of the last step (compiles are in the first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                 num_kv_heads=8, head_dim=128),
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
               num_kv_heads=8, head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16),
}


def prepare_assets(work: str, size: str) -> tuple[str, str]:
    """(model dir, tokenizer dir) under ``work``: random Qwen3 weights of ``size`` and the demo's
    tiny tokenizer (ids beyond its vocabulary decode to nothing); reused when already there."""
    from agentrl_jax.envs import demonstration, make_tasks
    from agentrl_jax.models.tiny import save_tiny_hf_checkpoint, train_tiny_tokenizer

    tok_dir, model_dir = os.path.join(work, "tokenizer"), os.path.join(work, "model")
    if not os.path.exists(os.path.join(tok_dir, "tokenizer_config.json")):
        import numpy as np

        rng = np.random.default_rng(0)
        tasks = make_tasks(200, 3, seed=0)
        corpus = [m["content"] for t in tasks for m in demonstration(t, "tool", rng)]
        train_tiny_tokenizer(tok_dir, corpus + [t["question"] for t in tasks], 384, individual_digits=True)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        save_tiny_hf_checkpoint(model_dir, "qwen3", tie_word_embeddings=True, **SHAPES[size])
    return model_dir, tok_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.7b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--pack", action="store_true",
                   help="algorithm.pack_rows: rows of 4096 tokens, micro-batches of 8192 tokens")
    p.add_argument("--remat", default="full", help="model.remat")
    p.add_argument("--lm-head-dtype", default="param", choices=["param", "compute"], help="model.lm_head_dtype")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another config override, applied last (e.g. async_rl.release_kv_cache=false)")
    args = p.parse_args()

    import jax

    from agentrl_jax.config import load_config
    from agentrl_jax.train.run import train

    work = args.work_dir or tempfile.mkdtemp(prefix="rl_step_")
    model_dir, tok_dir = prepare_assets(work, args.size)
    on_gpu = jax.default_backend() == "gpu"
    overrides = [
        f"output_dir={os.path.join(work, 'run')}", f"model.path={model_dir}", f"model.tokenizer_path={tok_dir}",
        f"model.compute_dtype={'bfloat16' if on_gpu else 'float32'}", f"model.remat={args.remat}",
        f"model.lm_head_dtype={args.lm_head_dtype}",
        f"rollout.cache_dtype={'bfloat16' if on_gpu else 'float32'}",
        f"rollout.max_concurrent={args.prompts * args.group}", f"rollout.max_new_tokens_per_turn={args.new_tokens}",
        f"rollout.max_sequence_length={max(1024, 2 * args.new_tokens)}", "rollout.steps_per_dispatch=32",
        f"data.prompts_per_step={args.prompts}", f"algorithm.group_size={args.group}",
        f"algorithm.micro_batch_size={args.group}", "algorithm.entropy_coef=0.001",
        "sft.steps=0", f"total_steps={args.steps}", "eval.num_tasks=4", "eval.samples_per_task=1",
        "checkpoint.resume=false", "environment.max_turns=1", "logging.sample_trajectories=0",
    ]
    if args.pack:
        overrides += ["algorithm.pack_rows=true", "algorithm.pack_row_tokens=4096", "algorithm.micro_batch_tokens=8192"]
    train(load_config("demo", overrides + args.set))
    rows = [json.loads(line) for line in open(os.path.join(work, "run", "metrics", "metrics.jsonl"))]
    steps = [r for r in rows if "time/rollout" in r]
    last = steps[-1]
    print(f"\ndevice: {jax.devices()[0].device_kind}  shape: {args.size}  "
          f"{args.prompts}x{args.group} episodes/step, {args.new_tokens} new tokens each")
    print("| step | rollout s | update s | sync s | sampled tokens | rollout tok/s | train tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['step']} | {r['time/rollout']:.2f} | {r['time/update']:.2f} | {r['time/sync']:.3f} "
              f"| {r['rollout/sampled_tokens']:.0f} | {r['throughput/sampled_tokens_per_s']:.0f} "
              f"| {r['train_tokens']:.0f} |")
    print(json.dumps({k: v for k, v in last.items() if k.startswith("time/")}))
    # the engine's counters, cumulative since the driver started (evaluations included)
    print(json.dumps({k: v for k, v in last.items() if k.startswith("rollout/engine/")}))


if __name__ == "__main__":
    main()
