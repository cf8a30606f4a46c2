"""The critic: its value model, its forward and update in micro-batches and packed rows, its
checkpoint, and a toy problem whose returns it must learn."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_decoder import tiny_decoder

from agentrl_jax.config import Config, apply_overrides
from agentrl_jax.losses import global_normalizer
from agentrl_jax.models.value_head import value_model_from_policy
from agentrl_jax.train.batch import TokenRecord, build_batch
from agentrl_jax.train.critic import Critic, critic_targets, forward_values
from agentrl_jax.train.packing import plan_minibatch
from agentrl_jax.train.step import LossSettings

FORWARD = ("input_ids", "positions", "segment_ids", "targets")


def _config(*overrides):
    return apply_overrides(Config(), ["algorithm.advantage=gae", "algorithm.group_size=1", "total_steps=100",
                                      *overrides])


def _critic(settings=LossSettings(), *overrides):
    graphdef, params = tiny_decoder()
    critic_graphdef, critic_params = value_model_from_policy(graphdef, params)
    return Critic(_config(*overrides), critic_graphdef, critic_params, settings)


def _batch(n=8, seed=0):
    """Rows of [prompt | turn | observation | turn | padding] with random returns and old values."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(n):
        turn, obs = int(rng.integers(2, 6)), int(rng.integers(1, 4))
        mask = [0, 0, 0] + [1] * turn + [0] * obs + [1] * int(rng.integers(1, 5))
        records.append(TokenRecord(rng.integers(1, 64, len(mask)).tolist(), mask, [0.0] * len(mask),
                                   [0] * len(mask)))
    batch = build_batch(records, row_length=24)
    arrays = {k: np.asarray(getattr(batch, k)) for k in (*FORWARD, "loss_mask", "advantages", "sequence_ids",
                                                         "rollout_logprobs")}
    arrays["value_mask"] = arrays["loss_mask"]
    arrays["returns"] = (rng.normal(size=arrays["loss_mask"].shape) * arrays["loss_mask"]).astype(np.float32)
    arrays["old_values"] = (rng.normal(0, 0.1, size=arrays["loss_mask"].shape) * arrays["loss_mask"]).astype(
        np.float32)
    return batch, arrays


def test_the_value_model_drops_the_lm_head_and_keeps_the_trunk():
    graphdef, params = tiny_decoder()
    _, critic = value_model_from_policy(graphdef, params)
    assert set(critic) == {"trunk", "value_head", "value_bias"} and "lm_head" not in critic["trunk"]
    np.testing.assert_array_equal(critic["trunk"]["embed"][...], params["embed"][...])
    assert critic["trunk"]["embed"][...] is not params["embed"][...]  # its own buffers (the policy's are donated)


def test_values_in_micro_batches_and_packed_rows_equal_one_forward():
    critic = _critic()
    _, arrays = _batch()
    inputs = {k: arrays[k] for k in FORWARD}
    whole = forward_values(critic.graphdef, critic.state.params, {k: jnp.asarray(v) for k, v in inputs.items()})
    micro = critic.values(critic.graphdef, critic.state.params, inputs, 2)
    np.testing.assert_allclose(np.asarray(micro), np.asarray(whole), atol=1e-6)
    packed = _critic(LossSettings(packed=True), "algorithm.pack_rows=true", "algorithm.pack_row_tokens=48",
                     "algorithm.micro_batch_tokens=48")
    got = np.asarray(packed.values(packed.graphdef, packed.state.params, inputs, 0))
    real = arrays["segment_ids"] > 0
    np.testing.assert_allclose(got[real], np.asarray(whole)[real], atol=1e-5)
    assert np.all(got[~real] == 0)


def _update(critic, arrays, rows, num_micro_batches):
    normalizer = global_normalizer(jnp.asarray(arrays["value_mask"][rows]), "token-mean")
    device = {k: jnp.asarray(v) for k, v in arrays.items()}
    return critic.update(critic.state, device, jnp.asarray(rows, jnp.int32), normalizer, num_micro_batches, False)


def _update_packed(critic, arrays, rows, row_tokens):
    plan = plan_minibatch(arrays["segment_ids"], rows, row_tokens=row_tokens, micro_batch_tokens=row_tokens)
    normalizer = global_normalizer(jnp.asarray(arrays["value_mask"][rows]), "token-mean")
    device = {k: jnp.asarray(v) for k, v in arrays.items()}
    return critic.update(critic.state, device, jnp.asarray(plan.gather_index(), jnp.int32),
                         jnp.asarray(plan.segment_ids()), normalizer, plan.num_micro_batches, False,
                         len(arrays["input_ids"]), plan.segment_bound)


