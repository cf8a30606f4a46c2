"""Splash attention for packed rows (``models.splash``) == XLA with the segment mask.

Runs the Pallas kernel in its interpreter (no TPU here): values and q/k/v gradients of
ragged, padded rows against ``layers.attention`` with ``packed_causal_mask``; a decoder
with ``attention_impl="splash"`` against the XLA decoder (packed and right-padded rows,
weight gradients); and the per-shard kernel under an 8-device mesh (the default suite's
one test: the others take 6-16 s in the interpreter and are marked slow).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.config import Config, ConfigError, apply_overrides
from agentrl_jax.models import Decoder, DecoderConfig, param_shardings, split_params
from agentrl_jax.models.layers import attention, packed_causal_mask
from agentrl_jax.models.splash import splash_packed_attention
from agentrl_jax.sharding import make_mesh
from agentrl_jax.train.build import attention_implementation

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
        hidden = nnx.merge(graphdef, p)(ids, positions, **call)
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
    # a row of 100 tokens: padded to 128 for the kernel, sliced back
    short = jnp.asarray(SEGMENTS[:, :100])
    want = attention(q[:, :100], k[:, :100], v[:, :100], packed_causal_mask(short, None, B, 100), "xla")
    got = splash_packed_attention(q[:, :100], k[:, :100], v[:, :100], short, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.mark.slow  # ~4 s in Pallas's interpreter
def test_splash_values_and_gradients_across_kernel_blocks():
    """One row of 300 tokens (padded to 384 for the kernel: three blocks of 128), GQA with 2
    query heads on 1 kv head: segments crossing the block boundaries at 128 and 256, then
    padding. Output and dq, dk, dv == the XLA segment mask (outputs zeroed at padding)."""
    T, H, KV = 300, 2, 1
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(1, T, n, 16)), jnp.float32) for n in (H, KV, KV))
    segments = np.zeros((1, T), np.int32)
    segments[0, :100], segments[0, 100:250], segments[0, 250:290] = 1, 2, 3
    segments = jnp.asarray(segments)
    cotangent = jnp.asarray(rng.normal(size=(1, T, H, 16)), jnp.float32)

    def masked(q, k, v):
        out = attention(q, k, v, packed_causal_mask(segments, None, 1, T), "xla")
        return jnp.where((segments > 0)[:, :, None, None], out, 0.0)

    def output_and_grads(f):
        def run(q, k, v):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(cotangent)

        return jax.jit(run)(q, k, v)

    splash = functools.partial(splash_packed_attention, segment_ids=segments, interpret=True)
    (got_out, got), (want_out, want) = output_and_grads(splash), output_and_grads(masked)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=2e-5)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, err_msg=f"d{name}")


def test_splash_is_auto_on_tpu_and_refused_elsewhere_with_the_field_named():
    assert apply_overrides(Config(), ["model.attention_impl=splash"]).model.attention_impl == "splash"
    with pytest.raises(ConfigError, match=r"model.attention_impl: 'splash' is a TPU kernel .* 'cpu'"):
        attention_implementation("splash", "bfloat16", backend="cpu")
    assert attention_implementation("splash", "float32", backend="tpu") == "splash"
    assert attention_implementation("auto", "bfloat16", backend="tpu") == "splash"
    assert attention_implementation("auto", "bfloat16", backend="gpu") == "cudnn"
    assert attention_implementation("auto", "float32", backend="gpu") is None
    assert attention_implementation("auto", "bfloat16", backend="cpu") is None


def _row_loss(graphdef):
    """Gradient of a weighted sum of the hidden states over the real tokens of two packed rows."""
    segments = np.zeros((B, 256), np.int32)
    segments[0, :100], segments[0, 100:180], segments[0, 180:250], segments[1, :] = 1, 2, 3, 1
    segments = jnp.asarray(segments)
    ids = jnp.asarray(np.random.default_rng(2).integers(1, 64, (B, 256)), jnp.int32)
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(CFG.hidden_size,)), jnp.float32)

    def loss(params):
        hidden = nnx.merge(graphdef, params)(ids, ids, segment_ids=segments, max_segments=4)
        return jnp.sum(jnp.where(segments[..., None] > 0, hidden, 0) * weights)

    return jax.jit(jax.grad(loss))


@pytest.mark.slow  # ~4 s each: a compiled decoder gradient in Pallas's interpreter
@pytest.mark.parametrize("remat, reruns", [("full", True), ("dots_saveable", True), ("attention_saveable", False),
                                           ("dots_attention_saveable", False)])
def test_splash_remat_policies_keep_the_kernel_residuals(remat, reruns):
    """The attention policies keep the kernel's named residuals (output, logsumexp): the
    compiled backward runs no rematerialized splash forward; "full" reruns it."""
    graphdef, params = split_params(Decoder(CFG, attention_impl="splash", remat=remat, rngs=nnx.Rngs(0)))
    hlo = _row_loss(graphdef).lower(params).compile().as_text()
    names = re.findall(r'op_name="([^"]*)"', hlo)
    assert any("splash_mha_dq" in n or "splash_mqa_dq" in n for n in names)  # the backward kernel is there
    assert any("rematted_computation" in n and "_fwd" in n and "splash" in n for n in names) == reruns


@pytest.mark.slow  # ~10 s
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_splash_decoder_runs_per_shard_on_its_own_mesh():
    """How the trainer runs it: params sharded on a (data, fsdp, tensor) mesh, jit without
    ``jax.set_mesh``. The decoder built with ``mesh`` runs the kernel in ``shard_map`` (on a
    TPU, XLA cannot partition it), and its gradients == the XLA decoder's."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    graphdef, params = split_params(Decoder(CFG, attention_impl="splash", mesh=mesh, rngs=nnx.Rngs(0)))
    params = jax.device_put(params, param_shardings(params, mesh))
    grad = _row_loss(graphdef)
    assert "shard_map" in str(jax.make_jaxpr(grad)(params))
    without_mesh = _row_loss(split_params(Decoder(CFG, attention_impl="splash", rngs=nnx.Rngs(0)))[0])
    assert "shard_map" not in str(jax.make_jaxpr(without_mesh)(params))
    want = _row_loss(split_params(Decoder(CFG, attention_impl="xla", rngs=nnx.Rngs(0)))[0])(params)
    for a, b in zip(jax.tree.leaves(grad(params)), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-7
