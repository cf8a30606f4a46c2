"""The real entry point, end to end, on the 8 fake CPU devices.

`launch/tpu_pod.py --config configs/demo.py` (the README's main command) with a tiny model:
scratch tokenizer and model, SFT, 2 RL steps through the real engine, driver, sandbox pool
and arithmetic environment on a (data=2, fsdp=2, tensor=2) mesh; then resume.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320",
    "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=12", "rollout.max_sequence_length=96",
    "data.prompts_per_step=2", "algorithm.group_size=4", "algorithm.entropy_coef=0.01",
    "environment.num_train_tasks=64", "environment.num_eval_tasks=4",
    "eval.num_tasks=4", "eval.samples_per_task=2",
    "sft.steps=3", "sft.batch_size=8",
]


def _launch(out_dir, *extra, check=True):
    env = dict(os.environ)  # carries the 8-fake-device XLA_FLAGS from conftest
    cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py",
           "--set", f"output_dir={out_dir}"]
    for item in TINY + list(extra):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def assert_counts_of_samples(pass_at_1: float, num_samples: int) -> None:
    """Unbiased pass@1 is (correct samples) / (tasks x samples): a multiple of 1 / num_samples."""
    correct = pass_at_1 * num_samples
    assert 0 <= pass_at_1 <= 1 and abs(correct - round(correct)) < 1e-6, (pass_at_1, num_samples)


def _metrics(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "run"
    proc = _launch(out, "total_steps=2", "checkpoint.resume=false")
    return out, proc


def test_demo_command_trains_two_steps_on_a_2x2x2_mesh(two_step_run):
    out, proc = two_step_run
    assert "held-out evaluation" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    for stage in ("start", "end"):
        assert results[stage]["num_tasks"] == 4
        assert_counts_of_samples(results[stage]["pass@1"], 4 * 2)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert math.isfinite(m["loss"]) and m["skipped"] == 0
        assert m["update_norm"] > 0  # params changed (the entropy term always has a gradient)
        assert m["logprob_gap_train_infer"] < 1e-4  # engine and trainer logprobs agree
        assert m["rollout/sampled_tokens"] > 0
    from agentrl_jax.train.metrics import read_tensorboard

    tb = read_tensorboard(out / "metrics")
    assert "reward/mean" in tb and len(tb["reward/mean"]) == 2
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    data = next(r for r in rows if "data/train/rows_kept" in r)  # the task counts, written at step 0
    assert data["step"] == 0 and data["data/train/rows_kept"] >= 64 and data["data/train/rows_skipped"] == 0
    assert data["data/eval/rows_kept"] >= 4 and tb["data/train/rows_kept"] == [(0, data["data/train/rows_kept"])]
    assert (out / "init" / "model" / "config.json").exists()
    assert (out / "checkpoints").is_dir()


def test_bad_override_fails_with_the_field_name(tmp_path):
    proc = _launch(tmp_path / "bad", "algorithm.aggregation=mean", check=False)
    assert proc.returncode == 2
    assert "algorithm.aggregation: got 'mean'; allowed values are" in proc.stderr


def test_resume_continues_exactly_like_an_uninterrupted_run(two_step_run, tmp_path):
    """Kill after step 2 (the run ended there), resume to step 4; compare with 4 steps in one go."""
    out, _ = two_step_run
    _launch(out, "total_steps=4", "checkpoint.resume=true")
    resumed = _metrics(out)
    assert sorted(resumed) == [1, 2, 3, 4]
    straight_dir = tmp_path / "straight"
    _launch(straight_dir, "total_steps=4", "checkpoint.resume=false")
    straight = _metrics(straight_dir)
    for step in (3, 4):
        for key in ("reward/mean", "rollout/sampled_tokens", "loss", "grad_norm", "entropy", "param_norm"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-4, abs=1e-6), (step, key)
