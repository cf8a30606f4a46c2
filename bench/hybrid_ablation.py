"""The hindsight-OPD ablation of docs/hybrid.md: arms x seeds from one shared SFT per seed, table + plot.

The protocol (regime, arms, seeds, budget, threshold, metrics) is written in docs/hybrid.md
("Ablation protocol") and was fixed before any arm was run; this script is its only
implementation. Per seed it runs the SFT cold start of ``configs/hybrid_ablation.py`` once
(exported), then every arm from that export with the arm's ``hybrid`` overrides, each as
its own ``launch/tpu_pod.py`` process, ``--jobs`` at a time across seeds (every seed's SFT
first, each seed's arms once its SFT is exported). Finished runs (a ``results.json`` with
an end evaluation; for an SFT also its export) are skipped, so a killed ablation continues
where it stopped, from the same ``--out``; ``--deadline`` stops starting new runs (for a
time-limited machine). Each run's wall time is appended to ``OUT/launches.jsonl``.

    python bench/hybrid_ablation.py --out runs/hybrid_ablation               # the whole ablation
    python bench/hybrid_ablation.py --out /tmp/smoke --seeds 0 --arms grpo hybrid_lam0.3 \\
        --steps 3 --sft-steps 40 --eval-tasks 8                              # an end-to-end check
    python bench/hybrid_ablation.py --out runs/hybrid_ablation --report-only # table + plot again

Writes ``OUT/table.md``, ``OUT/summary.json`` and ``OUT/ablation.png`` (learning curves and
the final held-out pass@1 per seed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/hybrid_ablation.py"  # --config: configs/smollm2_hybrid.py for the real-model protocol
# every arm with hints also logs the placebo diagnostic at steps 1, 11, 21 (a measurement, no effect on training)
_HYBRID = ["hybrid.mode=hybrid", "hybrid.judge=oracle", "hybrid.placebo_diagnostic_every=10"]
#: arm -> its overrides of configs/hybrid_ablation.py (which is the GRPO arm as it stands).
ARMS: dict[str, list[str]] = {
    "grpo": [],
    "hybrid_lam0.1": [*_HYBRID, "hybrid.lam=0.1"],
    "hybrid_lam0.3": [*_HYBRID, "hybrid.lam=0.3"],
    "hybrid_lam1": [*_HYBRID, "hybrid.lam=1.0"],
    "opd_only": ["hybrid.mode=opd", "hybrid.judge=oracle", "hybrid.placebo_diagnostic_every=10"],
    "placebo": [*_HYBRID, "hybrid.lam=0.3", "hybrid.placebo=true"],
    "self_distill": [*_HYBRID, "hybrid.lam=0.3", "hybrid.teacher=policy"],
    # not an arm of either protocol: the policy prompted as its own judge, for its judge/* metrics and hints
    "policy_judge": ["hybrid.mode=hybrid", "hybrid.judge=policy", "hybrid.lam=0.3"],
    # not hindsight arms: other trainers from the same SFT start and budget, compared with "grpo" in
    # docs/algorithms.md (PPO with a critic, one sample per prompt at the same episodes per step) and
    # docs/lora.md (rank-16 adapters at 10x the learning rate, the ratio "LoRA Without Regret" finds
    # for LoRA against full fine-tuning)
    "ppo1": ["algorithm.advantage=gae", "algorithm.group_size=1", "data.prompts_per_step=128"],
    "lora_r16": ["model.lora.rank=16", "optimizer.learning_rate=1e-4"],
}
#: the arithmetic protocol's seven arms (docs/hybrid.md), what a run without ``--arms`` runs
PROTOCOL_ARMS = ("grpo", "hybrid_lam0.1", "hybrid_lam0.3", "hybrid_lam1", "opd_only", "placebo", "self_distill")
SEEDS = (0, 1, 2, 3, 4)
THRESHOLD = 0.5  # training accuracy, trailing mean over WINDOW steps
WINDOW = 3
BASELINE = "grpo"
CONTENT = ("hybrid_lam0.3", "placebo")  # does the hint's content matter: the same arm with real vs shuffled hints
DIAGNOSTICS = ("rollout/all_equal_groups", "judge/hint_fraction", "judge/leaked", "opd/kl_student_teacher",
               "opd/min_token", "opd/near_zero_fraction", "opd/placebo_min_token",
               "opd/placebo_near_zero_fraction")


def _launch(run_dir: Path, overrides: list[str], log_times: Path | None = None, config: str = CONFIG) -> None:
    """One launch/tpu_pod.py process; its output goes to run_dir.log, its wall time to ``log_times``
    (a JSONL line); a failure raises with the log's tail."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "launch/tpu_pod.py", "--config", config, "--set", f"output_dir={run_dir}",
           "--set", "checkpoint.resume=false"]
    for item in overrides:
        cmd += ["--set", item]
    log = run_dir.parent / f"{run_dir.name}.log"  # not with_suffix: "hybrid_lam0.3" has a dot
    # many small runs share one accelerator: each process takes the memory it uses, not 75% of it
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false")}
    print(f"[{time.strftime('%H:%M:%S')}] start {run_dir}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.call(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - t0
    print(f"[{time.strftime('%H:%M:%S')}] {'done' if not code else f'FAILED ({code})'} {run_dir} {seconds:.0f} s",
          flush=True)
    if log_times is not None:
        with log_times.open("a") as handle:
            handle.write(json.dumps({"run": str(run_dir.relative_to(log_times.parent)), "seconds": round(seconds, 1),
                                     "exit": code}) + "\n")
    if code:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}; the end of {log}:\n{tail}")


