"""Plot where each `bench/rollout.py` workload's ratio goes, from the runs' ``--json`` files.

    python bench/plot_rollout_ratio.py docs/rollout_results/pipelined_baseline/*.json --out docs/rollout_ratio.png

Each bar is one run: the whole-pass ratio (rollout / raw decode), what the dispatched steps
lost against raw speed (prefill calls, longer contexts, host time: ceiling - ratio), and the
workload's ceiling loss (slot-steps that were empty or dropped: 1 - occupancy x kept).
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def label(run: dict) -> str:
    shape = f"{run['turns']} turn{'s' if run['turns'] > 1 else ''} x ~{run['turn_tokens']}"
    if not run.get("length_spread", 0.5):
        shape = shape.replace("~", "")
    ends = {"stop": ", stop ids", "length": ""}.get(run.get("ends", "length"), "")
    lanes = run.get("lanes", run["slots"])
    where = f"{run['episodes']} in {run['slots']} slots" + (f", {lanes} lanes" if lanes != run["slots"] else "")
    return f"{shape}{ends}\n{where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="bench/rollout.py --json files")
    parser.add_argument("--out", default="rollout_ratio.png")
    parser.add_argument("--title", default="bench/rollout.py, rollout / raw decode")
    args = parser.parse_args()
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    ratio = [r["ratio"] for r in runs]
    ceiling = [r["ratio_if_steps_ran_at_raw_speed"] for r in runs]
    top = [max(c, q) for c, q in zip(ceiling, ratio)]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.bar(x, ratio, color="#3a7", label="rollout / raw decode (whole pass)")
    ax.bar(x, [t - q for t, q in zip(top, ratio)], bottom=ratio, color="#ec6",
           label="lost per dispatched step (prefill, longer contexts, host)")
    ax.bar(x, [max(1 - t, 0) for t in top], bottom=top, color="#ccc", label="ceiling: empty or dropped slot-steps")
    for i, q in enumerate(ratio):
        ax.text(i, q / 2, f"{q:.2f}", ha="center", color="white", fontweight="bold")
    ax.axhline(0.8, color="#c33", ls="--", lw=1)
    ax.set_xticks(list(x), [label(r) for r in runs], fontsize=8)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("share of raw decode speed")
    ax.set_title(f"{args.title} ({runs[0]['device']}, {runs[0]['size']})", fontsize=9)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, -0.42), ncol=2)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(os.path.abspath(args.out))


if __name__ == "__main__":
    main()
