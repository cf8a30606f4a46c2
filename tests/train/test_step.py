"""The jitted update: micro-batch accumulation is exact, non-finite updates are skipped."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_decoder import tiny_decoder

from agentrl_jax.config import OptimizerConfig
from agentrl_jax.losses import global_normalizer
from agentrl_jax.train.batch import TokenRecord, build_batch
from agentrl_jax.train.step import (
    LossSettings,
    forward_logprobs,
    init_train_state,
    update_step,
)

_tiny = tiny_decoder


def _batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        L = int(rng.integers(6, 20))
        mask = (np.arange(L) >= 3).astype(int)
        recs.append(TokenRecord(rng.integers(1, 64, L).tolist(), mask.tolist(), [0.0] * L, [0] * L,
                                (mask * rng.normal()).tolist()))
    b = build_batch(recs, row_length=24)
    arrays = {k: jnp.asarray(getattr(b, k)) for k in
              ("input_ids", "positions", "segment_ids", "targets", "loss_mask", "advantages", "sequence_ids",
               "rollout_logprobs")}
    return arrays


# Micro-batching in every aggregation mode is checked at the loss level in
# tests/losses/test_losses_aggregation.py; through the whole update the sequence-sum modes run with -m slow.
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         pytest.param("seq-mean-token-sum", marks=pytest.mark.slow),
                                         pytest.param("seq-mean-token-sum-norm", marks=pytest.mark.slow)])
def test_micro_batched_update_equals_full_batch(aggregation):
    graphdef, params = _tiny()
    batch = _batch()
    settings = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)), aggregation=aggregation,
                            entropy_coef=0.01)
    logp = forward_logprobs(graphdef, params, batch, temperature=1.0)
    batch["old_logprobs"] = jax.lax.stop_gradient(logp) - 0.05 * batch["loss_mask"]
    z = global_normalizer(batch["loss_mask"], aggregation, max_response_length=24)
    opt = optax.sgd(1.0)
    results = []
    for n_micro in (1, 4):
        state = init_train_state(params, opt, 0)
        step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=opt, settings=settings,
                                         num_micro_batches=n_micro, num_sequences=None))
        new_state, metrics = step(state, batch, z)
        results.append((new_state, metrics))
    (s1, m1), (s4, m4) = results
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m4["grad_norm"]), rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), s1.params,
                 s4.params)
    assert float(m1["skipped"]) == 0 and int(s1.step) == 1


def test_non_finite_loss_skips_the_update():
    graphdef, params = _tiny()
    batch = _batch()
    batch["old_logprobs"] = jnp.zeros_like(batch["loss_mask"])
    batch["advantages"] = batch["advantages"].at[0, 5].set(jnp.nan) * 1.0
    batch["loss_mask"] = batch["loss_mask"].at[0, 5].set(1.0)
    opt = optax.adam(1e-2)
    state = init_train_state(params, opt, 0)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=opt, settings=LossSettings(),
                                     num_micro_batches=2, num_sequences=None))
    new_state, metrics = step(state, batch, jnp.float32(batch["loss_mask"].sum()))
    assert float(metrics["skipped"]) == 1.0 and int(new_state.step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_state.params,
                 params)


def test_positive_advantage_raises_logprob():
    graphdef, params = _tiny()
    batch = _batch()
    batch["advantages"] = batch["loss_mask"] * 1.0
    logp0 = forward_logprobs(graphdef, params, batch, temperature=1.0)
    batch["old_logprobs"] = logp0
    from agentrl_jax.train.step import make_optimizer
    opt, _ = make_optimizer(OptimizerConfig(learning_rate=1e-2), 10)
    state = init_train_state(params, opt, 0)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=opt, settings=LossSettings(),
                                     num_micro_batches=1, num_sequences=None))
    state, metrics = step(state, batch, jnp.float32(batch["loss_mask"].sum()))
    logp1 = forward_logprobs(graphdef, state.params, batch, temperature=1.0)
    m = batch["loss_mask"]
    assert float((logp1 * m).sum()) > float((logp0 * m).sum())
    assert float(metrics["update_norm"]) > 0 and float(metrics["param_norm"]) > 0


def test_the_built_update_equals_update_step_on_the_minibatch_rows():
    """``make_update_fn`` (the RL loop's update, explicit shardings, state donated) on rows of the
    step's batch == ``update_step`` on those rows gathered on the host."""
    from jax.sharding import NamedSharding, PartitionSpec

    from agentrl_jax.sharding import make_mesh
    from agentrl_jax.train.step import make_update_fn

    graphdef, params = _tiny()
    batch = _batch()
    batch["old_logprobs"] = forward_logprobs(graphdef, params, batch, temperature=1.0) - 0.05 * batch["loss_mask"]
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = {k: jax.device_put(v, replicated) for k, v in batch.items()}
    rows = np.array([6, 1, 3, 4], np.int32)
    normalizer = jnp.float32(np.asarray(batch["loss_mask"])[rows].sum())
    settings = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)))
    opt = optax.adam(1e-2)
    state = jax.device_put(init_train_state(params, opt, 0), replicated)
    update = make_update_fn(graphdef, opt, settings, mesh=mesh,
                            state_sharding=jax.tree.map(lambda x: x.sharding, state))
    with jax.set_mesh(mesh):  # traced as the built update is (sharding.under_mesh): the same activation layout
        expected, expected_metrics = jax.jit(functools.partial(
            update_step, graphdef=graphdef, optimizer=opt, settings=settings, num_micro_batches=2,
            num_sequences=None))(state, {k: v[rows] for k, v in batch.items()}, normalizer)
    new_state, metrics = update(state, batch, jax.device_put(rows, replicated), normalizer, 2, False)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))  # donated
    np.testing.assert_allclose(float(metrics["loss"]), float(expected_metrics["loss"]), rtol=1e-6)
    assert float(metrics["grad_norm"]) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), new_state.params,
                 expected.params)
    assert all(x.sharding == replicated for x in jax.tree.leaves(new_state.params))


