"""The checker's verdicts by class over training, for several team runs of
bench/multi_policy_learning.py: of the right first answers the share it accepted, of the wrong
ones the share it rejected, per step (training episodes) and at each held-out evaluation.

    python bench/multi_policy_checker.py runs/mp_arith_labeled runs/mp_arith_frozen_solver \\
        --labels "both train" "solver frozen" --out docs/multi_policy/checker_judgment.png

Runs from before ``checker/accepts_right`` and ``checker/rejects_wrong`` were logged get them
from what was: with p the share of right first answers, BA the balanced accuracy and R the
share rejected, R = p (1 - a) + (1 - p) b and BA = (a + b) / 2 give b = R - p + 2 p BA and
a = 2 BA - b (exact, up to the logged floats' rounding).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def verdict_rates(row: dict, prefix: str = "") -> tuple[float, float] | None:
    """(accepts right, rejects wrong) of one metrics row, logged or derived; None where a class
    did not occur."""
    logged = (row.get(f"{prefix}checker/accepts_right"), row.get(f"{prefix}checker/rejects_wrong"))
    if None not in logged:
        return logged
    keys = [f"{prefix}{k}" for k in ("team/first_correct", "checker/balanced_accuracy", "checker/rejected")]
    if any(k not in row for k in keys):
        return None
    p, ba, rejected = (row[k] for k in keys)
    rejects_wrong = rejected - p + 2 * p * ba
    return 2 * ba - rejects_wrong, rejects_wrong


def read_run(folder: Path) -> dict[int, dict]:
    """Per seed: {"train": [(step, accepts, rejects)], "eval": [...]} from the metrics of
    ``folder``'s team runs (runs/<out>/team/seed<N>/metrics/metrics.jsonl)."""
    seeds = {}
    for run in sorted((folder / "team").glob("seed*")):
        path, seed = run / "metrics" / "metrics.jsonl", int(run.name.removeprefix("seed"))
        if not path.exists():
            continue
        train, evals = [], []
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for prefix, out in (("", train), ("eval/", evals)):
                rates = verdict_rates(row, prefix)
                if rates is not None:
                    out.append((row["step"], *rates))
        if train or evals:  # (a run still in its SFT has none yet)
            seeds[seed] = {"train": train, "eval": evals}
    if not seeds:
        raise SystemExit(f"{folder}: no team runs' metrics in it (runs/<out>/team/seed<N>/metrics/metrics.jsonl, "
                         "where <out> is bench/multi_policy_learning.py's --out)")
    return seeds


def smooth(values: list[float], width: int = 3) -> list[float]:
    return [sum(values[max(0, i - width + 1):i + 1]) / len(values[max(0, i - width + 1):i + 1])
            for i in range(len(values))]


def table(runs: dict[str, dict[int, dict]]) -> str:
    lines = ["| run | seed | held-out accepts right (steps) | held-out rejects wrong (steps) |", "|---|---|---|---|"]
    for label, seeds in runs.items():
        for seed, run in sorted(seeds.items()):
            steps = " / ".join(str(s) for s, _, _ in run["eval"])
            lines.append(f"| {label} | {seed} | " + " -> ".join(f"{a:.2f}" for _, a, _ in run["eval"])
                         + f" ({steps}) | " + " -> ".join(f"{b:.2f}" for _, _, b in run["eval"]) + f" ({steps}) |")
    return "\n".join(lines)


def plot(runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, seeds), color in zip(runs.items(), colors):
        for i, (seed, run) in enumerate(sorted(seeds.items())):
            for ax, column in zip(axes, (1, 2)):
                steps = [r[0] for r in run["train"]]
                ax.plot(steps, smooth([r[column] for r in run["train"]]), color=color, alpha=0.35, lw=1)
                ax.plot([r[0] for r in run["eval"]], [r[column] for r in run["eval"]], "o-", color=color, lw=2,
                        label=label if i == 0 else None)
    axes[0].set_title("of the right first answers: accepted")
    axes[1].set_title("of the wrong first answers: rejected")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share (dots: held-out; lines: training, 3-step mean)")
    axes[1].legend()
    fig.suptitle("The checker's verdicts by class, one line per seed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="--out folders of bench/multi_policy_learning.py")
    p.add_argument("--labels", nargs="+", help="one per run (default: the folder names)")
    p.add_argument("--out", help="the PNG to write")
    args = p.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        p.error(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    runs = {label: read_run(Path(folder)) for label, folder in zip(labels, args.runs)}
    print(table(runs))
    if args.out:
        plot(runs, Path(args.out))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
