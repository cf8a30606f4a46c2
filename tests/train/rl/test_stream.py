"""The group stream of the RL loop (``async_rl.mode='stream'``), with scripted groups and the real
GroupStream: the staleness bound under random tool latencies, the synchronous schedule at
max_staleness 0, resume without training a prompt twice, dynamic sampling, failures, sizing."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from agentrl_jax.train.rl.stream import GroupStream


class Prompts:
    """A prompt iterator with a restorable position: draw d holds prompts d*P .. d*P + P - 1."""

    def __init__(self, per_draw: int, drawn: int = 0):
        self.per_draw, self.batches_served = per_draw, drawn

    def __next__(self):
        self.batches_served += 1
        first = (self.batches_served - 1) * self.per_draw
        return list(range(first, first + self.per_draw))

    def get_state(self):
        return {"drawn": self.batches_served}


def _scripted(latency, rewards=lambda prompt: [0.0, 1.0], fail_on=None):
    """run_group: sleeps ``latency(prompt)`` s; records (prompt, engine step at start)."""
    started = {}

    async def run_group(prompt, draw, position):
        started[prompt] = (draw, position)
        if prompt == fail_on:
            raise ValueError("sandbox down")
        await asyncio.sleep(latency(prompt))
        return [SimpleNamespace(prompt=prompt, reward=r, masked=False, group_id=-1) for r in rewards(prompt)], 0.5

    return run_group, started


def _train(stream: GroupStream, start_step: int, stop_step: int, update_s: float = 0.003):
    """The loop's protocol: batch(t), 'train' (with the engine version the stream must respect), finish(t)."""
    trained, metrics, states = {}, {}, {}

    async def main():
        async with stream:
            for step in range(start_step, stop_step):
                trajectories, stats, seconds = await stream.batch(step)
                assert seconds >= 0
                # the engine holds step - start_step here: every group started at >= step - k
                trained[step] = [(t.prompt, t.group_id) for t in trajectories]
                metrics[step] = {**stats, "lags": [step - start_step - g.started_at for g in stream.last_batch]}
                await asyncio.sleep(update_s)
                # the loop takes both at once, after the update, for the metrics and the checkpoint
                states[step + 1] = stream.data_state(step + 1)
                metrics[step].update(stream.metrics())
                await stream.finish(step)

    asyncio.run(main())
    return trained, metrics, states


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_staleness_bound_holds_under_random_tool_latencies(max_staleness):
    rng = random.Random(max_staleness)
    delays = {}
    run_group, _ = _scripted(lambda p: delays.setdefault(p, min(rng.lognormvariate(0, 1) * 0.002, 0.02)))
    P, steps = 3, 12
    stream = GroupStream(run_group, Prompts(P), 0, steps, max_staleness, P, decode_lanes=64, group_size=2)
    trained, metrics, _ = _train(stream, 0, steps)
    prompts = [p for step in trained.values() for p, _ in step]
    assert len(prompts) == 2 * P * steps and len(set(prompts)) == P * steps  # each group once, whole
    for step, m in metrics.items():
        assert max(m["lags"]) <= max_staleness, (step, m["lags"])
        assert m["stream/admission_lag_max"] == max(m["lags"])
        ids = [g for _, g in trained[step]]
        assert ids == sorted(ids) and set(ids) == set(range(P))  # draw order, group ids by position
    if max_staleness:  # the stream ran ahead: some trained groups started while earlier steps trained
        assert max(max(m["lags"]) for m in metrics.values()) > 0


def test_zero_staleness_is_the_synchronous_schedule():
    run_group, started = _scripted(lambda p: 0.004 if p % 2 else 0.001)
    P = 4
    trained, metrics, _ = _train(GroupStream(run_group, Prompts(P), 0, 5, 0, P, decode_lanes=64), 0, 5)
    for step, batch in trained.items():
        # step t trains draw t's prompts, in their order, seeded by (draw t, position): as rollout_fn
        assert [p for p, _ in batch[::2]] == list(range(step * P, step * P + P))
        assert all(started[p] == (step, p - step * P) for p, _ in batch)
        assert metrics[step]["lags"] == [0] * P and metrics[step]["stream/resume_loses_groups"] == 0


