"""Pure functions of the decoder block: RMSNorm, RoPE, attention masks, attention, SwiGLU.

Dimension letters: B batch, T query tokens, S key tokens, D model width, H query heads, KV
key/value heads, K head dim, F MLP width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.models.config import DecoderConfig, Llama3RopeScaling


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019): ``y = w * x / sqrt(mean(x^2) + eps)``.

    The statistic is computed in float32 and the normalized value is cast back to the input
    dtype before the scale is applied, as in the HF reference.

    Args:
      x: ``[..., N]`` activations.
      weight: ``[N]`` scale.
      eps: added to the mean square.

    Returns:
      ``[..., N]`` in ``x.dtype``.
    """
    chex.assert_equal(x.shape[-1], weight.shape[-1])
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None
) -> np.ndarray:
    """RoPE inverse frequencies ``1 / theta^(2i/K)`` for i < K/2 (Su et al. 2021, eq. 15).

    With Llama 3.1 scaling, wavelengths ``2 pi / f`` above ``M / low_freq_factor`` become
    ``f / factor``, those below ``M / high_freq_factor`` stay, and in between
    ``f' = (1 - s) f / factor + s f`` with ``s = (M / wavelength - low) / (high - low)``.

    Returns:
      ``[K/2]`` float32 (computed in float32 like the HF reference).
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate query/key heads by their positions (half-split "rotate_half" layout of HF).

    ``y = x * cos(p f) + rotate_half(x) * sin(p f)``, ``rotate_half([a, b]) = [-b, a]``.

    Args:
      x: ``[B, T, N, K]``.
      positions: ``[B, T]`` int.
      inv_freq: ``[K/2]``.

    Returns:
      ``[B, T, N, K]`` in ``x.dtype``.
    """
    chex.assert_rank(x, 4)
    chex.assert_equal(x.shape[:2], positions.shape)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, K/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos = jnp.cos(angles).astype(x.dtype)
    sin = jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def packed_causal_mask(
    segment_ids: jax.Array | None, attention_mask: jax.Array | None, batch: int, length: int
) -> jax.Array:
    """Mask for one forward over ``[B, T]`` rows that may be packed and padded.

    Query t sees key s iff ``s <= t``, both have the same segment id and key s is a real
    token. A query always sees itself, so padded query rows stay finite (their output is
    garbage by contract).

    Returns:
      ``[B, 1, T, T]`` bool.
    """
    idx = jnp.arange(length)
    causal = idx[None, :] <= idx[:, None]  # [T, T]
    mask = jnp.broadcast_to(causal, (batch, length, length))
    if segment_ids is not None:
        chex.assert_shape(segment_ids, (batch, length))
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if attention_mask is not None:
        chex.assert_shape(attention_mask, (batch, length))
        real_key = attention_mask.astype(bool)[:, None, :]
        mask = mask & (real_key | jnp.eye(length, dtype=bool)[None])
    return mask[:, None]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    implementation: str | None,
    *,
    lengths: jax.Array | None = None,
) -> jax.Array:
    """Scaled dot-product attention with GQA (Vaswani et al. 2017; Ainslie et al. 2023).

    ``softmax(q k^T / sqrt(K) + log mask) v`` where query head h reads kv head
    ``h // (H / KV)``.

    Args:
      q: ``[B, T, H, K]``; k, v: ``[B, S, KV, K]``.
      mask: ``[B, 1, T, S]`` bool, or None for causal attention over right-padded rows
        whose real tokens are ``[0, lengths[b])``: no mask is materialized, which lets
        cuDNN run its fused flash kernel on GPU.
      implementation: "xla", "cudnn" or None (JAX picks).
      lengths: ``[B]`` int32 real lengths when ``mask`` is None (None: no padding).

    Returns:
      ``[B, T, H, K]``.
    """
    chex.assert_rank([q, k, v], 4)
    chex.assert_equal_shape([k, v])
    if mask is None:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation=implementation,
        )
    chex.assert_rank(mask, 4)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def segment_table(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Start offsets and lengths of the segments of packed rows, as cuDNN's packed layout wants.

    Segments are contiguous, numbered 1, 2, ... from the start of each row, with padding
    (id 0) at the end (``train.packing`` lays rows out this way).

    Args:
      segment_ids: ``[B, T]`` int.
      max_segments: M, a static bound on segments per row.

    Returns:
      ``(offsets [B, M + 1], lengths [B, M])`` int32, -1 where a row has fewer segments.
    """
    B, T = segment_ids.shape
    flat = (segment_ids + jnp.arange(B)[:, None] * (max_segments + 1)).reshape(-1)
    counts = jax.ops.segment_sum(jnp.ones_like(flat, jnp.int32), flat, num_segments=B * (max_segments + 1))
    lengths = counts.reshape(B, max_segments + 1)[:, 1:]
    starts = jnp.cumsum(lengths, axis=1) - lengths
    real = lengths > 0
    offsets = jnp.concatenate([jnp.where(real, starts, -1), jnp.full((B, 1), -1, jnp.int32)], axis=1)
    return offsets.astype(jnp.int32), jnp.where(real, lengths, -1).astype(jnp.int32)


def packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    max_segments: int,
) -> jax.Array:
    """Causal attention within the segments of packed rows on cuDNN's fused packed kernel.

    ``jax.nn.dot_product_attention`` (JAX 0.10) takes no segment ids: its cuDNN route
    turns a mask into a ``[B, 1, T, T]`` bias, which is T^2 memory per row. cuDNN itself
    has a packed ("THD", ragged offsets) flash-attention mode, reached through
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with per-segment
    offsets and lengths (Hopper or newer). Outputs and gradients at padding positions are 0 (the
    kernel does not define them, and a NaN there would leak into weight gradients). The
    backward kernel's workspace is B x ``max_segments`` x T x ~16 KiB at the 1.7B shape
    (docs/benchmarks.md, "Long rows: memory"), so keep the bound tight
    (``train.packing.PackPlan.segment_bound``).

    Args:
      q: ``[B, T, H, K]``; k, v: ``[B, T, KV, K]``.
      segment_ids: ``[B, T]`` (see :func:`segment_table`).
      max_segments: static bound on segments per row.

    Returns:
      ``[B, T, H, K]``.
    """
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    offsets, lengths = segment_table(segment_ids, max_segments)
    real = (segment_ids > 0)[:, :, None, None]
    # cuDNN's backward writes nonzero dK at padding keys no query attends to (measured on an
    # H200, cuDNN of jax 0.11.2); the selects make every padding gradient exactly 0.
    q, k, v = (jnp.where(real, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    out = cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=cudnn.MaskType.PADDING_CAUSAL,
    )
    return jnp.where(real, out, jnp.zeros((), out.dtype))


class LowRank(NamedTuple):
    """One layer's LoRA adapter of a weight ``W [*in, *out]``: ``a [*in, r]``, ``b [r, *out]``
    and the scale ``alpha / r`` (LoRA, arXiv:2106.09685)."""

    a: jax.Array
    b: jax.Array
    scale: float


def project(equation: str, x: jax.Array, w: jax.Array, adapter: LowRank | None = None) -> jax.Array:
    """``einsum(equation, x, w)``, plus ``scale * (x A) B`` with a LoRA ``adapter``.

    The in-layer form of ``x (W + scale A B)``: the update costs two thin matmuls through the
    rank-r bottleneck, and neither the merged weight nor its gradient is ever formed.
    ``equation`` contracts x's trailing dims with w's leading ones (``"btd,dhk->bthk"``,
    ``"bthk,hkd->btd"``); ``a`` and ``b`` are cast to ``x.dtype``, as the decoder casts weights.
    """
    out = jnp.einsum(equation, x, w)
    if adapter is None:
        return out
    inputs, result = equation.split("->")
    x_dims, w_dims = inputs.split(",")
    contracted = "".join(c for c in w_dims if c in x_dims and c not in result)
    if not w_dims.startswith(contracted):
        raise ValueError(f"project: {equation!r} must contract the weight's leading dims")
    r = next(c for c in "rzyxwvu" if c not in equation)
    kept = "".join(c for c in x_dims if c not in contracted)
    xa = jnp.einsum(f"{x_dims},{contracted}{r}->{kept}{r}", x, adapter.a.astype(x.dtype))
    update = jnp.einsum(f"{kept}{r},{r}{w_dims[len(contracted):]}->{result}", xa * adapter.scale,
                        adapter.b.astype(x.dtype))
    return out + update.astype(out.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
           adapters: dict[str, LowRank] | None = None) -> jax.Array:
    """SwiGLU MLP (Shazeer 2020): ``(silu(x W_g) * (x W_u)) W_d``.

    Args:
      x: ``[B, T, D]``; w_gate, w_up: ``[D, F]``; w_down: ``[F, D]``.
      adapters: LoRA adapters of ``"w_gate"``, ``"w_up"``, ``"w_down"`` (any subset; `project`).
    """
    adapters = adapters or {}
    gate = project("btd,df->btf", x, w_gate, adapters.get("w_gate"))
    up = project("btd,df->btf", x, w_up, adapters.get("w_up"))
    return project("btf,fd->btd", jax.nn.silu(gate) * up, w_down, adapters.get("w_down"))


def rope_frequencies(config: DecoderConfig) -> np.ndarray:
    """The ``[K/2]`` inverse frequencies of a config."""
    return rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
