"""configs/multi_policy_demo.py end to end on 8 fake CPU devices: a solver on devices 0-3 and a
checker on 4-7, each with its own scratch model, SFT on its own demonstrations, engine,
optimizer and checkpoints, trained at once on the solver-checker episode (real sandbox and
verifier); then a resume of both policies.

A pipeline check, not a learning claim.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from agentrl_jax.config import load_config
from agentrl_jax.config.policies import PolicyConfig
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models import split_params
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.train.run import train

SMOKE = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.head_dim=16", "model.scratch.vocab_size=400", "rollout.max_new_tokens_per_turn=24",
    "rollout.max_sequence_length=320", "environment.num_train_tasks=64", "environment.num_eval_tasks=2",
    "eval.num_tasks=2", "eval.samples_per_task=1", "data.prompts_per_step=2", "algorithm.group_size=2",
    "logging.progress=false", "logging.sample_trajectories=0", "checkpoint.every_steps=1",
    "checkpoint.export_hf=true", "rollout.max_concurrent=8",
    # A random model's team reward is 0 in every group (no advantage): the entropy term still moves
    # both policies, so the resume check compares params that changed.
    "algorithm.entropy_coef=0.05", "optimizer.warmup_steps=0",
]
# SFT of each policy on its actors' demonstrations (the solver's programs, the checker's verdicts)
SFT = ["sft.steps=2", "sft.batch_size=4", "environment.num_demonstrations=8"]


def _rows(out: Path, policy: str = "solver") -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if f"{policy}/train_tokens" in r}


def _exported(out: Path, name: str):
    return split_params(load_hf_checkpoint(str(out / "export" / name)))[1]


@pytest.mark.slow  # three runs, ~3 min on 2 cores
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_two_policies_on_sub_meshes_train_and_resume_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # rollout.warmup=on: CPU's "auto" skips it; every policy's engine compiles its programs up front
    results = train(load_config("configs/multi_policy_demo.py", [f"output_dir={straight}", "total_steps=2",
                                                                 "rollout.warmup=on", *SMOKE, *SFT]))
    assert results["schedule"] == "concurrent"
    assert sorted(results["rollout_warmup"]) == ["checker", "solver"]
    for stage in ("start", "end"):
        assert 0.0 <= results[stage]["team/final_correct"] <= 1.0 and "checker/accuracy" in results[stage]
    rows = _rows(straight)
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        for name in ("solver", "checker"):  # each policy trained its own tokens, with its own optimizer
            assert row[f"{name}/train_tokens"] > 0 and row[f"{name}/update_norm"] > 0
        assert row["checker/learning_rate"] != row["solver/learning_rate"]  # the checker's own optimizer
        for name in ("solver", "checker"):  # no rollout compiled a program its engine's warm-up did not
            assert row[f"{name}/rollout/engine/compiled_programs"] == results["rollout_warmup"][name]["programs"]
    for name in ("solver", "checker"):
        sft = [json.loads(line) for line in (straight / "policies" / name / "sft_metrics" / "metrics.jsonl")
               .read_text().splitlines()]
        assert [r["step"] for r in sft if "sft/loss" in r] == [0, 1]
        assert sorted(int(p.name) for p in (straight / "policies" / name / "checkpoints").iterdir()
                      if p.name.isdigit()) == [1, 2]

    # Killed after step 1: resume both policies from their step-1 checkpoints.
    train(load_config("configs/multi_policy_demo.py", [f"output_dir={resumed}", "total_steps=1", *SMOKE, *SFT]))
    train(load_config("configs/multi_policy_demo.py", [f"output_dir={resumed}", "total_steps=2",
                                                       "checkpoint.resume=true", *SMOKE, *SFT]))
    again = _rows(resumed)
    for key in ("solver/loss", "checker/loss", "solver/reward/mean", "checker/reward/mean"):
        assert again[2][key] == pytest.approx(rows[2][key], rel=1e-5, abs=1e-7), key
    for name in ("solver", "checker"):
        for a, b in zip(jax.tree.leaves(_exported(straight, name)), jax.tree.leaves(_exported(resumed, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit


@pytest.mark.slow  # one run, ~1 min on 2 cores
def test_self_play_one_policy_plays_both_roles_in_one_transcript(tmp_path):
    """Shared weights, roles by prompt: one policy on every device plays solver and checker in a
    shared view; its batch holds both actors' rows (groups per actor)."""
    config = load_config("configs/multi_policy_demo.py", [f"output_dir={tmp_path}", "total_steps=1",
                                                          "multi_policy.shared_view=true", *SMOKE])
    mp = config.multi_policy
    config = dataclasses.replace(config, multi_policy=dataclasses.replace(mp, policies=(
        PolicyConfig(name="team", actors=("solver", "checker")),)))
    results = train(config)
    assert results["schedule"] == "time_shared"
    [row] = _rows(tmp_path, "team").values()
    # both actors' rows: 2 prompts x 2 samples x 2 actors
    assert row["team/rollout/sampled_tokens"] > 0 and row["team/update_norm"] > 0
    assert (tmp_path / "export" / "team" / "config.json").exists()


