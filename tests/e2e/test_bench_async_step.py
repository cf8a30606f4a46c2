"""`bench/async_step.py`'s pieces that run without a device: its latency environment keeps the
`StepResult` contract (a broken one masks every episode as an environment error, and the bench
would time steps that train nothing), and its summary refuses such steps."""

from __future__ import annotations

import argparse
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


def test_the_report_gives_each_modes_ratios_to_sync_and_to_its_tool_free_rate(bench):
    def row(mode, median, traj_per_s, tokens_per_s):
        return {"mode": mode, "tool_median": median, "step_s": 1.0, "rollout_s": 1.0, "update_s": 0.1,
                "trainer_idle_s": 0.0, "rollout_idle_s": 0.0, "traj_per_s": traj_per_s, "tokens_per_s": tokens_per_s,
                "staleness": 0.0, "mixed": 0.0}

    args = argparse.Namespace(size="tiny", prompts=2, group=2, turns=2, new_tokens=8, tool_sigma=1.0, tool_cap=10.0,
                              placement="colocated", max_staleness=1, warmup=1, steps=8)
    text = bench.report([row("sync", 1.0, 2.0, 100.0), row("stream", 1.0, 5.0, 300.0),
                         row("sync", 0.0, 8.0, 400.0), row("stream", 0.0, 8.0, 400.0)], "1 x H100", args)
    assert "device: 1 x H100" in text
    assert "means over steps 3..7 (stream: without the ramp and the drain), steps 2..8 (sync)" in text
    only_sync = bench.report([row("sync", 1.0, 2.0, 100.0)], "1 x H100", args)
    assert "means over steps 2..8 (sync)\n" in only_sync  # no window for a mode the run did not have
    assert "stream / sync at tool median 1 s: traj/s 2.50x, sampled tok/s 3.00x" in text
    assert "stream: sampled tok/s at tool median 1 s / at 0 s: 0.75" in text
    assert "sync: sampled tok/s at tool median 1 s / at 0 s: 0.25" in text


def test_the_pipelined_modes_are_timed_without_the_buffers_ramp_and_drain(bench):
    # A stream at max_staleness 2: steps 2-3 train groups that finished during step 1's compile,
    # steps 9-10 groups admitted before them; only 4..8 time the pipeline.
    times = [30.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 5.0, 1.0, 1.0]
    steps = [{"step": i + 1, "time/step": t, "time/rollout": t, "time/update": 1.0, "rollout/trajectories": 10,
              "rollout/sampled_tokens": 100} for i, t in enumerate(times)]
    assert [s["step"] for s in bench.steady_window("stream", steps, 1, 2)] == [4, 5, 6, 7, 8]
    assert bench.summarize("stream", steps, 1, max_staleness=2)["traj_per_s"] == 2.0
    assert [s["step"] for s in bench.steady_window("sync", steps, 1, 2)] == list(range(2, 11))
    with pytest.raises(SystemExit, match=r"--steps 10 must exceed --warmup 3 \+ 2 x max_staleness 4"):
        bench.steady_window("async", steps, 3, 4)
