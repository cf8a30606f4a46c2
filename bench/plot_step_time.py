"""Plot a decode step's device time, raw decode next to a traced rollout, by kernel.

    python bench/plot_step_time.py --raw docs/rollout_results/multi_turn_profile/raw_decode_profile_programs.json \
        --rollout docs/rollout_results/multi_turn_profile/multi_turn_stop_96_profile.json \
        --timeline docs/rollout_results/multi_turn_profile/multi_turn_stop_96_profile_timeline.json \
        --out docs/rollout_step_time.png

Inputs are what `bench/rollout.py --profile DIR` writes: DIR/raw_trace/programs.json (the raw
baseline's timed pass: ``dispatches`` and each program's kernels), the run's ``--json`` row
(``profile_decode_dispatches``, ``steps_per_dispatch`` defaults to 16) and DIR/timeline.json
(``device_ms_by_program`` of the traced rollout pass). Each bar is ms of device time per decode
step: the decode attention kernel, the rest of the decode program, and (rollout) the prefill
calls' device time spread over the steps.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ATTENTION = "decode_attention"


def split(program: dict, steps: int) -> tuple[float, float]:
    """(attention ms, other ms) per step of a decode program's kernels."""
    attention = sum(k["ms"] for name, k in program["kernels"].items() if name.startswith(ATTENTION))
    return attention / steps, (program["ms"] - attention) / steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw", required=True)
    parser.add_argument("--rollout", required=True)
    parser.add_argument("--timeline", required=True)
    parser.add_argument("--steps-per-dispatch", type=int, default=16)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    raw = json.load(open(args.raw))
    run = json.load(open(args.rollout))
    programs = json.load(open(args.timeline))["device_ms_by_program"]
    decode = next(p for name, p in programs.items() if name.startswith("jit_generate"))
    prefill = sum(p["ms"] for name, p in programs.items() if "prefill" in name)
    raw_program = next(p for name, p in raw.items() if name.startswith("jit_generate"))
    raw_steps = raw["dispatches"] * args.steps_per_dispatch
    steps = run["profile_decode_dispatches"] * args.steps_per_dispatch
    def context(key):  # rows of bench/rollout.py older than mean_decode_context lack it
        return f"\n(mean context {run[key]})" if key in run else ""

    bars = {
        f"raw decode{context('raw_mean_decode_context')}": (*split(raw_program, raw_steps), 0.0),
        f"multi-turn rollout{context('mean_decode_context')}": (*split(decode, steps), prefill / steps),
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(bars)
    bottom = [0.0] * len(names)
    for i, (part, color) in enumerate((("decode attention kernel", "tab:red"), ("rest of the decode step", "tab:blue"),
                                       ("prefill calls", "tab:green"))):
        values = [bars[n][i] for n in names]
        ax.bar(names, values, bottom=bottom, label=part, color=color)
        for x, (v, b) in enumerate(zip(values, bottom)):
            if v > 0.05:
                ax.text(x, b + v / 2, f"{v:.2f}", ha="center", va="center", color="white")
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.text(x, total + 0.03, f"{total:.2f} ms", ha="center")
    ax.set_ylabel("device ms per decode step (64 lanes)")
    ax.set_title(f"{run.get('device', '')}, {run.get('size', '')}: where a step's device time goes")
    ax.set_ylim(0, max(bottom) * 1.45)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}: " + "; ".join(f"{n.splitlines()[0]} {sum(v):.3f} ms" for n, v in bars.items()))


if __name__ == "__main__":
    main()
