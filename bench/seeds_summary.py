"""Table, mean +- sd and learning curves of a multi-seed run (bench/demo_seeds.sh writes one).

    python bench/seeds_summary.py OUT_DIR SEED [SEED ...] [--plots DIR] [--base BASE_DIR]

Reads OUT_DIR/seed<S>/results.json (held-out evaluation after SFT = "start", after RL =
"end") and metrics/metrics.jsonl, prints a markdown table per seed, the mean and sample
standard deviation (ddof=1) over seeds, the median rollout throughput of the RL steps, and
with --plots (matplotlib) writes PNG learning curves: RL reward, tool use, calls per
episode, error-recovery rate and throughput per step, and the SFT loss.

With --base, BASE_DIR/seed<S>/results.json is a run of the same config with no SFT and no RL
step (``--set sft.steps=0 --set total_steps=0``): its "start" evaluation is the untrained
model's on the same held-out tasks, printed as a third stage, with pass@1 per held-out split.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = [("pass_at_1", "pass@1"), ("pass_at_4", "pass@4"), ("tool_use_rate", "tool use"),
           ("calls_per_episode", "calls/episode"), ("tool_error_rate", "episodes with an error"),
           ("error_recovery_rate", "error recovery")]
CURVES = [("reward/mean", "reward (mean, +1/-1)"), ("tools/use_rate", "tool-use rate"),
          ("tools/calls_per_episode", "tool calls per episode"),
          ("tools/error_recovery_rate", "error recovery (correct | failed call), dashed: episodes with a failed call"),
          ("throughput/sampled_tokens_per_s", "rollout: sampled tokens / s")]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


STAGE_NAMES = {"base": "base", "start": "SFT", "end": "RL"}


def table(runs: dict[str, dict], columns=COLUMNS) -> list[str]:
    """One row per seed and the mean / sd over seeds; a column per key and stage (base if present, SFT, RL)."""
    stages = [s for s in ("base", "start", "end") if any(s in r for r in runs.values())]
    keys = [(k, name) for k, name in columns if any(k in r.get(s, {}) for r in runs.values() for s in stages)]
    head = "| seed | " + " | ".join(f"{STAGE_NAMES[s]} {n}" for _, n in keys for s in stages) + " | total s |"
    lines = [head, "|---" * (len(stages) * len(keys) + 2) + "|"]
    for seed, r in runs.items():
        cells = [_fmt(r.get(s, {}).get(k)) for k, _ in keys for s in stages]
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {r.get('total_seconds', 0):.0f} |")
    for stat, fn in (("mean", statistics.mean), ("sd", statistics.stdev)):
        if len(runs) < 2 and stat == "sd":
            continue
        cells = []
        for k, _ in keys:
            for stage in stages:
                values = [r[stage][k] for r in runs.values() if k in r.get(stage, {})]
                cells.append(_fmt(fn(values)) if len(values) >= (2 if stat == "sd" else 1) else "-")
        lines.append(f"| {stat} | " + " | ".join(cells) + " | |")
    return lines


def split_columns(runs: dict[str, dict]) -> list[tuple[str, str]]:
    """pass@1 and pass@4 of every held-out split the evaluations report (``<split>/pass_at_1``)."""
    splits = sorted({k.split("/")[0] for r in runs.values() for k in r.get("end", {}) if "/" in k})
    return [(f"{split}/{k}", f"{split} {n}") for split in splits for k, n in COLUMNS[:2]]


def throughput(out: Path, seeds: list[str]) -> list[str]:
    lines = []
    for seed in seeds:
        steps = [r for r in _rows(out / f"seed{seed}" / "metrics" / "metrics.jsonl") if "time/rollout" in r][1:]
        if not steps:
            continue
        med = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
        lines.append(f"seed {seed}: median over RL steps 2..{len(steps) + 1}: rollout {med('time/rollout'):.2f} s "
                     f"for {med('rollout/trajectories'):.0f} episodes ({med('rollout/sampled_tokens'):.0f} sampled "
                     f"tokens, {med('throughput/sampled_tokens_per_s'):.0f} tokens/s), update {med('time/update'):.2f} s, "
                     f"step {med('time/step'):.2f} s")
    return lines


def plots(out: Path, seeds: list[str], plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for seed in seeds:
            rows = [r for r in _rows(out / f"seed{seed}" / "metrics" / "metrics.jsonl") if key in r and r["step"] > 0]
            line, = ax.plot([r["step"] for r in rows], [r[key] for r in rows], label=f"seed {seed}")
            if key == "tools/error_recovery_rate":
                rows = [r for r in _rows(out / f"seed{seed}" / "metrics" / "metrics.jsonl")
                        if "tools/error_episode_rate" in r and r["step"] > 0]
                ax.plot([r["step"] for r in rows], [r["tools/error_episode_rate"] for r in rows], "--",
                        color=line.get_color())
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step")
        ax.legend()
    ax = axes.flat[len(CURVES)]
    for seed in seeds:
        rows = [r for r in _rows(out / f"seed{seed}" / "sft_metrics" / "metrics.jsonl") if "sft/loss" in r]
        ax.plot([r["step"] for r in rows], [r["sft/loss"] for r in rows], label=f"seed {seed}")
    ax.set_title("SFT loss (NLL per policy token)")
    ax.set_xlabel("SFT step")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    curves = plot_dir / "learning_curves.png"
    fig.savefig(curves, dpi=110)
    plt.close(fig)

    runs = {s: json.loads((out / f"seed{s}" / "results.json").read_text()) for s in seeds}
    fig, ax = plt.subplots(figsize=(8, 4))
    keys = [(k, n) for k, n in COLUMNS if all(k in r["start"] and k in r["end"] for r in runs.values())]
    width = 0.38
    for offset, stage, label in ((-width / 2, "start", "after SFT"), (width / 2, "end", "after RL")):
        means = [statistics.mean(r[stage][k] for r in runs.values()) for k, _ in keys]
        sds = [statistics.stdev(r[stage][k] for r in runs.values()) if len(runs) > 1 else 0 for k, _ in keys]
        ax.bar([i + offset for i in range(len(keys))], means, width, yerr=sds, capsize=3, label=label)
    ax.set_xticks(range(len(keys)), [n for _, n in keys], rotation=20)
    ax.set_title(f"held-out evaluation, mean +- sd over {len(runs)} seeds")
    ax.legend()
    fig.tight_layout()
    bars = plot_dir / "held_out_eval.png"
    fig.savefig(bars, dpi=110)
    plt.close(fig)
    return [curves, bars]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("seeds", nargs="+")
    parser.add_argument("--plots", type=Path, help="write PNG learning curves into this directory")
    parser.add_argument("--base", type=Path, help="runs of the untrained model (BASE_DIR/seed<S>/results.json)")
    args = parser.parse_args()
    runs = {}
    for seed in args.seeds:
        path = args.out / f"seed{seed}" / "results.json"
        if path.exists() and "end" in json.loads(path.read_text()):
            runs[seed] = json.loads(path.read_text())
        else:
            print(f"seed {seed}: no finished results.json ({path})")
    for seed, run in runs.items():
        base = args.base / f"seed{seed}" / "results.json" if args.base else None
        if base is not None and base.exists():
            run["base"] = json.loads(base.read_text())["start"]
        elif base is not None:
            print(f"seed {seed}: no base results.json ({base})")
    if runs:
        print("\n".join(table(runs)))
        print()
        print("\n".join(table(runs, split_columns(runs))))
    print("\n".join(throughput(args.out, args.seeds)))
    if args.plots and runs:
        for path in plots(args.out, list(runs), args.plots):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
