"""PPO with a critic through the real entry point: `--set algorithm.advantage=gae` on the tiny demo
(scratch model, SFT, rollouts through the engine, a (data=2, fsdp=2, tensor=2) mesh), a critic
warm-up step, then a resume that must continue exactly like an uninterrupted run."""

import json
from pathlib import Path

import pytest
from test_launch_e2e import _launch

GAE = ["algorithm.advantage=gae", "critic.learning_rate=1e-3", "critic.warmup_steps=1", "critic.lam=0.95",
       "checkpoint.every_steps=2"]


def _steps(out_dir) -> dict[int, dict]:
    """metrics.jsonl rows merged by step (the evaluation writes rows of its own)."""
    steps: dict[int, dict] = {}
    for line in (Path(out_dir) / "metrics" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    return steps


@pytest.mark.slow  # three launches of the tiny demo, ~5 min on 2 CPU cores
def test_gae_trains_with_a_critic_and_resumes_exactly(tmp_path):
    out = tmp_path / "run"
    _launch(out, "total_steps=2", "checkpoint.resume=false", *GAE)
    first = _steps(out)
    warmup, trained = first[1], first[2]
    assert warmup["critic/policy_frozen"] == 1.0 and "loss" not in warmup  # only the critic moved
    assert "critic/policy_frozen" not in trained and "loss" in trained
    for row in (warmup, trained):
        assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0 and row["critic/skipped_updates"] == 0
        assert row["critic/valued_tokens"] > 0 and row["critic/value_std"] > 0
        for key in ("critic/explained_variance", "critic/value_mean", "critic/advantage_mean",
                    "critic/advantage_std", "critic/value_clip_frac", "critic/learning_rate"):
            assert key in row, key
    assert trained["critic/param_norm"] != warmup["critic/param_norm"]

    _launch(out, "total_steps=4", "checkpoint.resume=true", *GAE)
    straight_dir = tmp_path / "straight"
    _launch(straight_dir, "total_steps=4", "checkpoint.resume=false", *GAE)
    resumed, straight = _steps(out), _steps(straight_dir)
    for step in (3, 4):
        for key in ("reward/mean", "rollout/sampled_tokens", "loss", "grad_norm", "param_norm",
                    "critic/value_loss", "critic/grad_norm", "critic/param_norm", "critic/value_mean",
                    "critic/explained_variance", "critic/advantage_std"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.slow  # one launch of the tiny demo, ~2 min on 2 CPU cores
def test_gae_with_lora_adapters_on_the_policy(tmp_path):
    """The critic is a full model of its own; the policy it baselines trains only LoRA adapters."""
    out = tmp_path / "run"
    _launch(out, "total_steps=2", "checkpoint.resume=false", "model.lora.rank=4", *GAE)
    warmup, trained = (steps := _steps(out))[1], steps[2]
    assert warmup["critic/policy_frozen"] == 1.0 and "loss" not in warmup
    assert trained["update_norm"] > 0 and trained["critic/value_loss"] > 0 and trained["critic/grad_norm"] > 0
    assert trained["critic/param_norm"] != warmup["critic/param_norm"]
