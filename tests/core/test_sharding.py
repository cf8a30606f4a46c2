"""Mesh construction and logical-axis rules on the 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from agentrl_jax import sharding
from agentrl_jax.config import ConfigError


def test_resolve_fill_and_errors():
    assert sharding.resolve_mesh_shape({"data": 2, "fsdp": -1}, 8) == {"data": 2, "fsdp": 4, "tensor": 1}
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sharding.resolve_mesh_shape({"data": -1, "fsdp": -1}, 8)
    with pytest.raises(ValueError, match="covers 4 devices but 8 are available"):
        sharding.resolve_mesh_shape({"data": 2, "tensor": 2}, 8)
    with pytest.raises(ValueError, match="unknown axes"):
        sharding.resolve_mesh_shape({"model": 2}, 8)
    with pytest.raises(ConfigError, match="not divisible"):  # a config mistake: one line at launch
        sharding.resolve_mesh_shape({"data": 3, "fsdp": -1}, 8)


@pytest.mark.parametrize("shape", [{"fsdp": 2, "tensor": 4}, {"tensor": 8}, {"data": 2, "fsdp": 2, "tensor": 2}])
def test_make_mesh_shapes(shape):
    mesh = sharding.make_mesh(shape)
    assert mesh.axis_names == sharding.MESH_AXES
    assert int(np.prod(list(mesh.shape.values()))) == jax.device_count()


def test_logical_to_spec_rules():
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
    spec = sharding.logical_to_spec(("embed", "heads", "head_dim"), mesh=mesh, shape=(64, 8, 16))
    assert spec == P("fsdp", "tensor", None)
    # kv_heads=2 cannot split 4 ways: replicated instead of failing.
    spec = sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), mesh=mesh, shape=(64, 2, 16))
    assert spec == P("fsdp", None, None)
    # A mesh axis is used once per array.
    spec = sharding.logical_to_spec(("vocab", "mlp"), mesh=mesh, shape=(128, 256))
    assert spec == P("tensor", None)
    with pytest.raises(ValueError, match="logical axis 'width' has no rule"):
        sharding.logical_to_spec(("width",))


def test_inference_rules_drop_fsdp_keep_batch():
    rules = dict(sharding.inference_rules())
    assert rules["embed"] is None and rules["heads"] == "tensor"
    assert rules["batch"] == ("data", "fsdp") and rules["slots"] == ("data", "fsdp")


def test_reshard_train_to_inference_preserves_values():
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
    axes = {"w": ("embed", "mlp"), "e": ("vocab", "embed")}
    x = {"w": jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32), "e": jnp.ones((128, 64))}
    train = sharding.tree_shardings(axes, mesh, shapes=x)
    infer = sharding.tree_shardings(axes, mesh, sharding.inference_rules(), shapes=x)
    placed = sharding.reshard(x, train)
    assert placed["w"].sharding.spec == P("fsdp", "tensor")
    moved = sharding.reshard(placed, infer)
    assert moved["w"].sharding.spec == P(None, "tensor")
    np.testing.assert_array_equal(np.asarray(moved["w"]), np.asarray(x["w"]))
