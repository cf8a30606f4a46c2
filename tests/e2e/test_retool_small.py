"""configs/retool_small.py end to end on CPU: generated problems, scripted-solver SFT, GRPO in the
real ReTool environment (sandbox pool, verifier), the evaluation before and after RL.

A pipeline check, not a learning claim (docs/retool_small.md has the GPU numbers). The
default suite runs a smoke variant of configs/retool_small_cpu.py (a 1-layer model, a few
SFT and RL steps); the slow suite runs the CPU config exactly as docs/retool_small.md shows it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl_jax.config import load_config
from agentrl_jax.train.run import train

ROOT = Path(__file__).resolve().parents[2]
SMOKE = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.head_dim=16", "model.scratch.vocab_size=400", "rollout.max_new_tokens_per_turn=48",
    "rollout.max_sequence_length=320", "environment.num_train_tasks=64", "environment.num_demonstrations=24",
    "environment.num_eval_tasks=2", "eval.num_tasks=2", "eval.samples_per_task=1", "sft.steps=3",
    "sft.batch_size=8", "total_steps=1", "data.prompts_per_step=2", "algorithm.group_size=2",
    "logging.progress=false", "checkpoint.every_steps=0",
]
EVAL_KEYS = {"pass_at_1", "tool_use_rate", "calls_per_episode", "tool_error_rate", "mean_response_tokens"}


def _check_run(out: Path, total_steps: int) -> dict:
    results = json.loads((out / "results.json").read_text())
    for stage in ("start", "end"):
        assert EVAL_KEYS <= set(results[stage]), results[stage]
        assert {"held_out_range/pass_at_1", "held_out_combo/pass_at_1"} <= set(results[stage])  # scored per split
        assert 0.0 <= results[stage]["pass_at_1"] <= 1.0
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, total_steps + 1))
    for r in steps:  # the ReTool outcome reward is +1 / -1 per episode
        assert -1.0 <= r["reward/mean"] <= 1.0 and "tools/error_episode_rate" in r
    sft = [json.loads(line) for line in (out / "sft_metrics" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in sft if "sft/loss" in r]
    assert losses and losses[-1] < losses[0]  # the demonstrations reached the model
    return results


def test_retool_small_smoke(tmp_path):
    config = load_config("configs/retool_small_cpu.py", [f"output_dir={tmp_path}", *SMOKE])
    assert config.environment.name == "retool_small"
    train(config)
    _check_run(tmp_path, 1)


@pytest.mark.slow
def test_retool_small_cpu_config_as_documented(tmp_path):
    """`python launch/tpu_pod.py --config configs/retool_small_cpu.py` (docs/retool_small.md), as written:
    4-16 min on 2 cores, by load."""
    proc = subprocess.run([sys.executable, "launch/tpu_pod.py", "--config", "configs/retool_small_cpu.py",
                           "--set", f"output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = _check_run(tmp_path, load_config("configs/retool_small_cpu.py").total_steps)
    assert "held-out evaluation" in proc.stdout and "tool_error_rate" in results["table"]
