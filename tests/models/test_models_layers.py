"""Block pieces against hand values and NumPy / transformers references; remat invariance."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from agentrl_jax.models import (
    Decoder,
    DecoderConfig,
    Llama3RopeScaling,
    param_logical_axes,
    split_params,
)
from agentrl_jax.models.layers import (
    apply_rope,
    attention,
    packed_attention,
    packed_causal_mask,
    rms_norm,
    rope_inverse_frequencies,
)

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml


def test_rms_norm_matches_numpy():
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(2, 3, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    want = w * x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(
        np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), want, rtol=1e-5, atol=1e-6
    )


def test_rope_is_a_rotation_of_each_frequency_pair():
    rng = np.random.default_rng(1)
    K = 8
    x = rng.normal(size=(1, 5, 2, K)).astype(np.float32)
    positions = np.array([[0, 1, 2, 7, 30]])
    inv_freq = rope_inverse_frequencies(K, 10000.0, None)
    np.testing.assert_allclose(inv_freq, 1.0 / 10000.0 ** (np.arange(0, K, 2) / K), rtol=1e-6)
    # Pair (i, i + K/2) as a complex number, multiplied by exp(i * p * f_i).
    z = x[..., : K // 2] + 1j * x[..., K // 2 :]
    z = z * np.exp(1j * positions[..., None, None] * inv_freq.astype(np.float64))
    want = np.concatenate([z.real, z.imag], -1)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq))
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(got[:, 0], x[:, 0])  # position 0 is the identity


def test_llama3_frequencies_match_transformers():
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    config = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        head_dim=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inverse_frequencies(64, 500000.0, scaling)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    plain = rope_inverse_frequencies(64, 500000.0, None)
    assert (got < plain).any() and (got == plain).any()  # low frequencies scaled, high kept


def test_packed_causal_mask_hand_values():
    segment_ids = jnp.array([[1, 1, 2, 2, 0]])
    attention_mask = jnp.array([[1, 1, 1, 1, 0]])
    mask = np.asarray(packed_causal_mask(segment_ids, attention_mask, 1, 5))[0, 0].astype(int)
    want = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],  # a padded query sees only itself (finite garbage)
        ]
    )
    np.testing.assert_array_equal(mask, want)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's packed kernel needs a CUDA GPU (Hopper+)")
def test_cudnn_packed_attention_matches_the_masked_reference():
    """Values and gradients of the fused packed kernel == XLA with the segment mask (bf16)."""
    B, T, H, KV, K = 2, 256, 4, 2, 64
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, K)), jnp.bfloat16) for n in (H, KV, KV))
    segments = np.zeros((B, T), np.int32)
    segments[0, :100], segments[0, 100:130], segments[0, 130:250] = 1, 2, 3
    segments[1, :256] = 1
    segments = jnp.asarray(segments)
    real = (segments > 0)[:, :, None, None]

    def fused(q, k, v):
        return packed_attention(q, k, v, segments, 8)

    def masked(q, k, v):
        out = attention(q, k, v, packed_causal_mask(segments, None, B, T), "xla")
        return jnp.where(real, out, 0)

    cotangent = jnp.asarray(rng.normal(size=(B, T, H, K)), jnp.float32) * real
    got, want = (np.asarray(jax.jit(f)(q, k, v), np.float32) for f in (fused, masked))
    np.testing.assert_allclose(got, want, atol=2e-2)

    def grads(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cotangent), argnums=(0, 1, 2)))(q, k, v)

    for g_fused, g_masked in zip(grads(fused), grads(masked)):
        np.testing.assert_allclose(np.asarray(g_fused, np.float32), np.asarray(g_masked, np.float32), atol=5e-2)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's packed kernel needs a CUDA GPU (Hopper+)")
def test_cudnn_packed_decoder_gradients_match_padded_rows():
    """Three sequences packed in one row (+ padding) == the same three as padded rows, on the
    mask-free cuDNN path: hidden states and every weight gradient (bf16 compute)."""
    cfg = DecoderConfig(architecture="qwen3", vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)
    graphdef, params = split_params(Decoder(cfg, dtype=jnp.bfloat16, attention_impl="cudnn", rngs=nnx.Rngs(0)))
    lengths = [100, 30, 120]
    ids = np.random.default_rng(0).integers(1, 64, sum(lengths))
    packed_ids = np.zeros((1, 256), np.int32)
    packed_ids[0, : sum(lengths)] = ids
    segments = np.zeros((1, 256), np.int32)
    positions = np.zeros((1, 256), np.int32)
    padded_ids = np.zeros((3, 128), np.int32)
    start = 0
    for i, n in enumerate(lengths):
        segments[0, start : start + n], positions[0, start : start + n] = i + 1, np.arange(n)
        padded_ids[i, :n] = ids[start : start + n]
        start += n
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(cfg.hidden_size,)), jnp.float32)

    def packed_loss(p):
        hidden = nnx.merge(graphdef, p)(jnp.asarray(packed_ids), jnp.asarray(positions),
                                          segment_ids=jnp.asarray(segments), max_segments=8)
        return jnp.sum(jnp.where(jnp.asarray(segments)[..., None] > 0, hidden.astype(jnp.float32), 0) * weights)

    def padded_loss(p):
        pos = jnp.broadcast_to(jnp.arange(128), (3, 128))
        hidden = nnx.merge(graphdef, p)(jnp.asarray(padded_ids), pos, lengths=jnp.asarray(lengths, jnp.int32))
        real = jnp.arange(128)[None, :, None] < jnp.asarray(lengths)[:, None, None]
        return jnp.sum(jnp.where(real, hidden.astype(jnp.float32), 0) * weights)

    (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(f))(params) for f in (packed_loss, padded_loss))
    assert float(l1) == pytest.approx(float(l2), rel=2e-2)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 3e-2 * np.linalg.norm(b) + 1e-6


_CUDNN_CONFIG = DecoderConfig(architecture="qwen3", vocab_size=64, hidden_size=128, intermediate_size=256,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True)


def _cudnn_decoder(remat="full"):
    return split_params(Decoder(_CUDNN_CONFIG, dtype=jnp.bfloat16, attention_impl="cudnn", remat=remat,
                                rngs=nnx.Rngs(0)))


def _hidden_sum_grad(graphdef, **kwargs):
    """``grad`` of the sum of the hidden states over real tokens, for ``Decoder(..., **kwargs)``."""

    def loss(params, ids, segment_ids):
        extra = {"lengths": jnp.sum(segment_ids > 0, axis=1)} if "max_segments" not in kwargs else {
            "segment_ids": segment_ids, **kwargs}
        hidden = nnx.merge(graphdef, params)(ids, ids, **extra)
        return jnp.sum(jnp.where(segment_ids[..., None] > 0, hidden.astype(jnp.float32), 0))

    return jax.jit(jax.grad(loss))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's packed kernel needs a CUDA GPU (Hopper+)")
def test_cudnn_packed_backward_memory_follows_the_segment_bound():
    """Compiled temporaries of a long packed row's gradient. A bound of 1 (the plan's for a row
    of one trajectory) costs what a padded row costs; cuDNN's packed kernel compiled for M
    segments holds backward scratch for M x the row length, the long-row memory of an
    update that always compiled M = 64 (``train.packing.PackPlan.segment_bound``)."""
    graphdef, params = _cudnn_decoder()
    ids = jax.ShapeDtypeStruct((1, 8192), jnp.int32)

    def temp_bytes(**kwargs):
        compiled = _hidden_sum_grad(graphdef, **kwargs).lower(params, ids, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    padded = temp_bytes()
    temps = {m: temp_bytes(max_segments=m) for m in (1, 2, 64)}
    print(f"temporaries: padded {padded / 2**20:.1f} MiB, by segment bound", {m: f"{t / 2**20:.1f} MiB"
                                                                               for m, t in temps.items()})
    assert temps[1] <= 1.05 * padded + 2**20
    assert temps[64] > 4 * temps[2], temps


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a CUDA GPU")
@pytest.mark.parametrize("remat, forwards", [("full", 2), ("attention_saveable", 1), ("dots_attention_saveable", 1)])
def test_cudnn_attention_remat_policies_skip_the_recomputed_flash_forward(remat, forwards):
    """The attention policies keep cuDNN's forward outputs, so the backward pass runs only the
    backward kernel (one forward kernel in the program instead of two); gradients unchanged."""
    graphdef, params = _cudnn_decoder(remat)
    segments = np.zeros((2, 256), np.int32)
    segments[0, :200], segments[1, :256] = 1, 1
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 256)), jnp.int32)
    grad = _hidden_sum_grad(graphdef)
    hlo = grad.lower(params, ids, jnp.asarray(segments)).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]*fmha[^"]*)"', hlo)
    assert sum("Backward" not in t for t in targets) == forwards, targets
    want = _hidden_sum_grad(_cudnn_decoder("none")[0])(params, ids, jnp.asarray(segments))
    for a, b in zip(jax.tree.leaves(grad(params, ids, jnp.asarray(segments))), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b) + 1e-6


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's packed kernel needs a CUDA GPU (Hopper+)")
def test_cudnn_packed_sft_update_matches_the_segment_mask():
    """``run_sft`` on a bf16 cuDNN decoder packs conversations several to a row and runs cuDNN's
    packed kernel (the batch's segment bound > 1); its update equals the same batch's update
    through XLA attention with the segment mask (same params), to bf16 accuracy."""
    import functools

    import optax

    from agentrl_jax.losses import global_normalizer
    from agentrl_jax.train.batch import TokenRecord, build_batch
    from agentrl_jax.train.sft import batch_arrays, run_sft, sft_settings
    from agentrl_jax.train.step import init_train_state, update_step

    graphdef, params = _cudnn_decoder()
    xla_graphdef, _ = split_params(Decoder(_CUDNN_CONFIG, dtype=jnp.bfloat16,
                                           attention_impl="xla", rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    records = [TokenRecord(rng.integers(1, 64, n).tolist(), [0] * 8 + [1] * (n - 8), [0.0] * n, [-1] * n,
                           [0.0] * 8 + [1.0] * (n - 8)) for n in (100, 30, 120, 60, 90, 40)]
    opt = optax.sgd(0.1)
    got, _ = run_sft(init_train_state(jax.tree.map(jnp.copy, params), opt, 0), graphdef=graphdef, optimizer=opt,
                     records=records, steps=1, batch_size=len(records), row_length=256, seed=0)
    batch = build_batch(records, pack=True, row_length=256)
    assert int(np.max(batch.segment_ids)) > 1  # several conversations per row: the packed kernel ran
    step = jax.jit(functools.partial(update_step, graphdef=xla_graphdef, optimizer=opt, settings=sft_settings(),
                                     num_micro_batches=1, num_sequences=len(records)))
    want, _ = step(init_train_state(jax.tree.map(jnp.copy, params), opt, 0), batch_arrays(batch),
                   global_normalizer(jnp.asarray(batch.loss_mask), "token-mean"))
    for new, ref, old in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), jax.tree.leaves(params),
                             strict=True):
        a, b = np.asarray(new, np.float32) - np.asarray(old, np.float32), np.asarray(ref, np.float32) - np.asarray(old)
        assert np.linalg.norm(a - b) <= 3e-2 * np.linalg.norm(b) + 1e-7


CONFIG = DecoderConfig(
    architecture="llama",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def _value_and_grad(remat):
    ids = jnp.arange(10).reshape(1, 10) % 50
    positions = jnp.arange(10)[None]

    def loss(params, graphdef):
        model = nnx.merge(graphdef, params)
        return jnp.sum(model.logits(model(ids, positions)) ** 2)

    graphdef, params = split_params(Decoder(CONFIG, remat=remat, rngs=nnx.Rngs(0)))
    return jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, graphdef)


@pytest.fixture(scope="module")
def no_remat():
    return _value_and_grad("none")


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "attention_saveable", "dots_attention_saveable"])
def test_remat_policies_give_same_values_and_gradients(no_remat, remat):
    (v0, g0), (v1, g1) = no_remat, _value_and_grad(remat)
    np.testing.assert_allclose(v0, v1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # GPU recompute order: ~2e-6 on an H200


def test_every_param_has_one_logical_axis_per_dim():
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    axes = param_logical_axes(model)
    shapes = jax.tree.leaves(
        jax.tree.map(lambda p: p.shape, params, is_leaf=lambda x: isinstance(x, nnx.Variable)),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(flat_axes) == len(shapes) == 12  # 9 stacked layer weights + embed + norm + lm_head
    for ax, shape in zip(flat_axes, shapes, strict=True):
        assert len(ax) == len(shape)
    assert axes["layers"]["wq"] == ("layers", "embed", "heads", "head_dim")
    table, layout = model.output_embedding()
    assert layout == "dv" and table.shape == (32, 50)


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        Decoder(CONFIG, attention_impl="flash")
    with pytest.raises(ValueError, match="remat must be one of"):
        Decoder(CONFIG, remat="some")