def _assert_same_update(got, want):
    (state, metrics), (want_state, want_metrics) = got, want
    for key in ("loss", "grad_norm", "update_norm"):
        np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-4, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), state.params,
                 want_state.params)


ROWS = np.array([6, 1, 3, 4, 0, 7], np.int32)


def test_the_update_in_micro_batches_equals_the_full_minibatch():
    _, arrays = _batch()
    full = _update(_critic(), arrays, ROWS, 1)
    assert float(full[1]["loss"]) > 0 and float(full[1]["grad_norm"]) > 0 and 0 < float(full[1]["value_clip_frac"]) < 1
    _assert_same_update(_update(_critic(), arrays, ROWS, 3), full)


@pytest.mark.slow  # two more compilations of the update, ~30 s on 2 shared cores
def test_the_update_on_packed_rows_equals_padded_rows():
    _, arrays = _batch()
    packed = _critic(LossSettings(packed=True, max_segments=8), "algorithm.pack_rows=true")
    _assert_same_update(_update_packed(packed, arrays, ROWS, 48), _update(_critic(), arrays, ROWS, 1))


def test_the_critic_learns_a_known_return():
    """Rows whose first agent token is 5 return 1, those with 9 return 0 (GAE with gamma = lam
    = 1 makes every token's return the outcome): after training on the targets the critic
    computes, its values explain the returns."""
    config = _config("critic.learning_rate=1e-2", "critic.value_clip=0", "critic.whiten_advantages=false")
    graphdef, params = tiny_decoder()
    critic = Critic(config, *value_model_from_policy(graphdef, params), LossSettings())
    rng = np.random.default_rng(0)
    records, rewards = [], []
    for i in range(16):
        marker = 5 if i % 2 == 0 else 9
        tokens = [1, 2, marker] + rng.integers(10, 64, 7).tolist()
        records.append(TokenRecord(tokens, [0, 0] + [1] * 4 + [0, 0] + [1, 1], [0.0] * 10, [0] * 10))
        rewards.append(float(marker == 5))
    batch = build_batch(records, row_length=16)
    inputs = {k: np.asarray(getattr(batch, k)) for k in FORWARD}
    outcomes = (np.asarray(rewards, np.float32), np.arange(16, dtype=np.int32), np.ones(16, bool))
    for step in range(25):
        _, targets, metrics = critic_targets(config, critic, batch, inputs, *outcomes, 16)
        if step == 0:
            assert metrics["critic/explained_variance"] < 0.1
        arrays = {**inputs, **targets}
        critic.state, _ = _update(critic, arrays, np.arange(16), 1)
    _, targets, metrics = critic_targets(config, critic, batch, inputs, *outcomes, 16)
    values = targets["old_values"].sum(axis=1)[:16] / 6
    assert metrics["critic/explained_variance"] > 0.75, metrics
    assert values[0::2].min() > values[1::2].max()  # every row with a return of 1 valued above every 0
    np.testing.assert_allclose(targets["returns"][targets["value_mask"] > 0],
                               np.repeat(outcomes[0], 6), atol=1e-6)  # gamma = lam = 1: R_t = outcome


def test_critic_targets_whiten_the_advantages_and_regress_on_the_raw_returns():
    config = _config("critic.lam=0.9")
    critic = _critic()
    batch, arrays = _batch()
    inputs = {k: arrays[k] for k in FORWARD}
    rewards = np.linspace(0, 1, 8).astype(np.float32)
    advantages, targets, metrics = critic_targets(config, critic, batch, inputs, rewards, np.arange(8),
                                                  np.ones(8, bool), 4)
    mask = batch.loss_mask > 0
    assert abs(advantages[mask].mean()) < 1e-5 and advantages[mask].std() == pytest.approx(1.0, rel=1e-3)
    assert np.all(advantages[~mask] == 0)
    raw = targets["returns"] - targets["old_values"]
    assert metrics["critic/advantage_std"] == pytest.approx(raw[mask].std(), rel=1e-4)
    assert metrics["critic/value_std"] > 0


def test_the_checkpoint_restores_params_and_optimizer_state(tmp_path):
    from agentrl_jax.train.checkpoint import Checkpointer

    _, arrays = _batch()
    critic = _critic()
    critic.state, _ = _update(critic, arrays, np.arange(8), 1)
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        checkpointer.save(1, {"params": {}}, trees=critic.checkpoint_trees(), force=True)
    saved = jax.tree.map(np.asarray, critic.state)
    fresh = _critic()
    with Checkpointer(tmp_path / "checkpoints") as checkpointer:
        fresh.restore(checkpointer, 1)
    assert int(fresh.state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, fresh.state), saved)
