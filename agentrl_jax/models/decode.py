"""The decoder's inference forward: per-layer weights and per-layer KV buffers, layers unrolled.

The trainer's `Decoder` stacks the L layers' weights (``[L, ...]``) and runs them in a
``lax.scan``, and its cache path scatters new keys/values into one ``[L, B, S, KV, K]``
buffer carried through that scan, slices the layer back out and attends over all S
entries of every slot. Decoding one token per slot, that costs several passes over the
whole cache per step (15 ms at batch 64 on the 1.7B shape, see docs/benchmarks.md). This
module is the rollout engine's forward instead:

- `DecodeParams`: the same weights in an inference layout, one dict per layer (a tuple,
  so the L layers unroll in Python and each matmul reads its own buffer). Q, K and V are
  one matrix ``[D, KV, G + 2, K]`` (per kv head: its G query heads, its key, its value),
  gate and up one ``[D, 2, F]``; both keep whole heads / MLP columns on one tensor shard.
- `LayerCache`: L separate k and v buffers ``[B, KV, S, K]``. Donated through the
  engine's jitted calls, each one is updated in place by a per-row scatter.
- `forward`: T tokens per row written at ``[write_index[b], write_index[b] + T)``, query t
  attending to entries ``j <= write_index[b] + t`` among the first ``attend_len`` entries
  (a static window: the caller picks a bucket above every live length). With
  ``attention="xla"`` the window is an einsum over ``[B, KV, W, K]`` (kv-head major: a
  batched matmul over ``B * KV``, no repeat of kv heads); on GPU XLA copies the window
  out of the buffer first, which costs about as much as the attention itself. With
  ``attention="pallas"`` (one token per row) JAX's Pallas GPU decode-attention kernel
  reads each row's own filled entries straight from the buffer and needs no window.

Numerics follow `Decoder` (float32 RMSNorm statistics, float32 attention logits and
softmax, the same RoPE), so decoding reproduces the trainer's forward.

Dimension letters: B batch, T tokens, S cache length, W attention window, D width, H heads,
KV kv heads, G query heads per kv head, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, PartitionSpec

from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.layers import apply_rope, rms_norm, rope_frequencies

ATTENTION_IMPLS = ("xla", "pallas")
LAYER_CACHE_AXES: tuple[str, ...] = ("slots", "kv_heads", "cache_sequence", "head_dim")


@struct.dataclass
class DecodeParams:
    """Decoder weights in the inference layout (see the module docstring).

    Attributes:
      embed: ``[V, D]`` token embedding.
      layers: L dicts of one layer's weights (`layer_axes` names them).
      final_norm: ``[D]``.
      lm_head: ``[D, V]``, or None with tied embeddings.
    """

    embed: jax.Array
    layers: tuple[dict[str, jax.Array], ...]
    final_norm: jax.Array
    lm_head: jax.Array | None = None

    def output_embedding(self) -> tuple[jax.Array, str]:
        """``(table, "vd")`` for tied embeddings, ``(kernel, "dv")`` for an lm_head."""
        if self.lm_head is None:
            return self.embed, "vd"
        return self.lm_head, "dv"


@struct.dataclass
class LayerCache:
    """Keys and values of every layer, one buffer per layer.

    Attributes:
      k: L arrays ``[B, KV, S, K]``, keys after RoPE.
      v: L arrays ``[B, KV, S, K]``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, config: DecoderConfig, batch: int, max_len: int, dtype) -> LayerCache:
        shape = cls.shape(config, batch, max_len)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)))

    @staticmethod
    def shape(config: DecoderConfig, batch: int, max_len: int) -> tuple[int, int, int, int]:
        """``(B, KV, S, K)`` of one layer's buffer."""
        return (batch, config.num_kv_heads, max_len, config.head_dim)

    @classmethod
    def logical_axes(cls, config: DecoderConfig) -> LayerCache:
        axes = (LAYER_CACHE_AXES,) * config.num_layers
        return cls(k=axes, v=axes)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def map(self, fn) -> LayerCache:
        """Apply ``fn`` to every layer's k and v buffer."""
        return LayerCache(k=tuple(map(fn, self.k)), v=tuple(map(fn, self.v)))


