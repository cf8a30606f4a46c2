"""Synchronous vs step-granular asynchronous vs streaming RL, with slow tools and without.

The whole product path (`train(config, make_env=...)`: HF checkpoint load, engine, driver,
sandbox pool, rewards, old-logprob forward, PPO update, weight push) at a Qwen3 shape
with random weights, in an environment whose every turn ends in a tool call with a
heavy-tailed latency (log-normal, median `--tool-median` s, sigma `--tool-sigma`, capped at
`--tool-cap` s: the spread of real code-interpreter calls). Each episode is `--turns` turns
of `--new-tokens` sampled tokens (random weights never stop early).

One run per mode and tool latency, each in its own process (JAX preallocates the cards):
- sync: `async_rl.enabled=false`, one mesh over every device (rollout, then update);
- async: `async_rl.enabled=true`, `mode=step`, placement by `--placement` (disaggregated:
  half the devices decode, half train; colocated: one device does both), `max_staleness`,
  old logprobs by `--old-logprobs`;
- stream: the same with `mode=stream` (groups start one by one, steps take finished groups).
Each mode runs at every median of `--tool-medians` (default 1 s and the 0 s reference).

    python bench/async_step.py --size 1.7b --steps 16 --warmup 3 --max-staleness 4  # 2 GPUs
    python bench/async_step.py --size 1.7b --steps 6 --placement colocated     # 1 GPU
    python bench/async_step.py --size tiny --steps 3 --cpu 4                   # CPU smoke run

With `--work-dir`, the rows of earlier calls on that directory (same device) join the
report: `--tool-medians 1` and then `--tool-medians 0` give the whole comparison.

Prints the device, per-step wall times after the warm-up steps (for async and stream also
without the first and last `--max-staleness` steps: the buffer's ramp and drain, see
`steady_window`), trajectories/s and sampled
tokens/s (per wall second of the steady steps), idle times, the ratios to sync at each
latency, and each mode's tokens/s with tools over its tokens/s without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.rl_step import SHAPES, prepare_assets  # noqa: E402
from bench.workers import stop_workers_with_the_bench  # noqa: E402


def latency_env(turns: int, median: float, sigma: float, cap: float, seed: int):
    """make_env for train(): every turn is a tool call with a log-normal latency."""
    from agentrl_jax.envs.base import Environment, StepResult

    rng = random.Random(seed)

    class LatencyToolEnv(Environment):
        def __init__(self):
            self.turn = 0

        async def reset(self, task):
            self.turn = 0
            return [{"role": "user", "content": task["question"]}]

        async def step(self, action_text: str) -> StepResult:
            self.turn += 1
            if median > 0:
                await asyncio.sleep(min(rng.lognormvariate(0.0, sigma) * median, cap))
            if self.turn >= turns:
                return StepResult("", float(len(action_text) % 2), True, finish_reason="answer")
            return StepResult("<interpreter>42</interpreter>", 0.0, False)

    return lambda config, pool, verifier, tokenizer: LatencyToolEnv


def run_one(args) -> None:
    import jax

    from agentrl_jax.config import load_config
    from agentrl_jax.train.run import train

    work = args.work_dir
    model_dir, tok_dir = prepare_assets(work, args.size)
    on_gpu = jax.default_backend() == "gpu"
    dtype = "bfloat16" if on_gpu else "float32"
    episodes = args.prompts * args.group
    overrides = [
        f"output_dir={os.path.join(work, args.mode)}", f"model.path={model_dir}", f"model.tokenizer_path={tok_dir}",
        f"model.compute_dtype={dtype}", f"rollout.cache_dtype={dtype}", "model.remat=full",
        # slots for every episode the pipelines may keep in flight (max_staleness + 1 steps' worth), in every mode
        f"rollout.max_concurrent={episodes * (args.max_staleness + 1)}", f"rollout.max_new_tokens_per_turn={args.new_tokens}",
        f"rollout.max_sequence_length={max(256, 2 * args.turns * args.new_tokens)}",
        "rollout.max_prompt_length=128", "rollout.steps_per_dispatch=32",
        f"data.prompts_per_step={args.prompts}", f"algorithm.group_size={args.group}",
        f"algorithm.micro_batch_size={args.group}", "algorithm.entropy_coef=0.001",
        "sft.steps=0", f"total_steps={args.steps}", "eval.num_tasks=2", "eval.samples_per_task=1",
        "checkpoint.resume=false", f"environment.max_turns={args.turns}", "logging.sample_trajectories=0",
    ]
    if args.mode in ("async", "stream"):
        overrides += ["async_rl.enabled=true", f"async_rl.mode={'step' if args.mode == 'async' else 'stream'}",
                      f"async_rl.placement={args.placement}",
                      f"async_rl.max_staleness={args.max_staleness}", f"async_rl.old_logprobs={args.old_logprobs}"]
        if args.old_logprobs != "snapshot":
            overrides.append("algorithm.correction=tis")
    out = os.path.join(work, f"{args.mode}_{args.tool_median:g}")
    overrides[0] = f"output_dir={out}"
    train(load_config("demo", overrides),
          make_env=latency_env(args.turns, args.tool_median, args.tool_sigma, args.tool_cap, seed=0))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics", "metrics.jsonl"))]
    steps = [r for r in rows if "time/step" in r]
    print("RESULT " + json.dumps({"device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
                                  "steps": steps}))


def steady_window(mode: str, steps: list[dict], warmup: int, max_staleness: int) -> list[dict]:
    """The steps the means are over. After ``warmup`` (compiles); for the pipelined modes also
    ``max_staleness`` steps less at each end: during the warm-up's long steps up to that many
    steps' groups finish ahead (the ramp: the next steps train from a full buffer), and the last
    that many steps train groups admitted before them while nothing new is admitted (the drain:
    the engine idles). Both would count the trainer's speed as the pipeline's."""
    edge = max_staleness if mode != "sync" else 0
    steady = steps[warmup + edge:len(steps) - edge]
    if not steady:
        raise SystemExit(f"{mode}: no steady step to time: --steps {len(steps)} must exceed --warmup {warmup}"
                         f" + 2 x max_staleness {edge} (the ramp and the drain)")
    return steady


def summarize(mode: str, steps: list[dict], warmup: int, tool_median: float = 1.0, max_staleness: int = 0) -> dict:
    import numpy as np

    steady = steady_window(mode, steps, warmup, max_staleness)
    empty = [s.get("step") for s in steady if s.get("train/empty_batch")]
    if empty:  # a step that trained nothing would time a rollout only: not an RL step
        finishes = {k: v for k, v in steady[0].items() if k.startswith("rollout/finish/") and v}
        raise SystemExit(f"{mode}: steps {empty} trained no token (every episode masked; finish reasons of the "
                         f"first: {finishes}); fix the environment before reading the times")
    mean = lambda key: float(np.mean([s.get(key, 0.0) for s in steady]))  # noqa: E731
    pipelined = mode != "sync"
    return {
        "mode": mode, "tool_median": tool_median, "step_s": mean("time/step"), "rollout_s": mean("time/rollout"), "update_s": mean("time/update"),
        "trainer_idle_s": mean("time/trainer_idle") if pipelined else mean("time/rollout"),
        "rollout_idle_s": mean("time/rollout_idle") if pipelined else mean("time/update") + mean("time/sync"),
        # trajectories per step / mean step time (a mean of per-step ratios would overweight
        # the async steps whose batch was already rolled out)
        "traj_per_s": float(np.mean([s["rollout/trajectories"] for s in steady])) / mean("time/step"),
        "tokens_per_s": mean("rollout/sampled_tokens") / mean("time/step"),
        "staleness": mean("async/token_staleness_mean"),
        "mixed": mean("async/mixed_version_fraction"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.7b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from the means (compiles)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tool-medians", default="1,0", help="tool latency medians (s) to run each mode at; 0: no wait")
    p.add_argument("--tool-median", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--tool-sigma", type=float, default=1.0)
    p.add_argument("--tool-cap", type=float, default=10.0)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--old-logprobs", default="snapshot", choices=["recompute", "snapshot", "ewma"])
    p.add_argument("--placement", default="disaggregated", choices=["disaggregated", "colocated"],
                   help="async and stream: the engine and the trainer on separate devices, or sharing them (1 GPU)")
    p.add_argument("--modes", default="sync,async,stream")
    p.add_argument("--cpu", type=int, default=0, help="run on this many fake CPU devices instead")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work-dir", default=None)
    args = p.parse_args()
    stop_workers_with_the_bench()
    if args.mode:
        run_one(args)
        return
    work = args.work_dir or tempfile.mkdtemp(prefix="async_step_")
    env = dict(os.environ)
    if args.cpu:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.cpu}")
    # Rows of earlier invocations on the same --work-dir (same device) join the report, so the
    # comparison can be split over several calls (each mode at 1.7B takes minutes).
    saved = os.path.join(work, "results.json")
    rows = (json.load(open(saved)) if os.path.exists(saved) else {"device": None, "rows": []})
    for median in [float(m) for m in args.tool_medians.split(",")]:
        for mode in args.modes.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--work-dir", work] + [
                x for k, v in vars(args).items()
                if k not in ("mode", "work_dir", "modes", "cpu", "warmup", "tool_medians", "tool_median")
                for x in (f"--{k.replace('_', '-')}", str(v))] + ["--tool-median", str(median)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                print(proc.stdout[-3000:], proc.stderr[-5000:])
                raise SystemExit(f"{mode} run (tool median {median} s) failed")
            out = json.loads(line[-1][len("RESULT "):])
            if rows["device"] not in (None, out["device"]):
                raise SystemExit(f"{saved} holds rows measured on {rows['device']}, not {out['device']}: "
                                 "use another --work-dir")
            row = summarize(mode, out["steps"], args.warmup, median, args.max_staleness)
            # saved after every mode (a call cut by its time limit keeps the modes it finished), with
            # the raw steps beside it, so a row can be read again over another window
            rows = {"device": out["device"], "rows": [r for r in rows["rows"]
                                                       if (r["mode"], r["tool_median"]) != (mode, median)] + [row]}
            with open(saved, "w") as f:
                json.dump(rows, f)
            with open(os.path.join(work, f"steps_{mode}_{median:g}.json"), "w") as f:
                json.dump(out["steps"], f)
            print(f"{mode} at tool median {median:g} s: {row['traj_per_s']:.2f} traj/s", flush=True)
    results, device = rows["rows"], rows["device"]
    print(report(results, device, args))


def windows(modes: list[str], args) -> list[str]:
    """Each mode's steady steps as the header says them (``steady_window``'s, 1-based)."""
    out = []
    for mode in modes:
        edge = 0 if mode == "sync" else args.max_staleness
        out.append(f"steps {args.warmup + edge + 1}..{args.steps - edge} ({mode}"
                   + (": without the ramp and the drain)" if edge else ")"))
    return out


def report(results: list[dict], device: str, args) -> str:
    """The table, each mode's ratios to sync at the same latency, and tokens/s with tools over without."""
    lines = [f"\ndevice: {device}  shape: {args.size}  {args.prompts}x{args.group} episodes/step, {args.turns} turns x "
             f"{args.new_tokens} tokens, tool latency lognormal(median per row, sigma {args.tool_sigma}, cap "
             f"{args.tool_cap} s), placement {args.placement}, max_staleness {args.max_staleness}; means over "
             + ", ".join(windows(sorted({r["mode"] for r in results}), args)),
             "| mode | tool median s | s/step | rollout s | update s | trainer idle s | rollout idle s | traj/s | "
             "sampled tok/s | staleness | mixed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['tool_median']:g} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | "
                     f"{r['update_s']:.2f} | {r['trainer_idle_s']:.2f} | {r['rollout_idle_s']:.2f} | "
                     f"{r['traj_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['staleness']:.2f} | {r['mixed']:.2f} |")
    by = {(r["mode"], r["tool_median"]): r for r in results}
    for (mode, median), r in by.items():
        sync = by.get(("sync", median))
        if mode != "sync" and sync:
            lines.append(f"{mode} / sync at tool median {median:g} s: traj/s {r['traj_per_s'] / sync['traj_per_s']:.2f}x, "
                         f"sampled tok/s {r['tokens_per_s'] / sync['tokens_per_s']:.2f}x")
        free = by.get((mode, 0.0))
        if median > 0 and free:
            lines.append(f"{mode}: sampled tok/s at tool median {median:g} s / at 0 s: "
                         f"{r['tokens_per_s'] / free['tokens_per_s']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
