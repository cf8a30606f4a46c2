"""Two policies, concurrent on their own devices vs time-shared on all of them: trajectories/s
and wall time for the same number of steps of configs/multi_policy_demo.py.

Two runs, each in its own process (JAX preallocates the cards):
- concurrent: the solver on the first half of the devices, the checker on the second half;
  both engines decode at once and both policies train at once (each a thread);
- time_shared: both policies on every device (each its own engine and FSDP train state),
  trained one after the other (the baseline of the ratios);
- async: concurrent, and the next step's episodes are collected while both policies train
  (``async_rl.max_staleness=1`` for each, one step off-policy, TIS-corrected).

    python bench/multi_policy_speed.py --steps 20 --warmup 3 --out runs/multi_policy_speed      # 2 GPUs
    python bench/multi_policy_speed.py --steps 4 --warmup 1 --cpu 2 --tiny --out /tmp/mp_speed  # CPU dry run

Extra ``--set`` items go to every run (e.g. ``--set model.scratch.num_layers=8``). Steps
after ``--warmup`` (compiles) but the last are timed. Prints a table: mode, steps timed, trajectories/s,
seconds per step, wall time of the RL loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.workers import stop_workers_with_the_bench  # noqa: E402

MODES = {
    "concurrent": ["multi_policy.schedule=concurrent"],
    "time_shared": ["multi_policy.schedule=time_shared"],
    "async": ["multi_policy.schedule=concurrent", "async_rl.enabled=true", "async_rl.max_staleness=1",
              "algorithm.correction=tis"],
}
# A ~1M-parameter model and small batches: what a 2-core CPU runs in a minute or two.
TINY = ["model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
        "model.scratch.head_dim=16", "model.scratch.vocab_size=400", "rollout.max_new_tokens_per_turn=24",
        "environment.num_train_tasks=64", "environment.num_eval_tasks=2", "eval.num_tasks=2",
        "eval.samples_per_task=1", "data.prompts_per_step=2", "algorithm.group_size=2", "rollout.max_concurrent=8"]


def run_mode(mode: str, args) -> dict:
    """One run in a child process; its timings from the metrics it wrote."""
    out = Path(args.out) / mode
    script = (
        "import dataclasses, json, sys\n"
        "from agentrl_jax.config import load_config\n"
        "from agentrl_jax.config.policies import MultiPolicyConfig\n"
        "from agentrl_jax.train.multi_policy import train_multi\n"
        "config = load_config('configs/multi_policy_demo.py', json.loads(sys.argv[1]))\n"
        "if sys.argv[2] == 'time_shared':  # every policy on all devices\n"
        "    mp = config.multi_policy\n"
        "    config = dataclasses.replace(config, multi_policy=dataclasses.replace(mp, policies=tuple(\n"
        "        dataclasses.replace(p, share=0.0) for p in mp.policies)))\n"
        "train_multi(config)\n"
        "import jax, pathlib\n"
        "pathlib.Path(config.output_dir, 'device.txt').write_text(f'{jax.device_count()} x {jax.devices()[0].device_kind}')\n")
    overrides = [f"output_dir={out}", f"total_steps={args.steps}", "checkpoint.every_steps=0", "logging.progress=false",
                 "logging.tensorboard=false", *MODES[mode], *(TINY if args.tiny else []), *args.set]
    env = dict(os.environ)
    if args.cpu:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.cpu}")
    subprocess.run([sys.executable, "-c", script, json.dumps(overrides), mode], cwd=ROOT, env=env, check=True)
    return summarize(out, args.warmup)


def summarize(out: Path, warmup: int) -> dict:
    """Trajectories/s and seconds/step over the steps after ``warmup``; the RL loop's wall time."""
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r for r in rows if "time/step" in r), key=lambda r: r["step"])
    # the last step too is left out: with async rollouts it has no next collection to overlap
    timed = steps[warmup:-1]
    if not timed:
        raise SystemExit(f"{out}: {len(steps)} steps, none to time after the {warmup} of the warm-up but the last; "
                         "run --steps >= --warmup + 2")
    seconds = sum(r["time/step"] for r in timed)
    episodes = sum(r["throughput/trajectories_per_s"] * r["time/step"] for r in timed)
    results = json.loads((out / "results.json").read_text())
    # the median too: one step that compiles a new shape mid-run moves the mean of a few short steps
    return {"steps_timed": len(timed), "trajectories_per_s": episodes / seconds, "seconds_per_step": seconds / len(timed),
            "median_seconds_per_step": statistics.median(r["time/step"] for r in timed),
            "step_seconds": [round(r["time/step"], 4) for r in timed],
            "median_rollout_seconds": statistics.median(r["time/rollout"] for r in timed),
            "median_update_seconds": statistics.median(  # the longer of the policies' updates
                max(v for k, v in r.items() if k.endswith("/time/update")) for r in timed),
            "rl_seconds": results["rl_seconds"], "schedule": results["schedule"],
            "device": (out / "device.txt").read_text()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (compiles)")
    parser.add_argument("--out", default="runs/multi_policy_speed")
    parser.add_argument("--cpu", type=int, default=0, help="run on this many fake CPU devices")
    parser.add_argument("--tiny", action="store_true", help="a ~1M-parameter model (CPU dry run)")
    parser.add_argument("--set", action="append", default=[], help="section.field=value for both runs")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 2:
        parser.error(f"--steps ({args.steps}) must be >= --warmup ({args.warmup}) + 2: the warm-up and the last step "
                     "are not timed")
    stop_workers_with_the_bench()
    found = {mode: run_mode(mode, args) for mode in args.modes}
    print(f"device: {next(iter(found.values()))['device']}")
    print("| mode | schedule | steps timed | trajectories/s | s/step | median s/step | rollout s (median) | "
          "update s (median) | RL wall s |\n|---|---|---|---|---|---|---|---|---|")
    for mode, r in found.items():
        print(f"| {mode} | {r['schedule']} | {r['steps_timed']} | {r['trajectories_per_s']:.2f} | "
              f"{r['seconds_per_step']:.3f} | {r['median_seconds_per_step']:.3f} | {r['median_rollout_seconds']:.3f} | "
              f"{r['median_update_seconds']:.3f} | {r['rl_seconds']:.1f} |")
    for mode, r in found.items():
        print(f"{mode}: s per timed step {r['step_seconds']}")
    if "time_shared" in found:
        for mode, r in found.items():
            if mode != "time_shared":
                print(f"{mode} / time-shared trajectories/s: "
                      f"{r['trajectories_per_s'] / found['time_shared']['trajectories_per_s']:.2f}x")
    (Path(args.out) / "speed.json").write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
