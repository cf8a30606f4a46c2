"""LoRA in the trainer: gradients and optimizer state only for the adapters (both forms checked
against the chain rule through the merged weights), the in-layer update forms no weight-sized
tensor, the base neither donated nor changed, the reference is the base itself, checkpoints hold
the adapters only and resume exactly."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from test_step import _batch
from tiny_decoder import tiny_decoder

from agentrl_jax.config import Config, ConfigError, LoraConfig, apply_overrides
from agentrl_jax.losses import global_normalizer
from agentrl_jax.models.lora import attach, merged_params, without_base
from agentrl_jax.train import lora
from agentrl_jax.train.build import build_roles
from agentrl_jax.train.checkpoint import Checkpointer
from agentrl_jax.train.rl.stages import save
from agentrl_jax.train.step import LossSettings, forward_logprobs, init_train_state, make_update_fn, policy_loss

SETTINGS = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)), entropy_coef=0.01)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q", "o", "up", "down"))
SCALE = 2.0  # alpha / rank


def _config(graphdef, base):
    return nnx.merge(graphdef, base).config


@pytest.fixture(scope="module")
def policy():
    graphdef, base = tiny_decoder()
    params = attach(base, _config(graphdef, base), LORA, jax.random.key(1))
    rng = np.random.default_rng(0)  # a nonzero b, as after some training, so both gradients are nonzero
    adapters = {k: {"a": v["a"], "b": jnp.asarray(0.05 * rng.standard_normal(v["b"].shape), jnp.float32)}
                for k, v in params.adapters.items()}
    return graphdef, base, params.replace(adapters=adapters)


def _minibatch(graphdef, params):
    batch = _batch()
    logp = forward_logprobs(graphdef, params, batch, temperature=1.0)
    batch["old_logprobs"] = jax.lax.stop_gradient(logp) - 0.05 * batch["loss_mask"]
    return batch, global_normalizer(batch["loss_mask"], "token-mean", max_response_length=24)


@pytest.mark.parametrize("impl", ["in_layer", "merged"])
def test_adapter_gradients_are_the_chain_rule_through_the_merged_weights(policy, impl):
    graphdef, _, params = policy
    params = params.replace(impl=impl)
    batch, z = _minibatch(graphdef, params)
    loss = lambda p: policy_loss(p, graphdef, batch, z, SETTINGS, None)[0]  # noqa: E731
    grads = jax.grad(lambda adapters: loss(params.replace(adapters=adapters)))(params.adapters)
    weight_grads = jax.grad(loss)(merged_params(params))["layers"]
    for name, ab in params.adapters.items():
        a = np.asarray(ab["a"], np.float64).reshape(2, -1, 4)  # [L, in, r]
        b = np.asarray(ab["b"], np.float64).reshape(2, 4, -1)  # [L, r, out]
        g = np.asarray(weight_grads[name][...], np.float64).reshape(2, a.shape[1], b.shape[2])  # dLoss/dW
        np.testing.assert_allclose(np.asarray(grads[name]["a"]).reshape(a.shape), SCALE * g @ b.transpose(0, 2, 1),
                                   rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grads[name]["b"]).reshape(b.shape), SCALE * a.transpose(0, 2, 1) @ g,
                                   rtol=1e-4, atol=1e-7)
        assert np.abs(np.asarray(grads[name]["a"])).max() > 0 and np.abs(np.asarray(grads[name]["b"])).max() > 0


def _output_shapes(jaxpr, found):
    """Shapes of every value a jaxpr computes, inside scans, remats and nested jits too."""
    for eqn in jaxpr.eqns:
        found.update(tuple(v.aval.shape) for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _output_shapes(sub, found)
    return found


def _loss_of_adapters(params, graphdef, batch, z, adapters):
    return policy_loss(params.replace(adapters=adapters), graphdef, batch, z, SETTINGS, None)[0]


def test_the_in_layer_gradient_forms_no_merged_weight_and_no_weight_gradient(policy):
    """The merged form computes ``[L, *in, *out]`` tensors for every targeted weight (the merged
    copy and its gradient); the in-layer form none, nor the per-layer ``[*in, *out]`` ones."""
    graphdef, base, params = policy
    batch, z = _minibatch(graphdef, params)
    weights = {name: tuple(base["layers"][name][...].shape) for name in params.adapters}
    found = {}
    for impl in ("in_layer", "merged"):
        form = params.replace(impl=impl)
        loss = functools.partial(_loss_of_adapters, form, graphdef, batch, z)
        found[impl] = _output_shapes(jax.make_jaxpr(jax.grad(loss))(form.adapters).jaxpr, set())
    assert all(shape in found["merged"] for shape in weights.values())
    assert not any(shape in found["in_layer"] for shape in weights.values())
    # [64, 32] is also the tied embedding's shape; the attention weights' are the model's alone.
    assert not any(weights[name][1:] in found["in_layer"] for name in ("wq", "wo"))


def test_update_trains_the_adapters_only_and_keeps_the_base_undonated(policy):
    graphdef, base, params = policy
    batch, z = _minibatch(graphdef, params)
    opt = optax.adamw(1e-2)
    state = init_train_state(params, opt, 0)
    adapter_elements = sum(x.size for x in jax.tree.leaves(params.adapters))
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * adapter_elements + 1  # mu, nu, count
    update = make_update_fn(graphdef, opt, SETTINGS)
    before = jax.tree.map(np.asarray, params.adapters)
    new_state, metrics = update(state, batch, jnp.arange(8), z, 1, False)
    assert float(metrics["skipped"]) == 0 and float(metrics["grad_norm"]) > 0
    assert new_state.params.base is base and not any(x.is_deleted() for x in jax.tree.leaves(base))
    for name in before:
        assert not np.allclose(np.asarray(new_state.params.adapters[name]["b"]), before[name]["b"])
    assert new_state.params.scale == params.scale


def test_the_reference_is_the_base_itself_and_gives_the_base_logprobs(policy):
    graphdef, base, params = policy
    config = apply_overrides(Config(), ["algorithm.kl_coef=0.1", "model.lora.rank=4", "hybrid.mode=hybrid",
                                        "hybrid.teacher=reference", "hybrid.judge=reference"])
    roles = build_roles(config, graphdef, base, None, tokenizer=None, driver=None, start_step=0,
                        policy_params=params)
    assert roles.reference is base and roles.teacher.params is base and roles.judge.params is base
    batch, _ = _minibatch(graphdef, params)
    _, plain = tiny_decoder()  # the same model built again: adapters off must give exactly its logprobs
    np.testing.assert_array_equal(np.asarray(forward_logprobs(graphdef, roles.reference, batch, temperature=1.0)),
                                  np.asarray(forward_logprobs(graphdef, plain, batch, temperature=1.0)))


def test_checkpoint_holds_the_adapters_only_and_resume_is_exact(policy, tmp_path):
    graphdef, base, params = policy
    batch, z = _minibatch(graphdef, params)
    opt = optax.adamw(1e-2)
    update = make_update_fn(graphdef, opt, SETTINGS)
    step = lambda s: update(s, batch, jnp.arange(8), z, 1, False)[0]  # noqa: E731
    state = step(init_train_state(params, opt, 0))
    config = Config()
    with Checkpointer(tmp_path / "ckpt", async_save=False) as checkpointer:
        save(checkpointer, config, None, state, 1, 1, data_state={"position": 3})
    saved = jax.tree.leaves(ocp.StandardCheckpointer().metadata(tmp_path / "ckpt" / "1" / "state").item_metadata.tree)
    assert not any(".base." in leaf.name for leaf in saved)  # adapters, AdamW moments, count, step, rng
    assert sum(np.prod(leaf.shape) for leaf in saved) == sum(x.size for x in jax.tree.leaves(without_base(state)[1]))
    fresh = init_train_state(attach(base, _config(graphdef, base), LORA, jax.random.key(9)), opt, 5)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        restored = lora.restore_latest(checkpointer, fresh)
    assert restored.state.params.base is base and restored.data_state == {"position": 3}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.state),
                 jax.tree.map(np.asarray, state))
    continued, uninterrupted = step(restored.state), step(state)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, continued.params.adapters),
                 jax.tree.map(np.asarray, uninterrupted.params.adapters))
    other = jax.tree.map(lambda x: x * 1.01, base)
    with Checkpointer(tmp_path / "ckpt") as checkpointer, pytest.raises(ConfigError, match="another base model"):
        lora.restore_latest(checkpointer, init_train_state(fresh.params.replace(base=other), opt, 5))
