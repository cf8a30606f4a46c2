"""The trainer on packed rows: the same first update as on padded rows, through ``train()``.

Step 1's rollouts come from the same params and seeds in both runs, so its batch is the
same; the loss and the advantages-weighted update must then agree (float32, CPU). Both
runs take the on-policy shortcut (one minibatch, one epoch: old = sg(logp) of the update).
The packed run has two micro-batches of one 128-token row, the padded run one of 8 rows.
"""

from __future__ import annotations

import json

import pytest

from agentrl_jax.config import load_config
from agentrl_jax.train.run import train

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=6",
    "rollout.max_sequence_length=96", "data.prompts_per_step=2", "algorithm.group_size=4",
    "environment.num_train_tasks=16", "environment.num_eval_tasks=2", "eval.num_tasks=2",
    "eval.samples_per_task=1", "sft.steps=0", "checkpoint.resume=false", "logging.sample_trajectories=0",
    "total_steps=1", "algorithm.entropy_coef=0.01",
]


def _first_step(tmp_path, name, extra):
    out = tmp_path / name
    train(load_config("demo", TINY + [f"output_dir={out}"] + extra))
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if "loss" in r)


@pytest.mark.slow  # two train() runs, ~1 min of CPU
def test_packed_rows_train_the_same_first_update_as_padded_rows(tmp_path):
    padded = _first_step(tmp_path, "padded", [])
    packed = _first_step(tmp_path, "packed", ["algorithm.pack_rows=true", "algorithm.pack_row_tokens=128",
                                             "algorithm.micro_batch_tokens=128"])
    assert padded["old_policy/from_update"] == packed["old_policy/from_update"] == 1.0
    assert packed["pack/rows"] < 8 and packed["pack/fill"] > packed["pack/padded_fill"]
    assert packed["train_tokens"] == padded["train_tokens"] > 0
    # sums over micro-batches (the others, e.g. entropy, are means of per-micro-batch means)
    for key in ("loss", "grad_norm", "update_norm", "param_norm"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
