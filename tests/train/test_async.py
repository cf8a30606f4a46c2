"""Asynchronous rollouts (async_rl): staleness bound, partial rollouts, exact old logits, sync equivalence.

Whole runs of the real trainer (tiny scratch model, real engine/driver on the 8 fake CPU
devices, real sandbox pool) through `train(config, make_env=...)`. The scripted
environment makes every turn a "tool call" with a fixed latency schedule, so later steps'
rollouts are in flight while the trainer updates, and episodes span weight updates.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.config import AsyncConfig, ConfigError, load_config
from agentrl_jax.envs.base import Environment, StepResult
from agentrl_jax.train.guidance.old_policy import OldPolicy, staleness_stats
from agentrl_jax.train.run import train

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=6", "rollout.max_sequence_length=96",
    "rollout.steps_per_dispatch=2",
    "data.prompts_per_step=2", "algorithm.group_size=4", "algorithm.entropy_coef=0.01",
    "environment.num_train_tasks=64", "environment.num_eval_tasks=2",
    "eval.num_tasks=2", "eval.samples_per_task=1", "sft.steps=0", "checkpoint.resume=false",
    "logging.sample_trajectories=0",
]
TURNS = 3


class ScriptedToolEnv(Environment):
    """Every turn ends in a tool call of scripted latency; the episode ends after TURNS turns.

    Latency: the first call of every episode takes ``slow`` seconds (much longer than a
    compiled update, so weight pushes land while episodes wait for it), later calls ``fast``
    (``slow`` again for tasks with an even first operand). The reward is the parity of the
    sampled text's length, so groups are informative.
    """

    def __init__(self, slow: float, fast: float):
        self.slow, self.fast, self.turn, self.even = slow, fast, 0, False

    async def reset(self, task):
        self.turn, self.even = 0, int(task["a"]) % 2 == 0
        return [{"role": "user", "content": task["question"]}]

    async def step(self, action_text: str) -> StepResult:
        self.turn += 1
        await asyncio.sleep(self.slow if self.turn == 1 or self.even else self.fast)
        if self.turn >= TURNS:
            return StepResult("", float(len(action_text) % 2), True, finish_reason="answer")
        return StepResult("<interpreter>ok</interpreter>", 0.0, False)


def _slow_tools(slow=1.0, fast=0.05):
    return lambda config, pool, verifier, tokenizer: (lambda: ScriptedToolEnv(slow, fast))


def _run(out: Path, *overrides: str, make_env=None) -> dict[int, dict]:
    config = load_config("demo", TINY + [f"output_dir={out}", *overrides])
    train(config, make_env=make_env)
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory):
    """Five async steps at max_staleness=1 under slow tools, per old-logprob mode."""
    runs = {}
    for mode, extra in (("snapshot", []), ("recompute", ["algorithm.correction=tis"])):
        out = tmp_path_factory.mktemp(mode)
        # 160 tokens: a ~50-token prompt, three 6-token turns and two 29-token observations fit with
        # room (at 96 every episode ran out of context; at 128 an episode whose turns ran their full
        # budget sometimes did)
        runs[mode] = _run(out, "total_steps=5", "rollout.max_sequence_length=160",
                          "async_rl.enabled=true", "async_rl.max_staleness=1",
                          f"async_rl.old_logprobs={mode}", "optimizer.learning_rate=0.02", *extra,
                          make_env=_slow_tools())
    return runs


def test_staleness_bound_holds_and_rollouts_overlap_training(async_runs):
    for mode, steps in async_runs.items():
        assert sorted(steps) == [1, 2, 3, 4, 5], mode
        for step, m in steps.items():
            assert m["async/trajectory_staleness_max"] <= 1, (mode, step)
            assert m["async/staleness_violations"] == 0
            # admission, not discarding: every step trains its full batch
            assert m["rollout/trajectories"] == 8
            assert m["rollout/finish/answer"] == 1.0 and m["rollout/masked_episodes"] == 0
            assert 0 < m["rollout/engine/slot_occupancy"] <= 1 and m["rollout/engine/kept_tokens"] > 0
            assert m["skipped"] == 0 and np.isfinite(m["loss"])
        # the pipeline really overlapped: some trained tokens came from the previous version,
        # and some episodes continued across a weight update (partial rollouts)
        assert max(m["async/stale_token_fraction"] for m in steps.values()) > 0, mode
        assert max(m["async/mixed_version_fraction"] for m in steps.values()) > 0, mode


def test_snapshot_old_logprobs_are_exact_for_stale_tokens(async_runs):
    """Snapshot old logprobs of trajectories sampled by an older version equal the engine's
    (the sampling policy's) logprobs; recomputing with the current params does not."""
    snap = [m["old_policy/gap_stale_rows"] for m in async_runs["snapshot"].values() if "old_policy/gap_stale_rows" in m]
    assert snap, "no stale single-version trajectory in the snapshot run"
    assert max(snap) < 1e-4, snap
    recomputed = [m["old_policy/gap_stale_rows"] for m in async_runs["recompute"].values()
                  if "old_policy/gap_stale_rows" in m]
    assert recomputed and max(recomputed) > 1e-3, recomputed


def test_staleness_zero_gives_the_synchronous_updates(tmp_path):
    common = ["total_steps=3", "optimizer.learning_rate=0.02"]
    # the synchronous run also keeps its optimizer state in host memory during rollouts
    sync = _run(tmp_path / "sync", *common, "async_rl.offload_optimizer=true")
    pipelined = _run(tmp_path / "async", *common, "async_rl.enabled=true", "async_rl.max_staleness=0")
    assert sorted(sync) == sorted(pipelined) == [1, 2, 3]
    for step in sync:
        assert pipelined[step]["async/token_staleness_max"] == 0
        for key in ("reward/mean", "rollout/sampled_tokens", "loss", "grad_norm", "param_norm", "entropy"):
            assert pipelined[step][key] == pytest.approx(sync[step][key], rel=1e-6, abs=1e-7), (step, key)


def test_disaggregated_placement_trains_like_colocated(tmp_path):
    """The engine on 2 devices and the trainer on the other 6 (weights pushed across by
    device_put): at staleness 0 the same trajectories and, up to reduction order on the
    smaller training mesh, the same updates as the synchronous colocated run."""
    common = ["total_steps=2", "optimizer.learning_rate=0.02", "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]
    sync = _run(tmp_path / "sync", *common)
    split = _run(tmp_path / "split", *common, "async_rl.enabled=true", "async_rl.max_staleness=0",
                 "async_rl.placement=disaggregated", "async_rl.rollout_devices=2")
    for step in sync:
        assert split[step]["reward/mean"] == sync[step]["reward/mean"]
        assert split[step]["rollout/sampled_tokens"] == sync[step]["rollout/sampled_tokens"]
        for key in ("loss", "grad_norm", "param_norm"):
            assert split[step][key] == pytest.approx(sync[step][key], rel=1e-4, abs=1e-6), (step, key)


# ---------------------------------------------------------------- units


def test_snapshot_logprobs_pick_each_tokens_version():
    """Per-token selection across versions, against forwards of each version on the whole batch."""
    policy = OldPolicy(AsyncConfig(enabled=True, old_logprobs="snapshot"), max_staleness=2)
    params = {1: jnp.asarray(1.0), 2: jnp.asarray(2.0), 3: jnp.asarray(3.0)}
    policy.on_version(1, params[1])
    policy.on_version(2, params[2])
    calls = []

    def logprob_fn(p, inputs, micro_rows):
        rows = inputs["input_ids"].shape[0]
        assert rows % micro_rows == 0
        calls.append(rows)
        return np.asarray(p) * 10 + inputs["input_ids"].astype(np.float32)

    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    versions = np.array([[-1, 1, 1, 1], [-1, 2, 3, 3], [-1, 3, 3, -1]], np.int32)
    mask = (versions >= 0).astype(np.float32)
    old = policy.logprobs(logprob_fn, params[3], 3, {"input_ids": ids}, versions, mask, micro_rows=2)
    expected = np.where(versions == 1, 10, np.where(versions == 2, 20, 30)) + ids
    np.testing.assert_array_equal(old[mask > 0], expected[mask > 0])
    assert calls == [2, 2, 2]  # one forward per version, over its rows padded to micro_rows
    policy.on_version(4, params[3])  # version 1 is now older than max_staleness allows
    assert sorted(policy.snapshots) == [2, 4]
    with pytest.raises(RuntimeError, match="no snapshot of it"):
        policy.logprobs(logprob_fn, params[3], 5, {"input_ids": ids}, versions, mask, micro_rows=2)


def test_snapshots_own_their_buffers():
    policy = OldPolicy(AsyncConfig(enabled=True, old_logprobs="snapshot"), max_staleness=1)
    x = jnp.ones((4,))
    policy.on_version(0, {"w": x})
    x.delete()  # what the donating update step does to the trainer's buffers
    np.testing.assert_array_equal(policy.snapshots[0]["w"], np.ones(4))


def test_ewma_proximal_policy_mixes_and_resets():
    cfg = AsyncConfig(enabled=True, old_logprobs="ewma", ewma_decay=0.75, ewma_reset_every=3, ewma_min_kept=0.5)
    policy = OldPolicy(cfg, max_staleness=1)
    fn = lambda p, inputs, micro: np.full((1, 1), float(p["w"]), np.float32)  # noqa: E731
    one = lambda v: {"w": jnp.asarray(v, jnp.float32)}  # noqa: E731
    inputs, versions, mask = {"x": np.zeros((1, 1))}, np.zeros((1, 1), np.int32), np.ones((1, 1))
    start = one(1.0)
    assert policy.logprobs(fn, start, 0, inputs, versions, mask, 1)[0, 0] == 1.0  # starts at the params
    start["w"].delete()  # what the donating update step does to the trainer's buffers
    policy.after_update(one(5.0), step=0, kept_fraction=0.9)
    assert policy.logprobs(fn, one(5.0), 1, inputs, versions, mask, 1)[0, 0] == pytest.approx(0.75 * 1 + 0.25 * 5)
    m = policy.after_update(one(9.0), step=1, kept_fraction=0.1)  # correction kept too little: reset
    assert m["old_policy/ewma_reset"] == 1.0 and float(policy.ewma_params["w"]) == 9.0
    m = policy.after_update(one(1.0), step=2, kept_fraction=None)  # step 3 % 3 == 0: periodic reset
    assert m["old_policy/ewma_reset"] == 1.0 and float(policy.ewma_params["w"]) == 1.0


def test_staleness_stats():
    versions = np.array([[-1, 3, 3, 4], [-1, 4, 4, -1], [-1, -1, -1, -1]], np.int32)
    mask = (versions >= 0).astype(np.float32)
    stats, tokens = staleness_stats(versions, mask, version=4, num_trajectories=2)
    assert sorted(tokens.tolist()) == [0, 0, 0, 1, 1]
    assert stats["async/trajectory_staleness_max"] == 1 and stats["async/mixed_version_fraction"] == 0.5
    assert stats["async/token_staleness_1"] == pytest.approx(0.4)


@pytest.mark.parametrize("overrides, message", [
    (["async_rl.enabled=true", "async_rl.max_staleness=2"], "algorithm.correction"),
    (["async_rl.placement=disaggregated"], "needs async_rl.enabled=true"),
    (["async_rl.enabled=true", "async_rl.offload_optimizer=true", "async_rl.old_logprobs=snapshot"],
     "synchronous runs only"),
    (["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.judge=policy"], "hybrid.judge"),
    (["async_rl.max_staleness=-1"], "async_rl.max_staleness: must be >= 0"),
    (["async_rl.rollout_devices=-2"], "async_rl.rollout_devices: must be >= 0"),
    (["async_rl.ewma_decay=1.0"], r"async_rl.ewma_decay: must be in \[0, 1\)"),
    (["async_rl.ewma_reset_every=-1"], "async_rl.ewma_reset_every: must be >= 0"),
    (["async_rl.ewma_min_kept=1.5"], r"async_rl.ewma_min_kept: must be in \[0, 1\]"),
    (["async_rl.old_logprobs=exact"], "async_rl.old_logprobs: got 'exact'; allowed values are"),
    (["async_rl.placement=split"], "async_rl.placement: got 'split'"),
])
def test_config_refuses_unsound_combinations(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("demo", overrides)


def test_disaggregated_meshes_split_the_devices():
    from agentrl_jax.train.run import make_meshes

    config = load_config("demo", ["async_rl.enabled=true", "async_rl.placement=disaggregated",
                                  "async_rl.old_logprobs=snapshot", "async_rl.rollout_devices=2"])
    train_mesh, engine_mesh = make_meshes(config)
    assert engine_mesh.devices.size == 2 and train_mesh.devices.size == jax.device_count() - 2
    assert not set(engine_mesh.devices.flat) & set(train_mesh.devices.flat)
    every = load_config("demo", ["async_rl.enabled=true", "async_rl.placement=disaggregated",
                                 "async_rl.old_logprobs=snapshot", f"async_rl.rollout_devices={jax.device_count()}"])
    with pytest.raises(ConfigError, match="async_rl.rollout_devices: .* leaves none for one side"):
        make_meshes(every)


def test_optimizer_state_moves_to_host_memory_and_back():
    """async_rl.offload_optimizer (synchronous runs): the optimizer state leaves device memory
    during the rollout and comes back unchanged for the update."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from agentrl_jax.sharding import make_mesh
    from agentrl_jax.train.rl.stages import place_optimizer_state
    from agentrl_jax.train.step import init_train_state

    mesh = make_mesh({"fsdp": -1})
    params = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, PartitionSpec("fsdp")))}
    state = init_train_state(params, optax.adam(1e-3), 0)
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 1, state.opt_state))
    device_kind = jax.devices()[0].default_memory().kind
    offloaded = place_optimizer_state(state, "pinned_host")
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(offloaded.opt_state)}
    assert kinds == {"pinned_host"}
    assert offloaded.params["w"].sharding.memory_kind == device_kind  # params stay
    back = place_optimizer_state(offloaded, None)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(back.opt_state)} == {device_kind}
    for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, b)
        assert a.sharding.spec == b.sharding.spec
