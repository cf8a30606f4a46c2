"""The TPU splash-attention path (models/splash.py) against the XLA segment-masked attention.

No TPU here: the kernel runs in Pallas interpret mode on CPU ("splash_interpret"), which
executes the same kernel body (blocks, online softmax, segment compare, the custom
backward kernels) as XLA ops. Tolerances are float32 summation-order differences: the
kernel sums in 128-token blocks with a running max, XLA in one softmax (measured ~1e-6).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from agentrl_jax.config import Config, ConfigError, apply_overrides
from agentrl_jax.models import Decoder, DecoderConfig, param_shardings, split_params
from agentrl_jax.models.layers import attention, packed_causal_mask
from agentrl_jax.models.splash import block_sizes, splash_attention, splash_segment_ids
from agentrl_jax.sharding import make_mesh
from agentrl_jax.train.build import attention_implementation


def test_splash_attention_values_and_grads_match_the_segment_mask():
    """Output and dq, dk, dv of the kernel (GQA: 2 query heads on 1 kv head) == XLA with the
    ``[B, 1, T, T]`` segment mask, at every position including padding. One row of 300
    tokens (the kernel pads it to 384, blocks of 128): three segments, the second crossing
    the block boundary at 128 and the third the one at 256, then 10 padding tokens (id 0)."""
    B, T, H, KV, K = 1, 300, 2, 1, 16
    assert block_sizes(384).block_q == 128  # three blocks: the segments above cross two boundaries
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, KV, KV))
    segments = np.zeros((B, T), np.int32)
    segments[0, :100], segments[0, 100:250], segments[0, 250:290] = 1, 2, 3
    segments = jnp.asarray(segments)
    cotangent = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32)

    def splash(q, k, v):
        return splash_attention(q, k, v, segments, interpret=True)

    def masked(q, k, v):
        return attention(q, k, v, packed_causal_mask(segments, None, B, T), "xla")

    def output_and_grads(f):
        def run(q, k, v):
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(cotangent)

        return jax.jit(run)(q, k, v)

    (got_out, got), (want_out, want) = output_and_grads(splash), output_and_grads(masked)
    np.testing.assert_allclose(got_out, want_out, atol=1e-5)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"d{name}")


def test_splash_segment_ids_reproduce_the_decoder_masks():
    """"Same id and key <= query" over the ids == ``packed_causal_mask`` (segments, padding by
    attention_mask, both) and == the right-padded rows' mask (lengths), for every real query.
    A padded query sees only itself (``packed_causal_mask`` lets it see earlier real keys
    too; its output is garbage by contract either way)."""
    B, T = 2, 12
    segments = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12], jnp.int32)
    attention_mask = jnp.asarray([[1] * 9 + [0] * 3, [1] * 7 + [0] * 5], jnp.int32)
    causal = np.tril(np.ones((T, T), bool))

    def mask_of(ids):
        ids = np.asarray(ids)
        return (ids[:, :, None] == ids[:, None, :]) & causal

    for seg, att in ((segments, None), (None, attention_mask), (segments, attention_mask)):
        query = np.ones((B, T, 1), bool) if att is None else np.asarray(att, bool)[:, :, None]
        want = np.asarray(packed_causal_mask(seg, att, B, T))[:, 0] & query
        got = mask_of(splash_segment_ids(B, T, segment_ids=seg, attention_mask=att))
        np.testing.assert_array_equal(got & query, want)
        if att is not None:  # a padded query: itself only
            np.testing.assert_array_equal(got[~query[..., 0]].sum(-1), 1)
    lengths = jnp.asarray([9, 12], jnp.int32)
    real = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    got = mask_of(splash_segment_ids(B, T, lengths=lengths))
    np.testing.assert_array_equal(got & real[:, :, None], causal & real[:, :, None] & real[:, None, :])
    with pytest.raises(ValueError, match="either lengths or segment_ids"):
        splash_segment_ids(B, T, segment_ids=segments, lengths=lengths)


def test_splash_is_refused_off_tpu_with_the_field_named():
    assert apply_overrides(Config(), ["model.attention_impl=splash"]).model.attention_impl == "splash"
    with pytest.raises(ConfigError, match=r"model.attention_impl: 'splash' is a TPU kernel .* 'cpu'"):
        attention_implementation("splash", "bfloat16", backend="cpu")
    assert attention_implementation("splash", "float32", backend="tpu") == "splash"
    assert attention_implementation("auto", "bfloat16", backend="tpu") == "splash"
    assert attention_implementation("auto", "bfloat16", backend="gpu") == "cudnn"
    assert attention_implementation("auto", "float32", backend="gpu") is None
    assert attention_implementation("auto", "bfloat16", backend="cpu") is None
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="attention_impl='splash' is a TPU Pallas kernel"):
            Decoder(DecoderConfig(architecture="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                                  num_kv_heads=1, head_dim=4), attention_impl="splash")


CONFIG = DecoderConfig(architecture="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def _decoder(attention_impl, remat="none"):
    return split_params(Decoder(CONFIG, attention_impl=attention_impl, remat=remat, rngs=nnx.Rngs(0)))


def _packed_row():
    """One packed row of 160 tokens: segments of 70, 50 and 30 (positions restart), 10 padding."""
    segments = np.zeros((1, 160), np.int32)
    positions = np.zeros((1, 160), np.int32)
    start = 0
    for seg, n in enumerate((70, 50, 30), start=1):
        segments[0, start : start + n], positions[0, start : start + n] = seg, np.arange(n)
        start += n
    ids = np.random.default_rng(0).integers(1, 64, (1, 160)).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments)


def _hidden_loss(graphdef, **call):
    ids, positions, segments = _packed_row()
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(CONFIG.hidden_size,)), jnp.float32)

    def loss(params):
        hidden, _ = nnx.merge(graphdef, params)(ids, positions, segment_ids=segments, **call)
        return jnp.sum(jnp.where(segments[..., None] > 0, hidden, 0) * weights), hidden

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.mark.slow  # ~12 s: two interpret-mode decoder gradients
def test_splash_decoder_forward_and_grads_match_xla():
    """A packed row through the whole decoder: hidden states and every weight gradient of the
    splash path == the XLA segment-masked path (same params); right-padded rows (``lengths``)
    == XLA's mask-free path on the real tokens."""
    graphdef, params = _decoder("splash_interpret")
    (want_loss, want_hidden), want_grads = _hidden_loss(_decoder("xla")[0])(params)
    (loss, hidden), grads = _hidden_loss(graphdef, max_segments=4)(params)
    np.testing.assert_allclose(hidden, want_hidden, atol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        # float32 noise relative to each weight's gradient scale (embedding rows reach ~150)
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))))

    # Right-padded rows (``lengths``, the trainer's unpacked layout): real tokens equal.
    ids, positions, _ = _packed_row()
    ids, positions = jnp.concatenate([ids, ids]), jnp.concatenate([positions, positions])
    lengths = jnp.asarray([70, 160], jnp.int32)

    def padded(graphdef):
        return jax.jit(lambda p: nnx.merge(graphdef, p)(ids, positions, lengths=lengths)[0])(params)

    real = np.arange(160)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(padded(graphdef)[real], padded(_decoder("xla")[0])[real], atol=1e-5)


