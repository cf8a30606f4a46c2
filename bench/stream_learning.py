"""Does the stream learn like the synchronous trainer? Arms x seeds of a recipe, table + plot.

Every run is the whole recipe (SFT cold start, then RL) with the arm's ``async_rl`` overrides:
the SFT depends on the seed alone, so a seed's arms start from the same policy (the table's
"start" column shows it). Runs go ``--jobs`` at a time as ``launch/tpu_pod.py`` processes;
a finished run (``results.json`` with an end evaluation) is skipped, so a stopped call
continues where it stopped, and ``--deadline`` stops starting new ones.

    # the demo on a many-core CPU host (JAX_PLATFORMS=cpu unless set): 9 runs at once, each on its own cores
    python bench/stream_learning.py --out runs/stream_learning --jobs 9
    # the SmolLM2-135M tool recipe on one GPU: runs share the card (memory split by --jobs)
    python bench/stream_learning.py --recipe smollm2 --out runs/stream_smollm2 --jobs 3 \\
        --set model.path=SmolLM2-135M-Instruct.Q4_1.gguf
    # ... or 6 runs at once over 2 cards, 3 per card
    python bench/stream_learning.py --recipe smollm2 --out runs/stream_smollm2 --jobs 6 --gpus 2 \\
        --set model.path=SmolLM2-135M-Instruct.Q4_1.gguf
    python bench/stream_learning.py --out runs/stream_learning --report-only

Writes ``OUT/<arm>/seed<s>.json`` (one run's summary), ``OUT/summary.json``, ``OUT/table.md``
(per seed, mean, paired differences against ``sync`` with the sign-flip p) and
``OUT/learning.png`` (training accuracy per step, and the held-out pass@1 per seed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script's statistics and readers
from hybrid_ablation import learning_curve, read_metrics, sign_flip_p
from multi_policy_learning import core_sets

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"demo": "configs/demo.py", "smollm2": "configs/smollm2_tools.py"}
_STREAM = ["async_rl.enabled=true", "async_rl.mode=stream", "async_rl.old_logprobs=recompute"]
#: arm -> its overrides of the recipe
ARMS: dict[str, list[str]] = {
    "sync": [],
    "stream1": [*_STREAM, "async_rl.max_staleness=1", "algorithm.correction=tis"],
    "stream2": [*_STREAM, "async_rl.max_staleness=2", "algorithm.correction=tis"],
    "stream4": [*_STREAM, "async_rl.max_staleness=4", "algorithm.correction=tis"],  # the throughput bench's setting
    # AReaL's decoupled PPO (docs/async.md): the behavior weight masked past the cap, not truncated
    "stream2_decoupled": [*_STREAM, "async_rl.max_staleness=2", "algorithm.correction=mis",
                          "algorithm.correction_level=token"],
}
DEFAULT_ARMS = {"demo": ["sync", "stream1", "stream2"], "smollm2": ["sync", "stream1"]}
# the demo saves no checkpoint of its own: every 10 steps here, so a call cut by a time limit resumes
RECIPE_SETS = {"demo": ["checkpoint.every_steps=10"], "smollm2": []}
BASELINE = "sync"
SEEDS = (0, 1, 2)
# held-out columns of results.json["start" / "end"]; the stream's own per-step means from metrics.jsonl
END_KEYS = ("pass_at_1", "tool_use_rate")
STEP_KEYS = ("stream/last_token_staleness_mean", "async/trajectory_staleness_max", "tis_truncated_frac",
             "mis_masked_frac", "time/step")


def check_arms(config: str, arms: list[str], budget: list[str]) -> None:
    """Load every arm's config before anything runs: one that cannot run fails now, naming the field."""
    sys.path.insert(0, str(ROOT))
    from agentrl_jax.config import ConfigError, load_config

    for arm in arms:
        try:
            load_config(str(ROOT / config), [*budget, *ARMS[arm]])
        except ConfigError as e:
            raise SystemExit(f"arm {arm!r} ({' '.join(ARMS[arm])}) cannot run with this checkout: {e}") from None


def finished(run_dir: Path) -> bool:
    path = run_dir / "results.json"
    return path.exists() and "end" in json.loads(path.read_text())