def test_a_frozen_policy_acts_and_never_changes_while_the_other_trains(tmp_path):
    """multi_policy.frozen: the solver plays its turns but is never updated (its export is its
    scratch initialization, bit for bit); the checker trains on the same episodes. The checker
    has a tokenizer of its own (a smaller scratch vocabulary): it reads the solver's turns as text
    and its rows, samples and export are in its own tokens."""
    config = load_config("configs/multi_policy_demo.py", [f"output_dir={tmp_path}", "total_steps=2",
                                                          'multi_policy.frozen=["solver"]', *SMOKE,
                                                          "multi_policy.policies.checker.model.scratch.vocab_size=300",
                                                          "logging.sample_trajectories=1"])
    assert config.multi_policy.frozen == ("solver",)
    train(config)
    for name, size in (("solver", 400), ("checker", 300)):  # each export: its model and its own tokenizer
        export = tmp_path / "export" / name
        assert json.loads((export / "config.json").read_text())["vocab_size"] == size
        assert Tokenizer(str(export)).vocab_size == size
    samples = [json.loads(line) for line in (tmp_path / "metrics" / "samples.jsonl").read_text().splitlines()]
    assert {s["tag"] for s in samples} == {"solver/sample_0", "checker/sample_0"} and all(s["text"] for s in samples)
    rows = _rows(tmp_path, "checker")
    assert sorted(rows) == [1, 2]
    for row in rows.values():
        assert row["checker/update_norm"] > 0 and "solver/loss" not in row and "solver/update_norm" not in row
        assert row["solver/rollout/sampled_tokens"] > 0  # it still acts
    for name, same in (("solver", True), ("checker", False)):  # each against its own scratch initialization
        [initial] = [p.parent for p in (tmp_path / "policies" / name).rglob("config.json")
                     if "export" not in p.parts and "checkpoints" not in p.parts]
        start = split_params(load_hf_checkpoint(str(initial)))[1]
        pairs = zip(jax.tree.leaves(start), jax.tree.leaves(_exported(tmp_path, name)), strict=True)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs) == same, name


# The solver collects one step ahead (async_rl, bound 1), the checker stays on-policy (its own bound
# 0); a checkpoint every 2 steps: step 1 ends at a boundary, so nothing runs ahead across it.
ASYNC = ["async_rl.enabled=true", "async_rl.max_staleness=1", "algorithm.correction=tis",
         "multi_policy.policies.checker.async_rl.max_staleness=0", "checkpoint.every_steps=2"]


def test_async_per_policy_bounds_each_policys_staleness(tmp_path):
    """The next step's episodes are collected while the solver trains, on its weights from before
    the update: its tokens trained after a step that ran ahead are exactly one version old; the
    checker trains first and pushes before that collection, so its tokens are never stale."""
    train(load_config("configs/multi_policy_demo.py", [f"output_dir={tmp_path}", "total_steps=4", *SMOKE, *ASYNC,
                                                       "logging.sample_trajectories=1"]))
    solver, checker = _rows(tmp_path, "solver"), _rows(tmp_path, "checker")
    samples = [json.loads(line) for line in (tmp_path / "metrics" / "samples.jsonl").read_text().splitlines()]
    assert sorted((s["step"], s["tag"]) for s in samples) == [(step, f"{actor}/sample_0") for step in (1, 2, 3, 4)
                                                              for actor in ("checker", "solver")]
    assert all(s["text"] for s in samples)  # each actor's view, decoded
    assert sorted(solver) == sorted(checker) == [1, 2, 3, 4]
    # step 1 (index 0) ran ahead -> step 2 trained 1-stale tokens; step 2 saved (a boundary) -> step 3
    # fresh; step 3 ran ahead -> step 4 stale
    assert [solver[s]["solver/async/token_staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert solver[2]["solver/async/token_staleness_mean"] == 1.0
    assert all(checker[s]["checker/async/token_staleness_max"] == 0 for s in (1, 2, 3, 4))
    for row in solver.values():
        assert row["solver/update_norm"] > 0 and row["checker/update_norm"] > 0


@pytest.mark.slow  # three runs, ~2 min on 2 cores
def test_async_per_policy_resumes_exactly(tmp_path):
    """The pipeline is deterministic (weights pushed after the collection in flight) and drains at
    a checkpoint: killed after step 2 and resumed, both policies end bit for bit as a run of 3."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(load_config("configs/multi_policy_demo.py", [f"output_dir={straight}", "total_steps=3", *SMOKE, *ASYNC]))
    train(load_config("configs/multi_policy_demo.py", [f"output_dir={resumed}", "total_steps=2", *SMOKE, *ASYNC]))
    train(load_config("configs/multi_policy_demo.py", [f"output_dir={resumed}", "total_steps=3",
                                                       "checkpoint.resume=true", *SMOKE, *ASYNC]))
    assert _rows(straight)[2]["solver/async/token_staleness_max"] == 1  # step 1 ran ahead in both
    for name in ("solver", "checker"):
        for a, b in zip(jax.tree.leaves(_exported(straight, name)), jax.tree.leaves(_exported(resumed, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
