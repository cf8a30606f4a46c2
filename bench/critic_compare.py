"""The runs and the summary of bench/critic_compare.sh: GRPO vs PPO with a critic, several seeds.

    python bench/critic_compare.py run --config configs/demo.py [--set KEY=VALUE ...]
    python bench/critic_compare.py summary OUT_DIR --arms grpo ppo1 --seeds 0 1 2 [--plot PNG]

``run`` trains in this process (like launch/tpu_pod.py) and then writes the peak memory to
``<output_dir>/memory.json``: the device's ``peak_bytes_in_use`` (GPU / TPU), or the host
process's max RSS where the device reports none (CPU). ``summary`` reads
``OUT_DIR/<arm>/seed<S>/`` (results.json, metrics/metrics.jsonl, memory.json) and prints a
markdown table per arm: held-out pass@1 after SFT and after RL (mean +- sample sd over seeds),
sampled tokens of the RL steps, the median step wall-clock, peak memory and the critic's last
explained variance; ``--plot`` draws the mean reward per RL step of each arm (band: min / max
over seeds) and the held-out pass@1 after RL.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run(config_name: str, overrides: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    import jax

    from agentrl_jax.config import load_config
    from agentrl_jax.train.run import train

    config = load_config(config_name, overrides)
    train(config)
    stats = jax.devices()[0].memory_stats() or {}
    memory = ({"peak_gib": stats["peak_bytes_in_use"] / 2**30, "kind": "device"} if "peak_bytes_in_use" in stats
              else {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "kind": "host RSS"})
    (Path(config.output_dir) / "memory.json").write_text(json.dumps(memory))


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(run_dir: Path) -> list[dict]:
    """The RL steps' metric rows (those of the update), in order."""
    return [r for r in _rows(run_dir / "metrics" / "metrics.jsonl") if "time/step" in r]


def _mean_sd(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    if len(values) < 2:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.mean(values))} +- {fmt.format(statistics.stdev(values))}"


def arm_row(out: Path, arm: str, seeds: list[str]) -> str:
    runs = [out / arm / f"seed{s}" for s in seeds]
    results = [json.loads((r / "results.json").read_text()) for r in runs if (r / "results.json").exists()]
    steps = [_steps(r) for r in runs]
    memory = [json.loads((r / "memory.json").read_text()) for r in runs if (r / "memory.json").exists()]
    tokens = [sum(s.get("rollout/sampled_tokens", 0.0) for s in rows) for rows in steps if rows]
    # the first step compiles: the median over the others is the steady state
    step_s = [statistics.median(s["time/step"] for s in rows[1:]) for rows in steps if len(rows) > 1]
    ev = [rows[-1]["critic/explained_variance"] for rows in steps if rows and "critic/explained_variance" in rows[-1]]
    cells = [arm, f"{len(results)}/{len(seeds)}",
             _mean_sd([r["start"]["pass_at_1"] for r in results if "start" in r]),
             _mean_sd([r["end"]["pass_at_1"] for r in results if "end" in r]),
             _mean_sd(tokens, "{:.0f}"), _mean_sd(step_s, "{:.2f}"),
             _mean_sd([m["peak_gib"] for m in memory], "{:.2f}") + (f" ({memory[0]['kind']})" if memory else ""),
             _mean_sd(ev)]
    return "| " + " | ".join(cells) + " |"


def summary(out: Path, arms: list[str], seeds: list[str]) -> list[str]:
    head = ("| arm | runs | pass@1 after SFT | pass@1 after RL | sampled tokens (RL) | step s (median) | "
            "peak memory GiB | critic explained variance (last step) |")
    return [head, "|---" * 8 + "|"] + [arm_row(out, arm, seeds) for arm in arms]


def plot(out: Path, arms: list[str], seeds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, arm in enumerate(arms):
        rewards = [[r["reward/mean"] for r in _steps(out / arm / f"seed{s}")] for s in seeds]
        rewards = [r for r in rewards if r]
        if rewards:
            n = min(len(r) for r in rewards)
            stacked = np.asarray([r[:n] for r in rewards])
            x = np.arange(1, n + 1)
            curves.plot(x, stacked.mean(axis=0), label=arm)
            curves.fill_between(x, stacked.min(axis=0), stacked.max(axis=0), alpha=0.2)
        ends = [json.loads((out / arm / f"seed{s}" / "results.json").read_text())["end"]["pass_at_1"]
                for s in seeds if (out / arm / f"seed{s}" / "results.json").exists()]
        if ends:
            bars.bar(i, statistics.mean(ends), yerr=statistics.stdev(ends) if len(ends) > 1 else 0, capsize=4)
            bars.scatter([i] * len(ends), ends, color="black", s=10, zorder=3)
    curves.set_xlabel("RL step")
    curves.set_ylabel("training reward (mean over episodes)")
    curves.set_title(f"reward per step, mean over seeds {' '.join(seeds)} (band: min..max)", fontsize=9)
    curves.legend()
    bars.set_xticks(range(len(arms)), arms)
    bars.set_ylabel("held-out pass@1 after RL")
    bars.set_title("mean +- sd over seeds (dots: seeds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train one run and record its peak memory")
    r.add_argument("--config", required=True)
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    s = sub.add_parser("summary", help="table (and plot) of the runs under OUT_DIR")
    s.add_argument("out", type=Path)
    s.add_argument("--arms", nargs="+", required=True)
    s.add_argument("--seeds", nargs="+", required=True)
    s.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    if args.command == "run":
        run(args.config, args.overrides)
        return 0
    print("\n".join(summary(args.out, args.arms, args.seeds)))
    if args.plot:
        plot(args.out, args.arms, args.seeds, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