def check_arms(arms: list[str], budget: list[str], config: str = CONFIG) -> None:
    """Load every arm's config before anything runs: an arm this checkout cannot run fails now,
    naming the field, not after an hour of other arms."""
    sys.path.insert(0, str(ROOT))
    from agentrl_jax.config import ConfigError, apply_overrides, load_config

    base = load_config(str(ROOT / config))
    for arm in arms:
        try:
            apply_overrides(base, [*budget, *ARMS[arm]])
        except ConfigError as e:
            raise SystemExit(f"arm {arm!r} ({' '.join(ARMS[arm])}) cannot run with this checkout: {e}") from None


def _finished(run_dir: Path, stage: str) -> bool:
    path = run_dir / "results.json"
    return path.exists() and stage in json.loads(path.read_text())


def sft_done(sft: Path) -> bool:
    """A seed's SFT is reusable: it finished (its start evaluation) and its export is there."""
    return _finished(sft, "start") and (sft / "export" / "config.json").exists()


class AblationRuns:
    """The runs of the ablation on a pool of ``jobs`` processes, across seeds: every seed's SFT
    first (concurrently), each seed's arms as soon as its SFT is there. Finished runs are
    skipped (a killed ablation continues where it stopped, reusing the exported SFTs); no run
    starts after ``deadline`` (time.monotonic()); a failed run is reported at the end and the
    others go on."""

    def __init__(self, out: Path, budget: list[str], sft_steps: int | None, jobs: int, deadline: float | None,
                 config: str = CONFIG):
        self.out, self.budget, self.sft_steps, self.deadline, self.config = out, budget, sft_steps, deadline, config
        self.pool = ThreadPoolExecutor(max_workers=jobs)
        self.failed: list[str] = []
        self.skipped: list[str] = []
        self.times = out / "launches.jsonl"

    def _run(self, run_dir: Path, overrides: list[str]) -> bool:
        name = str(run_dir.relative_to(self.out))
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.skipped.append(name)
            return False
        try:
            _launch(run_dir, overrides, self.times, self.config)
            return True
        except RuntimeError as e:
            print(e, file=sys.stderr, flush=True)
            self.failed.append(name)
            return False

    def _seed(self, seed: int, arms: list[str]) -> list[Future]:
        """The SFT of ``seed`` (unless reusable), then its unfinished arms submitted to the pool."""
        sft, common = self.out / f"seed{seed}" / "sft", [f"seed={seed}", *self.budget]
        if not sft_done(sft) and not self._run(sft, [*common, "total_steps=0", "checkpoint.export_hf=true",
                                                     *([f"sft.steps={self.sft_steps}"] if self.sft_steps is not None else [])]):
            self.skipped += [f"seed{seed}/{a}" for a in arms if not _finished(self.out / f"seed{seed}" / a, "end")]
            return []
        start = [*common, f"model.path={sft / 'export'}", "sft.steps=0"]
        return [self.pool.submit(self._run, self.out / f"seed{seed}" / a, [*start, *ARMS[a]])
                for a in arms if not _finished(self.out / f"seed{seed}" / a, "end")]

    def run(self, seeds: list[int], arms: list[str]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with self.pool:
            seed_futures = [self.pool.submit(self._seed, seed, arms) for seed in seeds]
            for future in as_completed(seed_futures):
                wait(future.result())
        if self.skipped:
            print(f"not started (deadline or a failed SFT): {' '.join(self.skipped)}", flush=True)
        if self.failed:
            print(f"FAILED: {' '.join(self.failed)} (logs: OUT/<run>.log)", flush=True)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def learning_curve(rows: list[dict], key: str = "reward/correct") -> list[float]:
    """The training accuracy of RL steps 1, 2, ... (one value per step, the last row wins)."""
    by_step = {r["step"]: r[key] for r in rows if key in r and r["step"] >= 1}
    return [by_step[s] for s in sorted(by_step)]


def steps_to_threshold(curve: list[float], threshold: float = THRESHOLD, window: int = WINDOW) -> int | None:
    """The first step whose trailing ``window``-step mean reaches ``threshold``; None if none does."""
    for end in range(window, len(curve) + 1):
        if statistics.fmean(curve[end - window:end]) >= threshold:
            return end
    return None


def sign_flip_p(differences: list[float]) -> float:
    """Exact two-sided paired permutation test: the share of the 2^n sign flips whose mean is
    at least as far from 0 as the observed one."""
    observed = abs(statistics.fmean(differences))
    flips = [abs(statistics.fmean(s * d for s, d in zip(signs, differences)))
             for signs in itertools.product((1, -1), repeat=len(differences))]
    return sum(f >= observed - 1e-12 for f in flips) / len(flips)


def _run_summary(run_dir: Path) -> dict | None:
    path = run_dir / "results.json"
    if not path.exists():
        return None
    results, rows = json.loads(path.read_text()), read_metrics(run_dir)
    curve = learning_curve(rows)
    first = next((r for r in rows if r["step"] == 1 and "reward/mean" in r), {})
    hints = [r["judge/hint_fraction"] for r in rows if "judge/hint_fraction" in r]
    diagnostics = {k: first[k] for k in DIAGNOSTICS if k in first}
    if hints:
        diagnostics["judge/hint_fraction"] = statistics.fmean(hints)
    return {"start": results.get("start", {}).get("pass_at_1"), "end": results.get("end", {}).get("pass_at_1"),
            "curve": curve, "steps_to_threshold": steps_to_threshold(curve),
            "seconds": results.get("rl_seconds"), "step1": diagnostics}


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(out: Path, seeds: list[int], arms: list[str]) -> dict:
    """Per arm: the per-seed runs, final pass@1 mean/sd, steps to threshold, and the paired
    comparison with the GRPO arm over the seeds both finished."""
    runs = {a: {s: r for s in seeds if (r := _run_summary(out / f"seed{s}" / a)) and r["end"] is not None}
            for a in arms}
    summary = {"threshold": THRESHOLD, "window": WINDOW, "arms": {}}
    for arm in arms:
        per_seed = runs[arm]
        if not per_seed:
            continue
        finals = [r["end"] for r in per_seed.values()]
        reached = [r["steps_to_threshold"] for r in per_seed.values() if r["steps_to_threshold"] is not None]
        entry = {"seeds": sorted(per_seed), "runs": per_seed, "final_mean_sd": _mean_sd(finals),
                 "start_mean": statistics.fmean(r["start"] for r in per_seed.values()),
                 "reached": len(reached), "steps_to_threshold_median": statistics.median(reached) if reached else None}
        if arm != BASELINE and (paired := _paired(per_seed, runs.get(BASELINE, {}))):
            entry["paired"] = paired
        summary["arms"][arm] = entry
    _steps_to_baseline_final(summary, runs.get(BASELINE, {}))
    real, placebo = CONTENT
    if real in arms and placebo in arms and (content := _paired(runs[real], runs[placebo])):
        summary["content"] = {"arm": real, "versus": placebo, **content}
    return summary


def _steps_to_baseline_final(summary: dict, baseline: dict) -> None:
    """Sample efficiency against GRPO, per seed: the first step at which an arm's training accuracy
    (trailing WINDOW-step mean) reaches the GRPO run's own trailing mean at its last step. Adds per
    arm ``to_grpo_final`` {seed: step or None} and the paired count of seeds where the arm gets there
    no later than GRPO (a run that never gets there counts as later)."""
    for entry in summary["arms"].values():
        steps, earlier = {}, 0
        for seed, run in entry["runs"].items():
            if seed not in baseline or len(baseline[seed]["curve"]) < WINDOW:
                continue
            target = statistics.fmean(baseline[seed]["curve"][-WINDOW:])
            mine, theirs = steps_to_threshold(run["curve"], target), steps_to_threshold(baseline[seed]["curve"], target)
            steps[seed] = mine
            earlier += mine is not None and theirs is not None and mine <= theirs
        entry["to_grpo_final"] = steps
        entry["to_grpo_final_no_later"] = earlier


def _paired(runs: dict, baseline: dict) -> dict | None:
    """Final pass@1 of ``runs`` minus ``baseline``'s over the seeds both finished: mean ± sd,
    wins / losses and the sign-flip p; None without a common seed."""
    seeds = [s for s in runs if s in baseline]
    if not seeds:
        return None
    diffs = [runs[s]["end"] - baseline[s]["end"] for s in seeds]
    return {"seeds": seeds, "diff_mean_sd": _mean_sd(diffs), "wins": sum(d > 0 for d in diffs),
            "losses": sum(d < 0 for d in diffs), "p": sign_flip_p(diffs)}


def decision(entry: dict | None, seeds: int) -> bool:
    """The pre-registered rule: a positive paired mean and at least 4 wins in 5 seeds
    (the same share of the seeds otherwise)."""
    return bool(entry) and entry["diff_mean_sd"][0] > 0 and entry["wins"] >= -(-4 * seeds // 5)


def table_markdown(summary: dict) -> str:
    lines = [f"| arm | seeds | start pass@1 | final pass@1 (mean ± sd) | steps to {summary['threshold']:g} "
             f"(reached, median) | vs GRPO: diff (mean ± sd) | wins/losses | p (sign-flip) | "
             "steps to GRPO's final training accuracy (per seed) | seeds no later than GRPO |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, e in summary["arms"].items():
        m, sd = e["final_mean_sd"]
        median = "-" if e["steps_to_threshold_median"] is None else f"{e['steps_to_threshold_median']:g}"
        p = e.get("paired")
        paired = (f"{p['diff_mean_sd'][0]:+.3f} ± {p['diff_mean_sd'][1]:.3f} | {p['wins']}/{p['losses']} | "
                  f"{p['p']:.3f}") if p else "- | - | -"
        to_final = " ".join("-" if v is None else str(v) for v in e.get("to_grpo_final", {}).values()) or "-"
        lines.append(f"| {arm} | {len(e['seeds'])} | {e['start_mean']:.3f} | {m:.3f} ± {sd:.3f} | "
                     f"{e['reached']}/{len(e['seeds'])}, {median} | {paired} | {to_final} | "
                     f"{e.get('to_grpo_final_no_later', 0)}/{len(e.get('to_grpo_final', {}))} |")
    c = summary.get("content")
    if c:
        lines += ["", (f"Hint content: {c['arm']} - {c['versus']} (final pass@1, paired over {len(c['seeds'])} "
                       f"seeds): {c['diff_mean_sd'][0]:+.3f} ± {c['diff_mean_sd'][1]:.3f}, wins/losses "
                       f"{c['wins']}/{c['losses']}, p {c['p']:.3f}.")]
    helps = [a for a, e in summary["arms"].items() if decision(e.get("paired"), len(e["seeds"]))]
    finished = min((len(e["seeds"]) for e in summary["arms"].values()), default=0)
    if finished < len(SEEDS):  # the rule is written for the protocol's seeds: fewer decide nothing
        verdict = f"none; {finished} of {len(SEEDS)} seeds finished every arm"
    else:
        verdict = ((f"helps: {', '.join(helps)}" if helps else
                    "no arm helps (positive paired mean and >= 4/5 wins vs GRPO)")
                   + ("; the hint content helps" if c and c["arm"] in helps and decision(c, len(c["seeds"])) else ""))
    lines += ["", f"Decision (docs/hybrid.md): {verdict}."]
    lines += ["", "Per seed (final held-out pass@1; step-1 diagnostics):", "",
              "| arm | seed | start | final | steps to threshold | RL seconds | step-1 diagnostics |", "|---|---|---|---|---|---|---|"]
    for arm, e in summary["arms"].items():
        for seed, r in e["runs"].items():
            diag = ", ".join(f"{k.split('/')[-1]} {v:.3g}" for k, v in r["step1"].items())
            lines.append(f"| {arm} | {seed} | {r['start']:.3f} | {r['end']:.3f} | {r['steps_to_threshold'] or '-'} | "
                         f"{(r['seconds'] or 0):.0f} | {diag} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Learning curves (training accuracy, mean ± sd over seeds) and the final pass@1 per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (curves, finals) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (arm, e) in enumerate(summary["arms"].items()):
        length = min(len(r["curve"]) for r in e["runs"].values())
        if length:
            values = np.array([r["curve"][:length] for r in e["runs"].values()])
            steps = np.arange(1, length + 1)
            mean, sd = values.mean(0), values.std(0)
            curves.plot(steps, mean, label=arm, color=f"C{i}")
            curves.fill_between(steps, mean - sd, mean + sd, color=f"C{i}", alpha=0.15)
        ends = [r["end"] for r in e["runs"].values()]
        finals.scatter([i] * len(ends), ends, color=f"C{i}", alpha=0.7)
        finals.errorbar([i + 0.15], [np.mean(ends)], yerr=[np.std(ends, ddof=1) if len(ends) > 1 else 0],
                        fmt="o", color="black")
    curves.axhline(summary["threshold"], color="gray", ls=":", lw=1)
    curves.set(xlabel="RL step", ylabel="training accuracy (reward/correct)", title="learning curves (mean ± sd)")
    curves.legend(fontsize=8)
    finals.set_xticks(range(len(summary["arms"])), list(summary["arms"]), rotation=30, fontsize=8)
    finals.set(ylabel="held-out pass@1 after RL", title="final pass@1 per seed (black: mean ± sd)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--config", default=CONFIG, help="the regime (GRPO arm) every arm overrides")
    parser.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every run (e.g. model.path=FILE.gguf)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--arms", nargs="*", default=list(PROTOCOL_ARMS), choices=list(ARMS),
                        help="the arms to run (none: only every seed's SFT, e.g. to run a diagnostic on it first)")
    parser.add_argument("--steps", type=int, help="RL steps per arm (default: the config's, the protocol's budget)")
    parser.add_argument("--sft-steps", type=int, help="SFT steps (default: the config's)")
    parser.add_argument("--eval-tasks", type=int, help="held-out tasks (default: the config's)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (processes), across seeds: the SFTs first, then every seed's arms")
    parser.add_argument("--deadline", type=float,
                        help="seconds from now after which no run starts (a run in flight finishes; rerun to continue)")
    parser.add_argument("--report-only", action="store_true", help="only write the table and plot")
    args = parser.parse_args(argv)
    out = args.out.absolute()
    budget = ([f"total_steps={args.steps}"] if args.steps is not None else []) + (
        [f"eval.num_tasks={args.eval_tasks}"] if args.eval_tasks is not None else []) + args.extra
    if not args.report_only:
        check_arms(args.arms, budget, args.config)
        deadline = None if args.deadline is None else time.monotonic() + args.deadline
        AblationRuns(out, budget, args.sft_steps, args.jobs, deadline, args.config).run(args.seeds, args.arms)
    if not args.arms:
        return
    summary = summarize(out, args.seeds, args.arms)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = table_markdown(summary)
    (out / "table.md").write_text(table)
    plot(summary, out / "ablation.png")
    print(table)
    print(f"table: {out / 'table.md'}  plot: {out / 'ablation.png'}")


if __name__ == "__main__":
    main()
