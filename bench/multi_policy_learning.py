"""Does the team learn? The solver-checker team against the solver alone, several seeds
(docs/multi_policy.md "Does the team learn?").

Arms, each run in its own process, ``--jobs`` at once: on CPU (JAX_PLATFORMS=cpu, the default)
each pinned to ``--cores-per-job`` cores with single-threaded XLA; with ``--platform gpu`` all
on the machine's accelerators (on one GPU both policies share it, time-shared):
- team: ``--config`` (configs/multi_policy_arith.py: the demo's arithmetic tasks; or
  configs/multi_policy_learning.py: the program tasks), the solver and the checker (two fake
  devices, a policy each, trained at once), ``--steps`` steps;
- solo: the same Config without the checker (the solver alone in the run's own episode), run
  ``--solo-factor`` times as many steps so that its sampled tokens pass the team's.
Both evaluate on the held-out tasks every ``eval.every_steps`` steps and at the end.

Matching: by sampled tokens. The team samples more per step (the checker's verdicts, the
solver's second tries), so the solo arm's held-out pass@1 is read at the team's total sampled
tokens of the same seed (linear between the two evaluations around it), and, for reference,
at the team's number of steps. Writes one JSON per run (``<arm>_seed<s>.json``),
``summary.json``, ``summary.md`` (the tables, and per seed whether the checker's balanced
accuracy and the team's solver both rose: ``both_learn``) and ``learning.png`` (mean curves,
per-seed faint).

    python bench/multi_policy_learning.py --steps 20 --solo-factor 3 --jobs 2 --cores-per-job 1 \
        --set eval.every_steps=10 --out runs/mp_arith         # 2 cores, ~45 min
    python bench/multi_policy_learning.py --tiny --seeds 0 --jobs 2 --out /tmp/mp_learning   # ~2 min dry run
    # one GPU: 3 seeds of both arms at once (~7 min on an H200 with 16 cores), policies time-shared
    python bench/multi_policy_learning.py --config configs/multi_policy_arith_labeled.py --steps 20 \
        --solo-factor 3 --platform gpu --jobs 6 --set eval.every_steps=10 \
        --set multi_policy.policies.solver.share=0 --set multi_policy.policies.checker.share=0 --out runs/mp_gpu
``--arms team`` runs the team arm alone; the summary is written once both arms are in ``--out``.
``--solo-from DIR`` copies the solo runs of an earlier ``--out`` in instead of running them (a
variant of the team against the same solo arm), after checking they trained this solo Config:

    python bench/multi_policy_learning.py ... --set multi_policy.checker_miscopied=0.5 \
        --solo-from runs/mp_gpu --out runs/mp_gpu_miscopied
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the Config classes of this checkout (the parent reads the environment's name)
CONFIG = "configs/multi_policy_arith.py"
DEVICES = {"team": 2, "solo": 1}  # the team: a fake device per policy
# A ~50K-parameter model, two steps of two prompts: the whole pipeline in seconds.
TINY = ["model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
        "model.scratch.head_dim=16", "model.scratch.vocab_size=400", "rollout.max_new_tokens_per_turn=24",
        "environment.num_train_tasks=64", "environment.num_eval_tasks=2", "eval.num_tasks=2", "eval.samples_per_task=1",
        "eval.every_steps=1", "data.prompts_per_step=2",
        "algorithm.group_size=2", "rollout.max_concurrent=8", "sft.steps=2", "sft.batch_size=4"]
# ... and the scripted demonstrations of the program tasks (one per training task by default).
TINY_ENV = {"retool_small": ["environment.num_demonstrations=8"]}
# Held-out pass@1 of the final answer, per arm; the team's solver before any critique.
PASS = {"team": "eval/team/final_correct", "solo": "eval/pass_at_1"}
TEAM_TRAIN_KEYS = ["checker/accuracy", "checker/balanced_accuracy", "checker/accepts_right", "checker/rejects_wrong",
                   "checker/malformed", "checker/rejected", "critique/wrong_first", "critique/wrong_to_right_rate",
                   "team/first_correct", "team/final_correct", "checker/tools/use_rate", "solver/tools/use_rate"]
# The team's held-out checker metrics kept with each evaluation (balanced accuracy: 0.5 for a constant verdict).
TEAM_EVAL_KEYS = ["checker/accuracy", "checker/balanced_accuracy", "checker/accepts_right", "checker/rejects_wrong",
                  "checker/rejected", "critique/wrong_to_right_rate"]
CHILD = (
    "import dataclasses, json, sys\n"
    "from agentrl_jax.config import load_config\n"
    "from agentrl_jax.config.policies import MultiPolicyConfig\n"
    "from agentrl_jax.train.run import train\n"
    "config = load_config(sys.argv[1], json.loads(sys.argv[2]))\n"
    "if sys.argv[3] == 'solo':  # the same Config without the checker: the single-policy run\n"
    "    config = dataclasses.replace(config, multi_policy=MultiPolicyConfig())\n"
    "train(config)\n")


def run_overrides(arm: str, seed: int, args) -> list[str]:
    steps = args.steps if arm == "team" else math.ceil(args.steps * args.solo_factor)
    tiny = [*TINY, *TINY_ENV.get(args.environment, [])] if args.tiny else []
    return [f"seed={seed}", f"total_steps={steps}", f"output_dir={Path(args.out).absolute() / arm / f'seed{seed}'}",
            *tiny, *args.set]


def run_config(arm: str, seed: int, args) -> dict:
    """The Config a run of ``arm`` trains, as a dict without its output folder (what makes two runs
    the same run)."""
    import dataclasses

    from agentrl_jax.config import load_config, to_dict
    from agentrl_jax.config.policies import MultiPolicyConfig

    config = load_config(args.config, run_overrides(arm, seed, args))
    if arm == "solo":
        config = dataclasses.replace(config, multi_policy=MultiPolicyConfig())
    return json.loads(json.dumps({k: v for k, v in to_dict(config).items() if k != "output_dir"}))  # as recorded


def differing_sections(theirs: dict | None, ours: dict) -> list[str]:
    """The top-level sections in which a recorded Config (None: a record from before Configs were
    recorded) differs from this invocation's."""
    theirs = theirs or {}
    return sorted(k for k in set(ours) | set(theirs) if theirs.get(k) != ours.get(k))


