"""LoRA adapters (models/lora.py): the merged weights and the in-layer projection against NumPy,
the in-layer forward equals the merged one, fresh adapters change nothing, the PEFT export loads
in peft + transformers with our logits, the merged HF export too."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from agentrl_jax.config import LoraConfig
from agentrl_jax.models import load_hf_checkpoint, save_hf_checkpoint, split_params
from agentrl_jax.models.layers import LowRank, project
from agentrl_jax.models.lora import (
    TARGETS,
    LoraParams,
    adapters_off,
    attach,
    decoder_inputs,
    init_adapters,
    merged_params,
)
from agentrl_jax.models.lora_export import save_peft_adapter

IDS = np.random.default_rng(0).integers(0, 97, (2, 12))


def _trained_lora(model, lora, seed=1):
    """LoraParams on ``model`` with a nonzero ``b`` (as after training), so the merge matters."""
    graphdef, base = split_params(model)
    params = attach(base, model.config, lora, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    adapters = {name: {"a": ab["a"], "b": jnp.asarray(0.3 * rng.standard_normal(ab["b"].shape), jnp.float32)}
                for name, ab in params.adapters.items()}
    return graphdef, params.replace(adapters=adapters)


def _logits(graphdef, params, ids=IDS):
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    hidden = model(jnp.asarray(ids, jnp.int32), positions)
    return np.asarray(model.logits(hidden))


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoints):
    return tiny_checkpoints["qwen3"], load_hf_checkpoint(tiny_checkpoints["qwen3"])


def test_merged_weights_equal_a_numpy_merge_and_fresh_adapters_change_nothing(qwen3):
    _, model = qwen3
    lora = LoraConfig(rank=4, alpha=8.0)
    graphdef, params = _trained_lora(model, lora)
    merged = merged_params(params)
    for target in lora.targets:
        name = TARGETS[target][0]
        w = np.asarray(params.base["layers"][name][...], np.float64)
        a, b = (np.asarray(params.adapters[name][k], np.float64) for k in "ab")
        flat = a.reshape(a.shape[0], -1, a.shape[-1]) @ b.reshape(b.shape[0], b.shape[1], -1)
        expected = w + 2.0 * flat.reshape(w.shape)
        np.testing.assert_allclose(np.asarray(merged["layers"][name][...]), expected, rtol=1e-5, atol=1e-6)
    in_bf16 = merged_params(params.replace(dtype=jnp.dtype(jnp.bfloat16)))  # a bfloat16 run's merged copy
    for target in lora.targets:
        name = TARGETS[target][0]
        np.testing.assert_array_equal(np.asarray(in_bf16["layers"][name][...]),
                                      np.asarray(merged["layers"][name][...].astype(jnp.bfloat16)))
    assert not np.allclose(_logits(graphdef, merged), _logits(graphdef, params.base), atol=1e-3)
    fresh = attach(params.base, model.config, lora, jax.random.key(0))
    np.testing.assert_array_equal(_logits(graphdef, merged_params(fresh)), _logits(graphdef, params.base))
    assert adapters_off(params) is params.base


@pytest.mark.parametrize("equation,x_shape,w_shape,k", [
    ("btd,dhk->bthk", (2, 5, 6), (6, 3, 4), 1),  # q/k/v
    ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 6), 2),  # o
    ("btf,fd->btd", (2, 5, 7), (7, 6), 1),  # MLP
])
def test_project_adds_the_low_rank_update_like_numpy(equation, x_shape, w_shape, k):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    a, b = rng.standard_normal((*w_shape[:k], 3)), rng.standard_normal((3, *w_shape[k:]))
    x2, w2 = x.reshape(10, -1), w.reshape(int(np.prod(w_shape[:k])), -1)
    expected = (x2 @ w2 + 0.5 * (x2 @ a.reshape(w2.shape[0], 3)) @ b.reshape(3, -1)).reshape(
        *x_shape[:2], *w_shape[k:])
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    ours = jax.jit(project, static_argnums=0)(equation, f32(x), f32(w), LowRank(f32(a), f32(b), 0.5))
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(project(equation, f32(x), f32(w))),
                                  np.asarray(jnp.einsum(equation, f32(x), f32(w))))


def test_project_refuses_a_weight_whose_inputs_are_not_leading():
    x, w = jnp.ones((2, 5, 6)), jnp.ones((3, 4, 6))  # [H, K, D] read as a q projection
    with pytest.raises(ValueError, match="must contract the weight's leading dims"):
        project("btd,hkd->bthk", x, w, LowRank(jnp.ones((6, 2)), jnp.ones((2, 3, 4)), 1.0))


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("v", "o", "down")])
def test_in_layer_forward_equals_the_merged_forward(qwen3, targets):
    _, model = qwen3
    graphdef, params = _trained_lora(model, LoraConfig(rank=4, alpha=8.0, targets=targets))
    assert params.impl == "in_layer"
    state, keywords = decoder_inputs(params)
    assert state is params.base and keywords["adapter_scale"] == 2.0
    decoder = nnx.merge(graphdef, state)
    ids = jnp.asarray(IDS, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    hidden = decoder(ids, positions, **keywords)
    in_layer, merged = np.asarray(decoder.logits(hidden)), _logits(graphdef, merged_params(params))
    np.testing.assert_allclose(in_layer, merged, rtol=1e-5, atol=2e-5)
    assert not np.allclose(in_layer, _logits(graphdef, params.base), atol=1e-3)  # the adapters act
    state, keywords = decoder_inputs(params.replace(impl="merged"))
    assert keywords == {}
    np.testing.assert_array_equal(_logits(graphdef, state), merged)


def test_adapter_shapes_and_targets():
    from tiny_decoder import tiny_decoder

    graphdef, base = tiny_decoder()
    config = nnx.merge(graphdef, base).config
    adapters = init_adapters(config, LoraConfig(rank=3, targets=("o", "down")), jax.random.key(0))
    assert {k: (v["a"].shape, v["b"].shape) for k, v in adapters.items()} == {
        "wo": ((2, 4, 8, 3), (2, 3, 32)), "w_down": ((2, 64, 3), (2, 3, 32))}
    assert all(not np.any(np.asarray(v["b"])) for v in adapters.values())
    with pytest.raises(ValueError, match="rank must be > 0"):
        init_adapters(config, LoraConfig(rank=0), jax.random.key(0))
    with pytest.raises(ValueError, match="carry no base"):
        merged_params(LoraParams(base=None, adapters=adapters))


def test_adapters_are_placed_by_their_logical_axes():
    from tiny_decoder import tiny_decoder

    from agentrl_jax.sharding import make_mesh

    graphdef, base = tiny_decoder()
    mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    adapters = init_adapters(nnx.merge(graphdef, base).config, LoraConfig(rank=2), jax.random.key(0), mesh=mesh)
    assert tuple(adapters["wq"]["a"].sharding.spec) == (None, "fsdp", None)  # [L, D, r]: D over fsdp
    assert tuple(adapters["wq"]["b"].sharding.spec) == (None, None, "tensor", None)  # [L, r, H, K]: heads


def test_peft_export_loads_in_peft_with_our_logits_and_the_merged_export_in_transformers(qwen3, tmp_path):
    peft = pytest.importorskip("peft")
    path, model = qwen3
    lora = LoraConfig(rank=4, alpha=8.0)
    graphdef, params = _trained_lora(model, lora)
    ours = _logits(graphdef, merged_params(params))
    adapter_dir = save_peft_adapter(params, model.config, tmp_path / "adapter", base_model=str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 7
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(IDS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4)
    merged_dir = save_hf_checkpoint(merged_params(params), model.config, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(IDS)).logits.numpy(), ours, atol=2e-4)


@pytest.mark.parametrize("override,message", [
    ("model.lora.rank=-1", "model.lora.rank: must be >= 0 (0: off), got -1"),
    ("model.lora.alpha=0", "model.lora.alpha: must be > 0, got 0.0"),
    ('model.lora.targets=["q","qkv"]', "model.lora.targets[1]: got 'qkv'; allowed values are"),
    ('model.lora.targets=["q","q"]', "model.lora.targets: names a projection twice: ['q', 'q']"),
    ("model.lora.targets=[]", "model.lora.targets: must name at least one projection"),
    ("model.lora.impl=fused", "model.lora.impl: got 'fused'; allowed values are"),
])
def test_lora_config_errors_name_the_field(override, message):
    from agentrl_jax.config import Config, ConfigError, apply_overrides

    with pytest.raises(ConfigError) as error:
        apply_overrides(Config(), ["model.lora.rank=4", override])
    assert message in str(error.value) and "\n" not in str(error.value)