def test_a_resumed_stream_trains_no_prompt_twice():
    P, steps, saved_at = 2, 8, 4
    first, _ = _scripted(lambda p: 0.001 + 0.004 * (p % 3 == 0))
    data = Prompts(P)
    before, metrics, states = _train(GroupStream(first, data, 0, steps, 2, P, decode_lanes=64), 0, saved_at)
    # resume from the checkpoint after step saved_at - 1: the iterator restored to its position
    restored = Prompts(P, drawn=states[saved_at]["drawn"])
    second, _ = _scripted(lambda p: 0.001)
    after, _, _ = _train(GroupStream(second, restored, saved_at, steps, 2, P, first_draw=restored.batches_served,
                                     decode_lanes=64), saved_at, steps)
    trained_before = {p for batch in before.values() for p, _ in batch}
    trained_after = {p for batch in after.values() for p, _ in batch}
    assert not trained_before & trained_after
    assert len(trained_after) == P * (steps - saved_at)
    # what the resume lost is what the metric said at the save: groups running or buffered, and prompts
    # drawn but not started
    lost = set(range(states[saved_at]["drawn"] * P)) - trained_before
    m = metrics[saved_at - 1]  # logged with the checkpoint
    assert len(lost) == m["stream/resume_loses_groups"] + m["stream/resume_skips_prompts"] > 0


def test_dynamic_sampling_drops_all_equal_groups_and_draws_more():
    run_group, started = _scripted(lambda p: 0.001, rewards=lambda p: [1.0, 1.0] if p % 3 == 0 else [0.0, 1.0])
    P, steps = 2, 4
    stream = GroupStream(run_group, Prompts(P), 0, steps, 1, P, dynamic_sampling=True, max_sampling_rounds=4,
                         decode_lanes=64)
    trained, metrics, _ = _train(stream, 0, steps)
    prompts = [p for batch in trained.values() for p, _ in batch]
    assert len(prompts) == 2 * P * steps and not any(p % 3 == 0 for p in prompts)
    assert sum(m["stream/dropped_groups"] for m in metrics.values()) >= len([p for p in started if p % 3 == 0]) - P


def test_dynamic_sampling_keeps_all_equal_groups_after_its_rounds():
    run_group, _ = _scripted(lambda p: 0.001, rewards=lambda p: [1.0, 1.0])
    stream = GroupStream(run_group, Prompts(2), 0, 2, 0, 2, dynamic_sampling=True, max_sampling_rounds=1,
                         decode_lanes=64)
    trained, metrics, _ = _train(stream, 0, 2)
    assert [len(b) for b in trained.values()] == [4, 4]
    assert metrics[0]["stream/dropped_groups"] == 2 and metrics[1]["stream/kept_uninformative_total"] >= 2


def test_a_failed_group_stops_the_stream_with_its_error():
    run_group, _ = _scripted(lambda p: 0.001, fail_on=3)
    with pytest.raises(RuntimeError, match="rollout failed") as info:
        _train(GroupStream(run_group, Prompts(2), 0, 4, 1, 2, decode_lanes=64), 0, 4)
    assert isinstance(info.value.__cause__, ValueError)


def test_groups_in_flight_follow_littles_law_within_the_caps():
    stream = GroupStream(None, Prompts(4), 0, 10, 2, 4, decode_lanes=64, group_size=8)
    assert stream.target_in_flight() == 8  # 64 lanes / 8 episodes a group, nothing measured yet
    stream.tool_share = 0.75
    assert stream.target_in_flight() == 32  # a quarter of an episode's time decodes: 4x the lanes
    stream.max_groups = 20
    assert stream.target_in_flight() == 20
    stream.kv_groups = lambda: 6
    assert stream.target_in_flight() == 6
    stream.kv_groups = lambda: 2
    assert stream.target_in_flight() == 4  # never fewer than one batch
    # the staleness bound: (engine step + k - batches taken + 1) batches, and none past the last step
    assert stream.capacity() == 12
    stream.taken = 1
    assert stream.capacity() == 8
    stream.engine_step, stream.taken = 9, 9
    assert stream.capacity() == 4