def borrow_solo(seed: int, args) -> None:
    """``--solo-from``: that folder's solo run of ``seed`` copied into ``--out`` (unless one is
    there), after checking that it trained this Config's solo arm (one error line if not)."""
    import shutil

    source, out = Path(args.solo_from), Path(args.out)
    if (out / "solo" / f"seed{seed}" / "results.json").exists() or not (
            source / "solo" / f"seed{seed}" / "results.json").exists():
        return
    record = json.loads((source / f"solo_seed{seed}.json").read_text())
    differ = differing_sections(record.get("config"), run_config("solo", seed, args))
    if differ:
        raise SystemExit(f"--solo-from {source}: its solo seed {seed} trained another Config (sections {differ} "
                         "differ; a record without its Config is from before they were recorded)")
    shutil.copytree(source / "solo" / f"seed{seed}", out / "solo" / f"seed{seed}")
    shutil.copy(source / f"solo_seed{seed}.json", out / f"solo_seed{seed}.json")


def launch(arm: str, seed: int, args, cores: Queue) -> float:
    """One run in a child process on cores taken from ``cores``; its wall seconds. A run that
    finished before (its results.json is there) is not run again: its recorded wall seconds."""
    done = Path(args.out) / arm / f"seed{seed}" / "results.json"
    if done.exists():
        record = Path(args.out) / f"{arm}_seed{seed}.json"
        return json.loads(record.read_text())["wall_seconds"] if record.exists() else float("nan")
    mine = cores.get()
    if args.platform == "cpu":
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=(
            f"--xla_force_host_platform_device_count={DEVICES[arm]} --xla_cpu_multi_thread_eigen=false "
            "intra_op_parallelism_threads=1"))
    else:  # the runs share the accelerators: each takes the memory it uses, not a fixed share
        env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    log = Path(args.out) / f"{arm}_seed{seed}.log"
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            subprocess.run([sys.executable, "-c", CHILD, args.config, json.dumps(run_overrides(arm, seed, args)), arm],
                           cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True,
                           preexec_fn=(lambda: os.sched_setaffinity(0, mine)) if mine else None)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{arm} seed {seed} failed (exit {e.returncode}); its log: {log}") from None
    finally:
        cores.put(mine)
    return time.perf_counter() - t0


