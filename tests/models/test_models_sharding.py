"""The same forward on (2, 4) and (1, 8) fake-device meshes equals the single-device result."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from agentrl_jax.models import apply, param_shardings, split_params
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models.tiny import save_tiny_hf_checkpoint
from agentrl_jax.sharding import (
    DEFAULT_RULES,
    inference_rules,
    logical_sharding,
    make_mesh,
    reshard,
)

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

MESHES = [{"fsdp": 2, "tensor": 4}, {"tensor": 8}, {"fsdp": 8}]
B, T = 8, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Every sharded dim divides 8: D 64, F 128, V 128, H 8, KV 8 (kv 4 would be replicated).
    return save_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("shard") / "ckpt",
        "qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_heads=8,
        num_kv_heads=8,
        head_dim=8,
    )


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 128, (B, T)).astype(np.int32)
    segment_ids = np.ones((B, T), np.int32)
    segment_ids[:, 9:] = 2
    segment_ids[:, 14:] = 0
    positions = np.where(segment_ids == 2, np.arange(T) - 9, np.arange(T)).astype(np.int32)
    return ids, positions, segment_ids, (segment_ids > 0).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, ids, positions, segment_ids, mask):
    return apply(graphdef, params, ids, positions, segment_ids=segment_ids, attention_mask=mask)


@pytest.fixture(scope="module")
def reference(checkpoint):
    graphdef, params = split_params(load_hf_checkpoint(checkpoint))
    return np.asarray(_forward(graphdef, params, *map(jnp.asarray, _batch())))


@pytest.mark.parametrize("shape", MESHES, ids=str)
def test_sharded_forward_equals_single_device(checkpoint, reference, shape):
    mesh = make_mesh(shape)
    model = load_hf_checkpoint(checkpoint, mesh=mesh)
    graphdef, params = split_params(model)
    wq = params["layers"]["wq"][...]
    assert wq.sharding.spec == logical_sharding(("layers", "embed", "heads", "head_dim"), mesh).spec
    assert not wq.sharding.is_fully_replicated
    batch_sharding = logical_sharding(("batch", "sequence"), mesh, DEFAULT_RULES)
    inputs = [jax.device_put(x, batch_sharding) for x in _batch()]
    hidden = _forward(graphdef, params, *inputs)
    np.testing.assert_allclose(np.asarray(hidden), reference, atol=1e-5, rtol=0)


def test_param_shardings_reshard_train_to_inference_layout(checkpoint, reference):
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    graphdef, params = split_params(load_hf_checkpoint(checkpoint, mesh=mesh))
    infer = reshard(params, param_shardings(params, mesh, inference_rules(DEFAULT_RULES)))
    assert infer["layers"]["wq"][...].sharding.spec == PartitionSpec(None, None, "tensor", None)
    assert params["layers"]["wq"][...].sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    hidden = _forward(graphdef, infer, *map(jnp.asarray, _batch()))
    np.testing.assert_allclose(np.asarray(hidden), reference, atol=1e-5, rtol=0)


def test_activation_constraints_under_set_mesh(checkpoint, reference):
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    graphdef, params = split_params(load_hf_checkpoint(checkpoint, mesh=mesh))
    with jax.set_mesh(mesh):
        lowered = _forward.lower(graphdef, params, *map(jnp.asarray, _batch()))
        hidden = lowered.compile()(params, *map(jnp.asarray, _batch()))
    assert "sharding_constraint" in lowered.as_text()
    assert hidden.sharding.spec[0] == "fsdp"  # batch stays on the data axes
    np.testing.assert_allclose(np.asarray(hidden), reference, atol=1e-5, rtol=0)
