"""A stream preempted and resumed through the real trainer (``train(config)``, the tiny scratch
model, the real engine and checkpointer): the saved data position is restored, no prompt is
started (so none trained) in both legs, the groups in flight at the save are the ones the run
logged as lost, and the resumed run trains the remaining steps. At ``max_staleness=0`` nothing
is in flight at a step's end, so the resumed run gives the uninterrupted run's updates bit for bit.

The preemption is the real one: the environment sends this process SIGTERM at its first episode
(the start evaluation's); the trainer's handler stops the run at the end of the first RL step,
with a checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
from test_async import TINY

from agentrl_jax.config import load_config
from agentrl_jax.envs.base import Environment, StepResult
from agentrl_jax.train.run import train
from agentrl_jax.train.setup import load_task_data

TURNS, GROUP, PER_STEP, STEPS = 2, 4, 2, 3
COMMON = [f"total_steps={STEPS}", "optimizer.learning_rate=0.02", "rollout.max_sequence_length=160",
          "checkpoint.every_steps=1", "checkpoint.async_save=false", "async_rl.enabled=true", "async_rl.mode=stream",
          "eval.every_steps=0"]
RECOMPUTE = ["async_rl.old_logprobs=recompute", "algorithm.correction=tis"]


class RecordingToolEnv(Environment):
    """Two tool turns of ``latency`` s; records every task it is reset with, and sends SIGTERM to
    this process at the first reset when ``preempt`` (once: the handler restores the default)."""

    def __init__(self, latency: float, resets: list[str], preempt: list[bool]):
        self.latency, self.resets, self.preempt, self.turn = latency, resets, preempt, 0

    async def reset(self, task):
        self.turn = 0
        self.resets.append(task["question"])
        if self.preempt and self.preempt[0]:
            self.preempt[0] = False
            os.kill(os.getpid(), signal.SIGTERM)
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        await asyncio.sleep(self.latency)
        if self.turn >= TURNS:
            return StepResult("", float(len(action_text) % 2), True, finish_reason="answer")
        return StepResult("<interpreter>ok</interpreter>", 0.0, False)


def _leg(out: Path, *overrides: str, preempt: bool, latency: float = 0.2) -> tuple[dict[int, dict], list[str]]:
    """One run (or leg) of ``train``: its logged steps and the prompts its episodes were reset with."""
    resets: list[str] = []
    flag = [preempt]
    config = load_config("demo", TINY + [f"output_dir={out}", *COMMON, *overrides])
    train(config, make_env=lambda config, pool, verifier, tokenizer: lambda: RecordingToolEnv(latency, resets, flag))
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}, resets


def _saved_batches_served(out: Path, step: int) -> int:
    """The data draws the checkpoint at ``step`` records as served."""
    return int(json.loads((out / "checkpoints" / str(step) / "data_state" / "metadata").read_text())["batches_served"])


def _train_prompts(resets: list[str], out: Path) -> list[str]:
    """The resets of training episodes (the evaluations' prompts are the held-out ones)."""
    held_out = {t["question"] for t in load_task_data(load_config("demo", TINY + [f"output_dir={out}"]))[1]}
    return [q for q in resets if q not in held_out]


@pytest.mark.slow  # two legs of a whole run: ~45 s on the 2-core CPU
def test_a_preempted_stream_resumes_without_training_a_prompt_twice_and_counts_the_lost_groups(tmp_path):
    out = tmp_path / "run"
    first, resets = _leg(out, "async_rl.max_staleness=1", *RECOMPUTE, preempt=True)
    first_resets = _train_prompts(resets, out)
    # stopped at the end of step 1 (the SIGTERM came before it ended), with a checkpoint
    assert sorted(first) == [1]
    assert not (out / "results.json").exists()
    draws = _saved_batches_served(out, 1)
    started = len(set(first_resets))
    assert len(first_resets) == started * GROUP  # one reset per episode, the prompts all distinct
    logged = first[1]
    # what the save loses is what the stream held: started groups not trained, drawn prompts not started
    assert logged["stream/resume_loses_groups"] == started - PER_STEP > 0
    assert logged["stream/resume_skips_prompts"] == draws * PER_STEP - started

    second, resets = _leg(out, "async_rl.max_staleness=1", *RECOMPUTE, "checkpoint.resume=true",
                                  preempt=False)
    second_resets = _train_prompts(resets, out)
    assert sorted(second) == [1, 2, 3] and second[1] == first[1]  # the first leg's rows are kept
    assert not set(first_resets) & set(second_resets), "a prompt of the first leg was drawn again"
    for step in (2, 3):
        m = second[step]
        assert m["rollout/trajectories"] == PER_STEP * GROUP and m["skipped"] == 0
        assert m["async/trajectory_staleness_max"] <= 1 and m["async/staleness_violations"] == 0
    assert json.loads((out / "results.json").read_text())  # the resumed run finished its outputs


@pytest.mark.slow  # an uninterrupted run and two legs: ~60 s on the 2-core CPU
def test_at_zero_staleness_a_resumed_stream_gives_the_uninterrupted_updates_bit_for_bit(tmp_path):
    whole, _ = _leg(tmp_path / "whole", "async_rl.max_staleness=0", preempt=False)
    first, _ = _leg(tmp_path / "legs", "async_rl.max_staleness=0", preempt=True)
    assert sorted(first) == [1] and first[1]["stream/resume_loses_groups"] == 0
    assert first[1]["stream/resume_skips_prompts"] == 0 and _saved_batches_served(tmp_path / "legs", 1) == 1
    resumed, _ = _leg(tmp_path / "legs", "async_rl.max_staleness=0", "checkpoint.resume=true", preempt=False)
    assert sorted(whole) == sorted(resumed) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("reward/mean", "rollout/sampled_tokens", "loss", "grad_norm", "update_norm", "param_norm",
                    "entropy"):
            assert resumed[step][key] == whole[step][key], (step, key)