@pytest.mark.slow  # ~10 s
def test_splash_under_a_mesh_runs_in_shard_map():
    """Rows over (data, fsdp) and heads over tensor: the kernel alone under ``jax.set_mesh``,
    with kv heads that do not divide the tensor axis (repeated to the query heads), and a
    decoder built with ``mesh`` on sharded params with no mesh set (how the trainer jits):
    both run in ``shard_map`` and == the unsharded XLA reference."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    B, T, H, KV, K = 4, 100, 4, 1, 16
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.float32) for n in (H, KV, KV))
    segments = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1).astype(np.int32))
    want = attention(q, k, v, packed_causal_mask(segments, None, B, T), "xla")
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda q, k, v: splash_attention(q, k, v, segments, interpret=True))
        assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v))
        got = fn(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5)

    graphdef, params = split_params(Decoder(CONFIG, attention_impl="splash_interpret", mesh=mesh, rngs=nnx.Rngs(0)))
    params = jax.device_put(params, param_shardings(params, mesh))
    ids, positions, segments = (jnp.concatenate([x, x]) for x in _packed_row())

    def hidden(graphdef, params):
        return nnx.merge(graphdef, params)(ids, positions, segment_ids=segments)[0]

    assert "shard_map" in str(jax.make_jaxpr(hidden, static_argnums=0)(graphdef, params))
    want = jax.jit(hidden, static_argnums=0)(_decoder("xla")[0], params)
    np.testing.assert_allclose(jax.jit(hidden, static_argnums=0)(graphdef, params), want, atol=1e-5)


@pytest.mark.slow  # ~15 s: four compiled interpret-mode gradients
@pytest.mark.parametrize("remat, recomputes", [("full", True), ("dots_saveable", True),
                                               ("attention_saveable", False), ("dots_attention_saveable", False)])
def test_splash_remat_policies_keep_the_kernel_residuals(remat, recomputes):
    """The attention policies keep the kernel's named residuals (output, logsumexp), so the
    compiled backward runs no rematerialized splash forward; "full" reruns it."""
    graphdef, params = _decoder("splash_interpret", remat)
    grad = _hidden_loss(graphdef)
    hlo = grad.lower(params).compile().as_text()
    rerun = [n for n in re.findall(r'op_name="([^"]*)"', hlo) if "rematted_computation" in n and "splash_mha_fwd" in n]
    assert bool(rerun) == recomputes