def test_the_built_logprob_fn_in_micro_batches_equals_one_forward():
    from agentrl_jax.train.step import make_logprob_fn

    graphdef, params = _tiny()
    batch = _batch()
    inputs = {k: np.asarray(batch[k]) for k in ("input_ids", "positions", "segment_ids", "targets")}
    logprobs = make_logprob_fn(LossSettings(temperature=0.7), put=jnp.asarray)
    whole = forward_logprobs(graphdef, params, batch, temperature=0.7)
    np.testing.assert_allclose(np.asarray(logprobs(graphdef, params, inputs, 2)), np.asarray(whole), atol=1e-6)


def test_the_fsdp_update_computes_each_devices_own_logits():
    """On a 2-device fsdp mesh the lm head runs on each device's own rows, against the whole
    table. Chunks of the flattened tokens compiled otherwise: the partitioner split the model
    width and all-reduced every chunk's [tokens, V] logits (2 x 15 ms of a 4B step on 2 GPUs)."""
    import re

    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from agentrl_jax.models import Decoder, DecoderConfig, param_shardings, split_params
    from agentrl_jax.sharding import make_mesh

    vocab = 96  # no other dimension of the model is 96
    cfg = DecoderConfig(architecture="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=True,
                        max_position_embeddings=128)
    graphdef, params = split_params(Decoder(cfg, rngs=nnx.Rngs(0)))
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, jax.devices()[:2])
    params = jax.device_put(params, param_shardings(params, mesh))
    batch = _batch(n=8)
    batch["old_logprobs"] = batch["rollout_logprobs"]
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    batch = {k: jax.device_put(v, rows) for k, v in batch.items()}
    tokens = batch["input_ids"].size
    opt = optax.adam(1e-2)
    state = init_train_state(params, opt, 0)
    settings = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)), chunk_size=tokens // 4)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=opt, settings=settings,
                                     num_micro_batches=1, num_sequences=None))
    with jax.set_mesh(mesh):
        hlo = step.lower(state, batch, jnp.float32(1.0)).compile().as_text()
    logits_reduced = re.findall(rf"= f32\[(\d+),{vocab}\]\S* all-reduce\(", hlo)
    assert not logits_reduced, f"logits all-reduced over the mesh: rows {logits_reduced}"
    lm_head_rows = [int(m) for m in re.findall(rf"= f32\[(\d+),{vocab}\]\S* dot\(", hlo)]
    assert lm_head_rows and max(lm_head_rows) <= tokens // 2 // 2, lm_head_rows  # a device's rows, in chunks
    table_gathers = re.findall(rf"f32\[{vocab},32\]\S* all-gather\(", hlo)
    assert len(table_gathers) == 1, f"the table is gathered {len(table_gathers)} times a step, not once"