def read_run(run_dir: Path, arm: str) -> dict:
    """The run's curve: held-out evaluations with the sampled tokens so far, and the team's
    training-rollout metrics per step."""
    rows = [json.loads(line) for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines()]
    token_keys = ("solver/rollout/sampled_tokens", "checker/rollout/sampled_tokens") if arm == "team" else (
        "rollout/sampled_tokens",)
    tokens, cumulative, evals, train = 0.0, {0: 0.0}, [], []
    for row in sorted(rows, key=lambda r: r["step"]):
        if any(k in row for k in token_keys):
            tokens += sum(row.get(k, 0.0) for k in token_keys)
            cumulative[row["step"]] = tokens
            if arm == "team":
                train.append({"step": row["step"], **{k: row[k] for k in TEAM_TRAIN_KEYS if k in row}})
        if PASS[arm] in row:
            team = {"first_correct": row["eval/team/first_correct"],
                    **{k: row[f"eval/{k}"] for k in TEAM_EVAL_KEYS if f"eval/{k}" in row}} if arm == "team" else {}
            evals.append({"step": row["step"], "tokens": cumulative[row["step"]], "pass_at_1": row[PASS[arm]], **team})
    return {"arm": arm, "sampled_tokens": tokens, "evals": evals, "train": train}


def pass_at(evals: list[dict], key: str, value: float) -> tuple[float, bool]:
    """Pass@1 at ``evals[*][key] == value``, linear between the evaluations around it; True when
    ``value`` is past the last evaluation (then the last one's)."""
    xs, ys = [e[key] for e in evals], [e["pass_at_1"] for e in evals]
    return float(np.interp(value, xs, ys)), value > xs[-1]


def summarize(runs: dict[tuple[str, int], dict], team_steps: int) -> dict:
    """Per seed: the team's end pass@1, the solo arm's at the team's tokens and steps; mean, std, min, max."""
    seeds = sorted({s for _, s in runs})
    per_seed = []
    for s in seeds:
        team, solo = runs[("team", s)], runs[("solo", s)]
        at_tokens, short = pass_at(solo["evals"], "tokens", team["sampled_tokens"])
        per_seed.append({
            "seed": s, "team_pass_at_1": team["evals"][-1]["pass_at_1"],
            "team_first_correct": team["evals"][-1]["first_correct"], "team_after_sft": team["evals"][0]["pass_at_1"],
            "team_checker_accuracy_after_sft": team["after_sft"]["checker/accuracy"],
            "team_checker_malformed_after_sft": team["after_sft"]["checker/malformed"],
            "solo_at_team_tokens": at_tokens, "solo_short_of_team_tokens": short,
            "solo_at_team_steps": pass_at(solo["evals"], "step", team_steps)[0],
            "solo_after_sft": solo["evals"][0]["pass_at_1"], "team_tokens": team["sampled_tokens"],
            "solo_tokens": solo["sampled_tokens"], "team_end": {k: team["evals"][-1].get(k) for k in TEAM_EVAL_KEYS}})
    keys = [k for k in per_seed[0] if k not in ("seed", "solo_short_of_team_tokens", "team_end")]
    stats = {k: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0,
                 "min": float(np.min(v)), "max": float(np.max(v))}
             for k in keys for v in [[p[k] for p in per_seed]]}
    return {"seeds": seeds, "team_steps": team_steps, "per_seed": per_seed, "stats": stats}


def table(summary: dict) -> str:
    rows = [("team: final answer (solver + checker)", "team_pass_at_1"),
            ("team: solver's first answer", "team_first_correct"),
            ("solo: at the team's sampled tokens", "solo_at_team_tokens"),
            ("solo: at the team's steps", "solo_at_team_steps"),
            ("team after SFT (before RL)", "team_after_sft"), ("solo after SFT (before RL)", "solo_after_sft"),
            ("checker accuracy after SFT", "team_checker_accuracy_after_sft"),
            ("checker malformed after SFT", "team_checker_malformed_after_sft"),
            ("sampled tokens, team", "team_tokens"), ("sampled tokens, solo (all its steps)", "solo_tokens")]
    lines = [f"| held-out pass@1 ({len(summary['seeds'])} seeds) | mean | std | min | max |", "|---|---|---|---|---|"]
    for label, key in rows:
        s = summary["stats"][key]
        fmt = "{:.0f}" if "tokens" in key and "solo_at" not in key else "{:.3f}"
        lines.append(f"| {label} | " + " | ".join(fmt.format(s[k]) for k in ("mean", "std", "min", "max")) + " |")
    short = [p["seed"] for p in summary["per_seed"] if p["solo_short_of_team_tokens"]]
    if short:
        lines.append(f"\nsolo ran out of steps before the team's tokens for seeds {short} (read at its last evaluation)")
    return "\n".join(lines)