def test_the_batch_digest_sees_every_field_the_update_reads():
    import numpy as np

    from agentrl_jax.envs.base import Trajectory
    from agentrl_jax.train.rl.collect import batch_digest

    def trajectory(**change):
        fields = dict(prompt_token_ids=np.array([1, 2]), token_ids=np.array([1, 2, 3, 4]),
                      loss_mask=np.array([0, 0, 1, 1], np.int8), rollout_logprobs=np.array([0, 0, -0.5, -1.0], np.float32),
                      params_versions=np.array([-1, -1, 3, 4], np.int32), reward=1.0, group_id=0)
        return Trajectory(**{**fields, **change})

    base = batch_digest([trajectory(), trajectory(group_id=1)])
    assert batch_digest([trajectory(), trajectory(group_id=1)]) == base
    for change in (dict(token_ids=np.array([1, 2, 3, 5])), dict(loss_mask=np.array([0, 0, 0, 1], np.int8)),
                   dict(rollout_logprobs=np.array([0, 0, -0.5, -1.5], np.float32)),
                   dict(params_versions=np.array([-1, -1, 4, 4], np.int32)), dict(reward=0.0), dict(group_id=2),
                   dict(masked=True)):
        assert batch_digest([trajectory(), trajectory(**{"group_id": 1, **change})]) != base, change
    assert batch_digest([trajectory(group_id=1), trajectory()]) != base  # the order too


@pytest.mark.parametrize("overrides, message", [
    (["async_rl.mode=stream"], "async_rl.mode: 'stream' needs async_rl.enabled=true"),
    (["async_rl.enabled=true", "async_rl.mode=stream", "async_rl.stream_max_groups=-1"],
     "async_rl.stream_max_groups: must be >= 0"),
    (["async_rl.enabled=true", "async_rl.mode=streaming"], "async_rl.mode: got 'streaming'"),
])
def test_config_refuses_a_stream_it_cannot_run(overrides, message):
    from agentrl_jax.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config("demo", overrides)


def test_several_hosts_accept_async_and_dynamic_sampling_only_in_the_stream(monkeypatch):
    from agentrl_jax.config import ConfigError, load_config
    from agentrl_jax.train import multihost

    monkeypatch.setattr(multihost.jax, "process_count", lambda: 2)  # the check reads only the host count
    for mode in ("step", "stream"):
        multihost.check_supported(load_config("demo", ["async_rl.enabled=true", f"async_rl.mode={mode}",
                                                       "async_rl.old_logprobs=snapshot"]))
    multihost.check_supported(load_config("demo", ["async_rl.enabled=true", "async_rl.mode=stream",
                                                   "async_rl.old_logprobs=snapshot", "algorithm.dynamic_sampling=true"]))
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling: on several hosts only with"):
        multihost.check_supported(load_config("demo", ["algorithm.dynamic_sampling=true"]))


def test_the_timed_env_measures_tool_calls_and_passes_the_rest_through():
    from agentrl_jax.envs.base import Environment, StepResult
    from agentrl_jax.train.rl.stream import _TimedEnv

    class SlowTool(Environment):
        num_sampled_tokens = 0

        async def reset(self, task):
            return [{"role": "user", "content": task}]

        async def step(self, action_text):
            await asyncio.sleep(0.03)
            return StepResult("ok", float(self.num_sampled_tokens), True, finish_reason="answer")

    inner = SlowTool()
    env = _TimedEnv(inner)

    async def episode():
        await env.reset("q")
        await asyncio.sleep(0.03)  # decoding: not tool time
        env.num_sampled_tokens = 7  # the agent loop tells the environment its token count
        return await env.step("call")

    result = asyncio.run(episode())
    assert inner.num_sampled_tokens == 7 and result.reward == 7.0
    assert 0.03 <= env.tool_seconds < 0.06
