"""Splash attention for packed rows (``models.splash``) == XLA with the segment mask.

Runs the Pallas kernel in its interpreter (no TPU here): values and q/k/v gradients of
ragged, padded rows against ``layers.attention`` with ``packed_causal_mask``; a decoder
with ``attention_impl="splash"`` against the XLA decoder (packed and right-padded rows,
weight gradients); and the per-shard kernel under an 8-device mesh (the default suite's
one test: the others take 6-16 s in the interpreter and are marked slow).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.models.layers import attention, packed_causal_mask
from agentrl_jax.models.splash import splash_packed_attention
from agentrl_jax.sharding import make_mesh

B, T, H, KV, K = 2, 128, 4, 2, 32  # one kernel block per row here; the slow decoder tests use two
SEGMENTS = np.zeros((B, T), np.int32)
SEGMENTS[0, :50], SEGMENTS[0, 50:70], SEGMENTS[0, 70:122] = 1, 2, 3  # then 6 padding tokens
SEGMENTS[1, :] = 1


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, KV, KV))


def _masked(q, k, v):
    segments = jnp.asarray(SEGMENTS)
    out = attention(q, k, v, packed_causal_mask(segments, None, B, T), "xla")
    return jnp.where((segments > 0)[:, :, None, None], out, 0.0)


def _splash(q, k, v):
    return splash_packed_attention(q, k, v, jnp.asarray(SEGMENTS), interpret=True)


@pytest.mark.slow  # ~6 s in Pallas's interpreter
def test_splash_values_and_gradients_equal_the_segment_mask():
    q, k, v = _qkv()
    np.testing.assert_allclose(np.asarray(jax.jit(_splash)(q, k, v)), np.asarray(_masked(q, k, v)), atol=2e-5)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H, K)), jnp.float32)

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2)))(q, k, v)

    for got, want in zip(grads(_splash), grads(_masked), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
        assert not np.any(np.asarray(got)[0, 122:])  # nothing flows to padding


CFG = DecoderConfig(architecture="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def _decoder_grads(impl, **call):
    graphdef, params = split_params(Decoder(CFG, attention_impl=impl, rngs=nnx.Rngs(0)))
    ids = jnp.asarray(np.random.default_rng(2).integers(1, 64, (B, 256)), jnp.int32)
    real = call.get("segment_ids", jnp.ones((B, 256), jnp.int32)) > 0
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(CFG.hidden_size,)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(256), (B, 256))

    def loss(p):
        hidden, _ = nnx.merge(graphdef, p)(ids, positions, **call)
        return jnp.sum(jnp.where(real[..., None], hidden, 0) * weights)

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.slow  # ~15 s each in Pallas's interpreter
@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_splash_decoder_equals_the_xla_decoder(layout):
    """Two kernel blocks per row: the causal mask's fully masked block is skipped."""
    segments = np.zeros((B, 256), np.int32)
    segments[0, :100], segments[0, 100:180], segments[0, 180:250], segments[1, :] = 1, 2, 3, 1
    if layout == "packed":
        call = dict(segment_ids=jnp.asarray(segments), max_segments=4)
        xla = dict(segment_ids=jnp.asarray(segments))
    else:
        call = xla = dict(lengths=jnp.asarray([177, 256], jnp.int32))
    (l1, g1), (l2, g2) = _decoder_grads("splash", **call), _decoder_grads("xla", **xla)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-7


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_splash_under_a_mesh_runs_per_shard_and_equals_the_segment_mask():
    q, k, v = _qkv(4)
    want = np.asarray(_masked(q, k, v))
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
        lowered = jax.jit(_splash).lower(q, k, v)
        got = np.asarray(lowered.compile()(q, k, v))
    assert "shard_map" in lowered.as_text() or "manual" in lowered.as_text()
    np.testing.assert_allclose(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="divisible by 128"):
        splash_packed_attention(q[:, :100], k[:, :100], v[:, :100], jnp.ones((B, 100), jnp.int32), interpret=True)