def per_seed_table(summary: dict) -> str:
    """Per seed: the end pass@1 of each arm and the team's held-out checker metrics at the end."""
    def number(value):
        return "-" if value is None else f"{value:.3f}"

    lines = ["| seed | team final | team's solver, first answer | solo at the team's tokens | checker accuracy | "
             "checker balanced accuracy | accepts right | rejects wrong | checker rejects | critique wrong-to-right |",
             "|---" * 10 + "|"]
    for p in summary["per_seed"]:
        end = p["team_end"]
        lines.append(f"| {p['seed']} | {p['team_pass_at_1']:.3f} | {p['team_first_correct']:.3f} | "
                     f"{p['solo_at_team_tokens']:.3f}{' (flagged)' if p['solo_short_of_team_tokens'] else ''} | "
                     + " | ".join(number(end[k]) for k in TEAM_EVAL_KEYS) + " |")
    return "\n".join(lines)


def both_learn(runs: dict[tuple[str, int], dict]) -> str:
    """Per team seed: the checker's held-out balanced accuracy and the team's solver's first answer,
    after SFT -> at the end, and whether both rose; then in how many seeds they did."""
    lines = ["| seed | checker balanced accuracy, after SFT -> end | team's solver, first answer, after SFT -> end "
             "| both up |", "|---|---|---|---|"]
    up = []
    for (arm, seed), run in sorted(runs.items()):
        if arm != "team":
            continue
        first, last = run["evals"][0], run["evals"][-1]
        checker = [e.get("checker/balanced_accuracy") for e in (first, last)]
        solver = [first["first_correct"], last["first_correct"]]
        both = None not in checker and checker[1] > checker[0] and solver[1] > solver[0]
        up.append(both)
        shown = "-" if None in checker else f"{checker[0]:.3f} -> {checker[1]:.3f}"
        lines.append(f"| {seed} | {shown} | {solver[0]:.3f} -> {solver[1]:.3f} | {'yes' if both else 'no'} |")
    return "\n".join(lines + [f"\nboth policies improved in {sum(up)} of {len(up)} seeds (held-out)"])