def layer_axes(config: DecoderConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axes of one layer's inference weights (kv heads and MLP columns over tensor)."""
    axes = {
        "attn_norm": ("norm",),
        "wqkv": ("embed", "kv_heads", None, "head_dim"),
        "wo": ("kv_heads", None, "head_dim", "embed"),
        "mlp_norm": ("norm",),
        "w_gate_up": ("embed", None, "mlp"),
        "w_down": ("mlp", "embed"),
    }
    if config.attention_bias:
        axes["bqkv"] = ("kv_heads", None, "head_dim")
    if config.qk_norm:
        axes["q_norm"] = ("norm",)
        axes["k_norm"] = ("norm",)
    return axes


def decode_params_axes(config: DecoderConfig) -> DecodeParams:
    """Logical axes of every `DecodeParams` leaf (a `DecodeParams` of tuples)."""
    return DecodeParams(
        embed=("vocab", "embed"),
        layers=tuple(layer_axes(config) for _ in range(config.num_layers)),
        final_norm=("norm",),
        lm_head=None if config.tie_word_embeddings else ("embed", "vocab"),
    )


def to_decode_params(config: DecoderConfig, params: nnx.State) -> DecodeParams:
    """The inference layout of a `Decoder`'s params (``nnx.state(model, nnx.Param)``).

    Pure array code (reshape, concatenate, index): run it under ``jax.jit`` with the
    shardings of `decode_params_axes` as ``out_shardings``.
    """
    L, H, KV, K = config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim
    G = H // KV
    stacked = params["layers"]

    def value(x):
        return x[...] if isinstance(x, nnx.Variable) else x

    wq = value(stacked["wq"])
    D = wq.shape[1]
    # query head h = kv * G + g reads kv head kv (grouped-query attention)
    wqkv = jnp.concatenate(
        [wq.reshape(L, D, KV, G, K), value(stacked["wk"])[:, :, :, None], value(stacked["wv"])[:, :, :, None]],
        axis=3,
    )
    fused = {
        "attn_norm": value(stacked["attn_norm"]),
        "wqkv": wqkv,
        "wo": value(stacked["wo"]).reshape(L, KV, G, K, -1),
        "mlp_norm": value(stacked["mlp_norm"]),
        "w_gate_up": jnp.stack([value(stacked["w_gate"]), value(stacked["w_up"])], axis=2),
        "w_down": value(stacked["w_down"]),
    }
    if config.attention_bias:
        bq = value(stacked["bq"]).reshape(L, KV, G, K)
        fused["bqkv"] = jnp.concatenate([bq, value(stacked["bk"])[:, :, None], value(stacked["bv"])[:, :, None]], axis=2)
    if config.qk_norm:
        fused["q_norm"] = value(stacked["q_norm"])
        fused["k_norm"] = value(stacked["k_norm"])
    layers = tuple({name: w[i] for name, w in fused.items()} for i in range(L))
    return DecodeParams(
        embed=value(params["embed"]),
        layers=layers,
        final_norm=value(params["final_norm"]),
        lm_head=None if config.tie_word_embeddings else value(params["lm_head"]),
    )


def forward(
    params: DecodeParams,
    tokens: jax.Array,
    positions: jax.Array,
    cache: LayerCache,
    write_index: jax.Array,
    *,
    config: DecoderConfig,
    attend_len: int,
    dtype: Any,
    attention: str = "xla",
    cache_spec: PartitionSpec | None = None,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, LayerCache]:
    """Final hidden states of ``[B, T]`` new tokens and the cache with their keys/values.

    Args:
      params: `DecodeParams`.
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 RoPE positions.
      cache: `LayerCache` with buffers ``[B, KV, S, K]``.
      write_index: ``[B]`` int32; row b's tokens go to entries ``[write_index[b],
        write_index[b] + T)`` (entries past S are dropped).
      config: the architecture.
      attend_len: W, static; queries read cache entries ``[0, W)`` only, so every row must
        have ``write_index[b] + T <= W`` for its result to be exact (``W <= S``).
      dtype: compute dtype.
      attention: "xla" (einsums) or "pallas" (GPU kernel; T must be 1).
      cache_spec, mesh: with "pallas" on a mesh of several devices, the cache buffers'
        ``PartitionSpec`` and the mesh: the kernel then runs per shard (`jax.shard_map`),
        slots and kv heads being independent.

    Returns:
      ``(hidden [B, T, D] in dtype, new cache)``.
    """
    chex.assert_rank(tokens, 2)
    chex.assert_equal_shape([tokens, positions])
    B, T = tokens.shape
    chex.assert_shape(write_index, (B,))
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"forward: attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    if attention == "pallas" and T != 1:
        raise ValueError(f"forward: the pallas decode attention takes one token per row, got T={T}")
    if not 0 < attend_len <= cache.max_len:
        raise ValueError(f"forward: attend_len={attend_len} must be in [1, {cache.max_len}]")
    write_pos = write_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    visible = jnp.arange(attend_len)[None, None, :] <= write_pos[:, :, None]  # [B, T, W]
    if attention == "pallas":
        attend = _pallas_decode_attention
        if mesh is not None and mesh.size > 1:
            rows, heads = cache_spec[0], cache_spec[1]
            attend = jax.shard_map(
                attend, mesh=mesh, check_vma=False, out_specs=PartitionSpec(rows, heads),
                in_specs=(PartitionSpec(rows, heads), cache_spec, cache_spec, PartitionSpec(rows)),
            )
        lengths = write_pos[:, 0] + 1

        def attention_fn(q, k, v):
            return attend(q[:, 0], k.astype(dtype), v.astype(dtype), lengths)[:, None]
    else:

        def attention_fn(q, k, v):
            window = (k[:, :, :attend_len].astype(dtype), v[:, :, :attend_len].astype(dtype))
            return grouped_attention(q, *window, visible)

    layer = functools.partial(
        _layer, config=config, dtype=dtype, positions=positions, write_pos=write_pos, attention=attention_fn,
        inv_freq=rope_frequencies(config),
    )
    hidden = jnp.take(params.embed, tokens, axis=0).astype(dtype)
    new_k, new_v = [], []
    for w, k_cache, v_cache in zip(params.layers, cache.k, cache.v, strict=True):
        hidden, k_cache, v_cache = layer(hidden, w, k_cache, v_cache)
        new_k.append(k_cache)
        new_v.append(v_cache)
    hidden = rms_norm(hidden, params.final_norm.astype(dtype), config.rms_norm_eps)
    return hidden, LayerCache(k=tuple(new_k), v=tuple(new_v))


def _layer(h, w, k_cache, v_cache, *, config, dtype, positions, write_pos, attention, inv_freq):
    """One pre-norm block (attention then SwiGLU) that also writes its keys/values.

    Every matmul is a plain 2-D ``[B * T, in] @ [in, out]`` over a reshape of the weight (a
    bitcast): with the heads still split, XLA chose a contraction order that transposed
    ``wo`` (8 MB per layer at 1.7B) on every step.
    """
    eps = config.rms_norm_eps
    B, T, D = h.shape
    KV, K = config.num_kv_heads, config.head_dim
    G = config.num_heads // KV
    w = {name: x.astype(dtype) for name, x in w.items()}

    def matmul(x, weight, out_shape):
        return (x.reshape(B * T, -1) @ weight).reshape(B, T, *out_shape)

    x = rms_norm(h, w["attn_norm"], eps)
    qkv = matmul(x, w["wqkv"].reshape(D, -1), (KV, G + 2, K))
    if config.attention_bias:
        qkv = qkv + w["bqkv"]
    q = qkv[:, :, :, :G].reshape(B, T, KV * G, K)
    k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
    if config.qk_norm:
        q = rms_norm(q, w["q_norm"], eps)
        k = rms_norm(k, w["k_norm"], eps)
    q = apply_rope(q, positions, inv_freq).reshape(B, T, KV, G, K)
    k = apply_rope(k, positions, inv_freq)
    rows = jnp.arange(B)[:, None]
    k_cache = k_cache.at[rows, :, write_pos].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, :, write_pos].set(v.astype(v_cache.dtype), mode="drop")
    out = attention(q, k_cache, v_cache).astype(dtype)  # [B, T, KV, G, K]
    h = h + matmul(out.reshape(B, T, -1), w["wo"].reshape(-1, D), (D,))
    x = rms_norm(h, w["mlp_norm"], eps)
    gate_up = matmul(x, w["w_gate_up"].reshape(D, -1), (2, -1))
    h = h + matmul(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w["w_down"], (D,))
    return h, k_cache, v_cache


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Grouped-query attention of T queries over W cached keys, each key and value read once.

    ``softmax(q k^T / sqrt(K))`` over the visible keys (float32 logits and softmax, as
    ``jax.nn.dot_product_attention``), times v; the G query heads of a kv head share it.

    Args:
      q: ``[B, T, KV, G, K]``.
      k, v: ``[B, KV, W, K]``.
      visible: ``[B, T, W]`` bool, key w is visible to query t.

    Returns:
      ``[B, T, KV, G, K]`` in ``v.dtype``.
    """
    chex.assert_rank([q, k, v, visible], [5, 4, 4, 3])
    logits = jnp.einsum("btngk,bnsk->bngts", q, k, preferred_element_type=jnp.float32)
    logits = logits * np.float32(1.0 / math.sqrt(q.shape[-1]))
    logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bngts,bnsk->btngk", probs, v)


PALLAS_BLOCK = 64  # cache entries per kernel iteration (a sweep on H200 favoured 64)


def _pallas_decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, min_programs: int = 512
) -> jax.Array:
    """One query per row over its first ``lengths[b]`` cache entries (JAX's Pallas GPU kernel).

    ``[B, KV, S, K]`` folds to ``[B * KV, S, K]`` without a copy, so every (row, kv head)
    is a multi-query problem of G heads. The kernel walks its entries in blocks and stops
    at the row's length. Many rows: one program per (row, kv head) reads it all (no
    cross-chunk combine); few rows: S is split into chunks so that enough programs run
    at once. Off GPU it runs in Pallas's interpreter (tests).

    Args:
      q: ``[B, KV, G, K]``; k, v: ``[B, KV, S, K]``; lengths: ``[B]`` int32 visible entries.
      min_programs: split S into the fewest chunks that give at least this many (row, kv
        head, chunk) programs (512 keeps an H100/H200 busy several times over).

    Returns:
      ``[B, KV, G, K]``.
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    B, KV, G, K = q.shape
    S = k.shape[2]
    if S % PALLAS_BLOCK:
        raise ValueError(f"pallas decode attention: the cache length {S} must be a multiple of {PALLAS_BLOCK}")
    blocks = S // PALLAS_BLOCK
    splits = [n for n in range(1, blocks + 1) if blocks % n == 0]
    k_splits = next((n for n in splits if B * KV * n >= min_programs), blocks)
    out = decode_attention.mqa(
        q.reshape(B * KV, G, K),
        k.reshape(B * KV, S, K),
        v.reshape(B * KV, S, K),
        kv_seq_len=jnp.repeat(lengths, KV),
        block_k=PALLAS_BLOCK,
        k_splits=k_splits,
        num_warps=4,
        num_stages=2,
        interpret=jax.default_backend() != "gpu",
    )
    return out.reshape(B, KV, G, K)