def child_env(recipe: str, jobs: int, cores: set[int] | None, gpu: int | None = None,
              gpus: int = 1) -> dict[str, str]:
    """A run's environment: on the CPU its own cores and as many threads; on a GPU its card
    (``gpu`` of the first ``gpus``, when spread over several) and its share of that card's memory."""
    env = dict(os.environ)
    if recipe == "demo":  # a CPU recipe: several processes would not share a GPU's default preallocation
        env.setdefault("JAX_PLATFORMS", "cpu")
    if cores:  # XLA's CPU thread pool sizes itself from the affinity mask set by taskset
        env.update({"OMP_NUM_THREADS": str(len(cores)), "MKL_NUM_THREADS": str(len(cores))})
    if recipe == "smollm2":
        if gpus > 1:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(round(0.9 / -(-jobs // gpus), 3)))
    return env


def launch(run_dir: Path, config: str, overrides: list[str], env: dict[str, str], cores: set[int] | None) -> int:
    """One ``launch/tpu_pod.py`` process (resuming its own checkpoint, if a stopped call left one);
    its output goes to ``run_dir.log``; returns its exit code."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "launch/tpu_pod.py", "--config", config, "--set", f"output_dir={run_dir}",
           "--set", "checkpoint.resume=true"]
    for item in overrides:
        cmd += ["--set", item]
    if cores:
        cmd = ["taskset", "-c", ",".join(map(str, sorted(cores))), *cmd]
    print(f"[{time.strftime('%H:%M:%S')}] start {run_dir}", flush=True)
    t0 = time.perf_counter()
    with (run_dir.parent / f"{run_dir.name}.log").open("w") as log:
        code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    print(f"[{time.strftime('%H:%M:%S')}] {'done' if not code else f'FAILED ({code})'} {run_dir} "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return code


def run_all(out: Path, recipe: str, arms: list[str], seeds: list[int], budget: list[str], jobs: int,
            pin: bool, deadline: float | None, gpus: int = 1) -> list[str]:
    """Every unfinished (arm, seed) run, ``jobs`` at a time, seeds first (a seed's arms run side by
    side); with ``pin`` each job slot owns its share of this process's cores, and slot ``i`` runs
    on GPU ``i % gpus``. Returns the failed runs."""
    config = RECIPES[recipe]
    cores = core_sets(jobs, max(len(os.sched_getaffinity(0)) // jobs, 1) if pin else 0)
    slots: Queue = Queue()
    for i in range(jobs):
        slots.put((i, cores.get()))
    failed: list[str] = []

    def one(arm: str, seed: int) -> None:
        if deadline is not None and time.monotonic() > deadline:
            print(f"deadline: not started {arm}/seed{seed}", flush=True)
            return
        slot, cores = slots.get()
        try:
            env = child_env(recipe, jobs, cores, slot % gpus, gpus)
            if launch(out / arm / f"seed{seed}", config, [f"seed={seed}", *budget, *ARMS[arm]], env, cores):
                failed.append(f"{arm}/seed{seed}")
        finally:
            slots.put((slot, cores))

    todo = [(a, s) for s in seeds for a in arms if not finished(out / a / f"seed{s}")]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda job: one(*job), todo))
    return failed


def run_summary(run_dir: Path) -> dict | None:
    """One finished run: held-out pass@1 and tool use before / after RL, the training-accuracy
    curve, the stream's per-step means and the RL seconds; None if it did not finish."""
    if not finished(run_dir):
        return None
    results, rows = json.loads((run_dir / "results.json").read_text()), read_metrics(run_dir)
    steps = {k: [r[k] for r in rows if k in r and r["step"] >= 1] for k in STEP_KEYS}
    return {"start": {k: results["start"].get(k) for k in END_KEYS},
            "end": {k: results["end"].get(k) for k in END_KEYS},
            "curve": learning_curve(rows), "rl_seconds": results.get("rl_seconds"),
            "steps": {k: statistics.fmean(v) for k, v in steps.items() if v}}


def _mean_sd(values: list[float]) -> list[float]:
    return [statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def summarize(out: Path, arms: list[str], seeds: list[int]) -> dict:
    """Per arm: the runs by seed (each also written to ``OUT/<arm>/seed<s>.json``), the mean ± sd
    of the end pass@1 and tool use, and the paired difference against ``sync``."""
    runs = {a: {s: r for s in seeds if (r := run_summary(out / a / f"seed{s}"))} for a in arms}
    for arm, per_seed in runs.items():
        for seed, r in per_seed.items():
            (out / arm / f"seed{seed}.json").write_text(json.dumps(r, indent=2))
    summary: dict = {"arms": {}}
    for arm, per_seed in runs.items():
        if not per_seed:
            continue
        entry = {"runs": per_seed, **{f"end_{k}": _mean_sd([r["end"][k] for r in per_seed.values()])
                                     for k in END_KEYS}}
        common = [s for s in per_seed if s in runs.get(BASELINE, {})]
        if arm != BASELINE and common:
            diffs = [per_seed[s]["end"]["pass_at_1"] - runs[BASELINE][s]["end"]["pass_at_1"] for s in common]
            entry["paired"] = {"seeds": common, "diffs": diffs, "mean_sd": _mean_sd(diffs),
                               "wins": sum(d > 0 for d in diffs), "losses": sum(d < 0 for d in diffs),
                               "p": sign_flip_p(diffs)}
        summary["arms"][arm] = entry
    return summary


def table_markdown(summary: dict) -> str:
    lines = ["| arm | seed | start pass@1 | end pass@1 | end tool use | - sync | last-token staleness | RL s |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, e in summary["arms"].items():
        diffs = dict(zip(e["paired"]["seeds"], e["paired"]["diffs"])) if "paired" in e else {}
        for seed, r in e["runs"].items():
            diff = f"{diffs[seed]:+.3f}" if seed in diffs else "-"
            staleness = r["steps"].get("stream/last_token_staleness_mean")
            lines.append(f"| {arm} | {seed} | {r['start']['pass_at_1']:.3f} | {r['end']['pass_at_1']:.3f} | "
                         f"{r['end']['tool_use_rate']:.3f} | {diff} | "
                         f"{'-' if staleness is None else f'{staleness:.2f}'} | {r['rl_seconds'] or 0:.0f} |")
        (m, sd), (tm, _) = e["end_pass_at_1"], e["end_tool_use_rate"]
        p = e.get("paired")
        paired = (f"{p['mean_sd'][0]:+.3f} ± {p['mean_sd'][1]:.3f} ({p['wins']}/{p['losses']} wins/losses, "
                  f"p {p['p']:.3f})") if p else "-"
        lines.append(f"| **{arm}** | mean | | {m:.3f} ± {sd:.3f} | {tm:.3f} | {paired} | | |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Training accuracy per step (mean over seeds) and the end pass@1 per seed, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (curves, finals) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (arm, e) in enumerate(summary["arms"].items()):
        length = min(len(r["curve"]) for r in e["runs"].values())
        if length:
            mean = np.mean([r["curve"][:length] for r in e["runs"].values()], axis=0)
            curves.plot(np.arange(1, length + 1), mean, color=f"C{i}", label=arm)
        for seed, r in e["runs"].items():
            finals.scatter(i, r["end"]["pass_at_1"], color=f"C{i}", alpha=0.7)
            finals.annotate(str(seed), (i + 0.05, r["end"]["pass_at_1"]), fontsize=7)
        finals.errorbar([i + 0.2], [e["end_pass_at_1"][0]], yerr=[e["end_pass_at_1"][1]], fmt="o", color="black")
    curves.set(xlabel="RL step", ylabel="training accuracy (reward/correct)", title="mean over seeds")
    curves.legend(fontsize=8)
    finals.set_xticks(range(len(summary["arms"])), list(summary["arms"]))
    finals.set(ylabel="held-out pass@1 after RL", title="per seed (number), black: mean ± sd")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--recipe", choices=list(RECIPES), default="demo")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="default: demo sync stream1 stream2; "
                        "smollm2 sync stream1")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run (e.g. model.path=FILE.gguf, total_steps=3)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
    parser.add_argument("--gpus", type=int, default=1, help="GPU recipe: spread the jobs over this many cards "
                        "(job slot i on card i %% gpus, the memory split by the jobs per card)")
    parser.add_argument("--no-pin", action="store_true", help="CPU: do not give each job its own cores")
    parser.add_argument("--deadline", type=float, help="seconds from now after which no run starts")
    parser.add_argument("--report-only", action="store_true", help="only write the table and plot")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.gpus < 1:
        parser.error(f"--jobs ({args.jobs}) and --gpus ({args.gpus}) must be >= 1")
    out, arms = args.out.absolute(), args.arms or DEFAULT_ARMS[args.recipe]
    budget = [*RECIPE_SETS[args.recipe], *args.extra]
    if not args.report_only:
        check_arms(RECIPES[args.recipe], arms, budget)
        if args.recipe == "smollm2":  # converted once here, not by every process side by side
            sys.path.insert(0, str(ROOT))
            from agentrl_jax.config import load_config
            from agentrl_jax.models.gguf_cache import hf_directory

            hf_directory(load_config(str(ROOT / RECIPES["smollm2"]), args.extra).model.path)
        pin = args.recipe == "demo" and not args.no_pin and args.jobs > 1
        deadline = None if args.deadline is None else time.monotonic() + args.deadline
        failed = run_all(out, args.recipe, arms, args.seeds, budget, args.jobs, pin, deadline, args.gpus)
        if failed:
            print(f"FAILED: {' '.join(failed)} (logs: OUT/<arm>/seed<s>.log)", flush=True)
    summary = summarize(out, arms, args.seeds)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = table_markdown(summary)
    (out / "table.md").write_text(table)
    if summary["arms"]:
        plot(summary, out / "learning.png")
    print(table)
    print(f"table: {out / 'table.md'}  plot: {out / 'learning.png'}")


if __name__ == "__main__":
    main()