def plot(runs: dict[tuple[str, int], dict], path: Path) -> None:
    """Held-out pass@1 against sampled tokens (both arms), the checker's training metrics per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    seeds = sorted({s for _, s in runs})
    for arm, key, color, label in [("team", "pass_at_1", "C0", "team (final answer)"),
                                   ("team", "first_correct", "C2", "team's solver, first answer"),
                                   ("solo", "pass_at_1", "C1", "solver alone")]:
        curves = [runs[(arm, s)]["evals"] for s in seeds]
        for c in curves:
            left.plot([e["tokens"] for e in c], [e[key] for e in c], color=color, alpha=0.25, lw=1)
        n = min(len(c) for c in curves)
        left.plot(np.mean([[e["tokens"] for e in c[:n]] for c in curves], 0),
                  np.mean([[e[key] for e in c[:n]] for c in curves], 0), color=color, lw=2.5, label=label)
    left.set(xlabel="sampled tokens (training)", ylabel="held-out pass@1", title="held-out pass@1")
    left.legend()
    for key, color in zip(["checker/accuracy", "checker/balanced_accuracy", "checker/rejected",
                           "critique/wrong_to_right_rate"], ["C3", "C5", "C7", "C4"]):
        curves = [[(r["step"], r[key]) for r in runs[("team", s)]["train"] if key in r] for s in seeds]
        for c in (c for c in curves if c):
            right.plot(*zip(*c), color=color, alpha=0.25, lw=1)
        steps = sorted({x for c in curves for x, _ in c})
        right.plot(steps, [np.mean([y for c in curves for x, y in c if x == st]) for st in steps], color=color,
                   lw=2.5, label=key)
    right.set(xlabel="RL step", ylabel="fraction of training episodes", title="the checker during training")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def core_sets(jobs: int, per_job: int) -> Queue:
    """``jobs`` disjoint sets of ``per_job`` cores this process may use (None: no pinning)."""
    free = sorted(os.sched_getaffinity(0))
    queue: Queue = Queue()
    for j in range(jobs):
        mine = free[j * per_job:(j + 1) * per_job] if per_job else []
        queue.put(set(mine) if len(mine) == per_job and per_job else None)
    return queue


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=CONFIG, help="the team's Config (the solo arm: it without multi_policy)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=16, help="the team's RL steps")
    parser.add_argument("--solo-factor", type=float, default=2.0, help="the solo arm's steps, times --steps")
    parser.add_argument("--jobs", type=int, default=6, help="runs at once")
    parser.add_argument("--cores-per-job", type=int, default=0, help="pin each run to this many cores (0: no pinning)")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: each run on fake CPU devices (a device per policy); gpu: every run on the "
                             "machine's accelerators (on one GPU the team's policies share it: --set "
                             "multi_policy.policies.<name>.share=0 for each)")
    parser.add_argument("--arms", nargs="+", choices=("team", "solo"), default=["team", "solo"],
                        help="the arms to run; the summary needs both (an arm's runs already in --out count)")
    parser.add_argument("--solo-from", default="", help="an earlier --out whose solo runs (of the same solo "
                                                           "Config: checked) are copied in instead of run")
    parser.add_argument("--tiny", action="store_true", help="a ~50K-parameter model, 2 steps (dry run)")
    parser.add_argument("--set", action="append", default=[], help="section.field=value for every run")
    parser.add_argument("--out", default="runs/mp_learning")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.steps < 1 or args.cores_per_job < 0:
        parser.error(f"--jobs ({args.jobs}) and --steps ({args.steps}) must be >= 1, --cores-per-job >= 0")
    if args.solo_factor < 1:  # the solo arm's pass@1 is read at the team's tokens, which it must reach
        parser.error(f"--solo-factor ({args.solo_factor}) must be >= 1")
    if args.solo_from and not (Path(args.solo_from) / "solo").is_dir():
        parser.error(f"--solo-from {args.solo_from}: no solo runs there (no solo/ folder)")
    if args.tiny:
        args.steps = 2
    from agentrl_jax.config import load_config

    args.environment = load_config(args.config, args.set).environment.name
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = core_sets(args.jobs, args.cores_per_job)
    todo = [(arm, s) for s in args.seeds for arm in ("team", "solo")]
    for seed in args.seeds if args.solo_from else []:
        borrow_solo(seed, args)
    jobs = [(arm, s) for arm, s in todo if arm in args.arms or (out / arm / f"seed{s}" / "results.json").exists()]
    with ThreadPoolExecutor(args.jobs) as pool:
        walls = dict(zip(jobs, pool.map(lambda job: launch(*job, args, cores), jobs)))
    runs = {}
    for (arm, s), wall in walls.items():
        run_dir = out / arm / f"seed{s}"
        runs[(arm, s)] = {**read_run(run_dir, arm), "seed": s, "wall_seconds": wall,
                          "after_sft": json.loads((run_dir / "results.json").read_text())["start"]}
        # A run done before (here, or borrowed) counts only if it trained this invocation's Config.
        record, ours = out / f"{arm}_seed{s}.json", run_config(arm, s, args)
        theirs = json.loads(record.read_text()).get("config") if record.exists() else None
        if theirs is not None and differing_sections(theirs, ours):
            raise SystemExit(f"{out}: its {arm} seed {s} trained another Config (sections "
                             f"{differing_sections(theirs, ours)} differ); use another --out")
        runs[(arm, s)]["config"] = ours
        record.write_text(json.dumps(runs[(arm, s)], indent=2))
    missing = [f"{arm} seed {s}" for arm, s in todo if (arm, s) not in runs]
    if missing:  # e.g. --arms team: the solo arm's runs copied in later make the summary
        print(f"ran {' and '.join(args.arms)}; the summary needs {', '.join(missing)} too")
        return
    summary = summarize(runs, args.steps)
    summary["wall_seconds"] = {f"{a}_seed{s}": w for (a, s), w in walls.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = table(summary) + "\n\n" + per_seed_table(summary) + "\n\n" + both_learn(runs)
    (out / "summary.md").write_text(text + "\n")
    plot(runs, out / "learning.png")
    print(text)
    print("wall seconds per run: " + ", ".join(f"{k} {v:.0f}" for k, v in summary["wall_seconds"].items()))


if __name__ == "__main__":
    main()
