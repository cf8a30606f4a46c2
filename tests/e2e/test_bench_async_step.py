"""`bench/async_step.py`'s pieces that run without a device: its latency environment keeps the
`StepResult` contract (a broken one masks every episode as an environment error, and the bench
would time steps that train nothing), and its summary refuses such steps."""

from __future__ import annotations

import asyncio

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/async_step.py")


def test_the_latency_env_answers_after_its_turns(bench):
    env = bench.latency_env(turns=2, median=0.001, sigma=0.0, cap=0.01, seed=0)(None, None, None, None)()

    async def episode():
        messages = await env.reset({"question": "1 + 1"})
        first = await env.step("some code")
        last = await env.step("an answer of odd length")
        return messages, first, last

    messages, first, last = asyncio.run(episode())
    assert messages == [{"role": "user", "content": "1 + 1"}]
    assert not first.done and first.observation_text == "<interpreter>42</interpreter>"
    assert last.done and last.finish_reason == "answer" and last.reward == 1.0


def test_a_step_that_trained_nothing_is_not_summarized(bench):
    step = {"time/step": 1.0, "time/rollout": 0.9, "time/update": 0.01, "rollout/trajectories": 64}
    assert bench.summarize("sync", [step, step], warmup=1)["step_s"] == 1.0
    empty = {**step, "step": 2, "train/empty_batch": 1.0, "rollout/finish/env_error": 1.0}
    with pytest.raises(SystemExit, match=r"steps \[2\] trained no token.*env_error"):
        bench.summarize("sync", [step, empty], warmup=1)
