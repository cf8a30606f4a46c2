"""The decoder's inference forward: per-layer weights and per-layer KV buffers, layers unrolled.

The trainer's `Decoder` stacks the L layers' weights (``[L, ...]``) and runs them in a
``lax.scan``, and its cache path scatters new keys/values into one ``[L, B, S, KV, K]``
buffer carried through that scan, slices the layer back out and attends over all S
entries of every slot. Decoding one token per slot, that costs several passes over the
whole cache per step (docs/benchmarks.md, "Decode"). This
module is the rollout engine's forward instead:

- `DecodeParams`: the same weights in an inference layout, one dict per layer (a tuple,
  so the L layers unroll in Python and each matmul reads its own buffer). Q, K and V are
  one matrix ``[D, KV, G + 2, K]`` (per kv head: its G query heads, its key, its value),
  gate and up one ``[D, 2, F]``; both keep whole heads / MLP columns on one tensor shard.
- `LayerCache`: L separate k and v buffers ``[B, KV, S, K]``, donated through the
  engine's jitted calls and updated in place; or, with a page table, L pools of pages
  ``[N, KV, P, K]`` (the rollout engine's paged cache: row b's entry t lives at entry
  ``t % P`` of page ``page_table[b, t // P]``, `paged_xla_attend_and_write`).
- `forward`: T tokens per row written at ``[write_index[b], write_index[b] + T)``, query t
  attending to entries ``j <= write_index[b] + t`` among the first ``attend_len`` entries
  (a static window: the caller picks a bucket above every live length). With
  ``attention="xla"`` QK-norm and RoPE run as one XLA pass over the ``[B, T, KV, G + 2, K]``
  projection, a per-row scatter writes the cache and the window is an einsum over
  ``[B, KV, W, K]`` (kv-head major: a batched matmul over ``B * KV``, no repeat of kv
  heads); on GPU XLA copies the window out of the buffer first, which costs about as much
  as the attention itself. With ``attention="pallas"`` (one token per row, the engine's
  decode step on GPU) the QKV projection is computed as `PALLAS_QKV_SPLITS` float32
  partial products and one kernel per layer (`decode_attention.decode_attention`) sums
  them, adds the bias, applies QK-norm and RoPE, writes the new key/value into the cache
  and attends over each row's own filled entries: no window, no scatter, no separate
  normalization or split-K reduction kernels. The paged prefill (a page table and
  ``write_len``) may attend with ``prefill_attention="pallas"`` instead of XLA's window:
  after the same scatter, `prefill_attention.prefill_attention` reads each row's own pages.
  Given ``token_index``, the paged prefill runs compacted: every layer's token-wise work on
  the rows' real tokens only, the attention and cache write on the rows.
  With ``attention="pallas_tpu"`` (one token per row on a paged cache, the engine's decode
  step on TPU) the projection, QK-norm, RoPE and the page scatter are the XLA path's, then
  a Pallas TPU kernel (`tpu_decode_attention.paged_decode_attention`) copies each row's
  pages up to its own length from HBM and attends: no window, no gather.

Numerics follow `Decoder` (float32 RMSNorm statistics, float32 attention logits and
softmax, the same RoPE), so decoding reproduces the trainer's forward.

Dimension letters: B batch, T tokens, S cache length, W attention window, D width, H heads,
KV kv heads, G query heads per kv head, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import Mesh, PartitionSpec

from agentrl_jax.models.cache_attention import (  # noqa: F401 (grouped_attention: re-exported)
    compact_attend_and_write,
    grouped_attention,
    paged_pallas_attend_and_write,
    paged_tpu_attend_and_write,
    paged_xla_attend_and_write,
    xla_attend_and_write,
)
from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.decode_attention import decode_attention
from agentrl_jax.models.layers import apply_rope, rms_norm, rope_frequencies
from agentrl_jax.models.tpu_decode_attention import pages_per_block_for

ATTENTION_IMPLS = ("xla", "pallas", "pallas_tpu")
PREFILL_ATTENTION_IMPLS = ("xla", "pallas")  # "pallas": the GPU kernel of `models.prefill_attention`
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
    page_table: jax.Array | None = None,
    write_len: jax.Array | None = None,
    prefill_attention: str = "xla",
    token_index: jax.Array | None = None,
    row_tokens: int | None = None,
    kernel_programs: int | None = None,
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
      attention: "xla" (einsums), "pallas" (GPU kernel; T must be 1) or "pallas_tpu" (the
        XLA paged write, then the TPU kernel of `tpu_decode_attention`; T must be 1 and the
        cache paged).
      cache_spec, mesh: on a mesh of several devices, the cache buffers' ``PartitionSpec``
        and the mesh: the kernel ("pallas") or, with a page table, the paged cache write and
        attention run per shard (`jax.shard_map`), rows and kv heads being independent and
        every row's pages lying in its own shard of the pool.
      page_table: ``[B, T]`` int32 local page ids: the cache buffers are then pools of pages
        ``[N, KV, P, K]`` and row b's entry t lives at entry ``t % P`` of page
        ``page_table[b, t // P]`` (`paged_xla_attend_and_write`); ``attend_len <= T * P``.
      kernel_programs: with the "pallas" attention, the fewest (row, kv head, chunk) programs
        the kernel runs per shard: each row's entries are split into chunks to reach it
        (`kernel_chunks`; default `PALLAS_MIN_PROGRAMS`).
      write_len: ``[B]`` int32, with a page table: row b's real tokens; the keys/values of its
        padding tokens (``t >= write_len[b]``) are not written anywhere, and the real ones,
        which the caller guarantees land on distinct entries, are scattered as unique indices.
        The padding tokens' hidden states are then meaningless.
      prefill_attention: with a page table and ``write_len`` (the engine's prefill), "xla"
        (`paged_xla_attend_and_write`: a gathered window and einsums) or "pallas" (the same
        scatter, then `prefill_attention.prefill_attention` reads each row's own entries).
      token_index: with a page table and ``write_len`` (and ``attention="xla"``), compact the
        paged prefill to its real tokens: ``tokens`` and ``positions`` are then ``[N]``, the
        real tokens (and padding up to N) of B rows of T = ``row_tokens`` entries, and
        ``token_index [N]`` int32 is where each sits in those rows (flat ``b * T + t``, local to
        the data shard's rows on a mesh; ``>= B * T``: padding). The token-wise parts of every
        layer (embedding, norms, the QKV projection, QK-norm, RoPE, ``wo``, the MLP) run on the
        N tokens; only the attention and the cache write see the ``[B, T]`` rows, which the
        projections are scattered into and the attention's output gathered back from
        (`cache_attention.compact_attend_and_write`). The keys/values written and the real
        tokens' hidden states are those of the rows' layout.
      row_tokens: T, with ``token_index``.

    Returns:
      ``(hidden [B, T, D] in dtype, new cache)``; with ``token_index``, hidden ``[N, D]``
      (padding: meaningless).
    """
    compact = token_index is not None
    if compact:
        if page_table is None or write_len is None or attention != "xla":
            raise ValueError("forward: token_index (the compacted paged prefill) needs a page_table, write_len "
                             "and attention='xla'")
        if row_tokens is None or row_tokens < 1:
            raise ValueError(f"forward: row_tokens must be the rows' width (>= 1) with token_index, got {row_tokens}")
        chex.assert_rank(tokens, 1)
        chex.assert_equal_shape([tokens, positions, token_index])
        B, T = write_index.shape[0], row_tokens
        tokens, positions = tokens[None], positions[None]  # the token-wise parts: one row of the N tokens
    else:
        if row_tokens is not None:
            raise ValueError("forward: row_tokens is the width of the rows of a token_index; pass both or neither")
        chex.assert_rank(tokens, 2)
        chex.assert_equal_shape([tokens, positions])
        B, T = tokens.shape
    chex.assert_shape(write_index, (B,))
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"forward: attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    if attention != "xla" and T != 1:
        raise ValueError(f"forward: the {attention} decode attention takes one token per row, got T={T}")
    if attention == "pallas_tpu" and page_table is None:
        raise ValueError("forward: the pallas_tpu decode attention reads a paged cache; pass a page_table")
    if prefill_attention not in PREFILL_ATTENTION_IMPLS:
        raise ValueError(f"forward: prefill_attention must be one of {PREFILL_ATTENTION_IMPLS}, got {prefill_attention!r}")
    if prefill_attention == "pallas" and (page_table is None or write_len is None or attention != "xla"):
        raise ValueError("forward: prefill_attention='pallas' needs a page_table and write_len (the paged prefill)")
    capacity = cache.max_len if page_table is None else page_table.shape[1] * cache.k[0].shape[2]
    if not 0 < attend_len <= capacity:
        raise ValueError(f"forward: attend_len={attend_len} must be in [1, {capacity}]")
    write_pos = write_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    inv_freq = rope_frequencies(config)
    KV, K = config.num_kv_heads, config.head_dim
    R = config.num_heads // KV + 2
    sharded = mesh is not None and mesh.size > 1
    rows, heads = (cache_spec[0], cache_spec[1]) if sharded else (None, None)
    per_row = PartitionSpec(rows)
    qkv_spec = PartitionSpec(rows, heads) if compact else PartitionSpec(rows, None, heads)
    out_specs = (qkv_spec, cache_spec, cache_spec)
    if attention == "pallas":
        # the QKV split-K sum, bias, QK-norm, RoPE, the cache write and attention all happen in the kernel
        def kernel(table, *args):
            return pallas_attend_and_write(
                *args, inv_freq=inv_freq, eps=config.rms_norm_eps, dtype=dtype, page_table=table,
                min_programs=kernel_programs,
            )

        attend = kernel
        if sharded:  # rows and kv heads are independent (a row's pages are in its shard): the kernel runs per shard
            attend = jax.shard_map(
                kernel, mesh=mesh, check_vma=False, out_specs=out_specs,
                in_specs=(PartitionSpec(rows, None), per_row, per_row, PartitionSpec(None, rows, heads),
                          PartitionSpec(heads), PartitionSpec(), cache_spec, cache_spec),
            )

        def attend_fn(x, w, k_cache, v_cache):
            D = x.shape[-1]
            splits = PALLAS_QKV_SPLITS if D % PALLAS_QKV_SPLITS == 0 else 1
            # [P, B, KV, G + 2, K] partial products over P slices of D, float32
            partials = jnp.einsum(
                "bpd,pdn->pbn", x.reshape(B, splits, D // splits), w["wqkv"].reshape(splits, D // splits, -1),
                preferred_element_type=jnp.float32,
            ).reshape(splits, B, KV, R, K)
            bias = w["bqkv"] if config.attention_bias else None
            norms = (w["q_norm"], w["k_norm"]) if config.qk_norm else ()
            return attend(page_table, write_pos[:, 0], positions[:, 0], partials, bias, norms, k_cache, v_cache)
    else:
        if page_table is None:
            window = functools.partial(xla_attend_and_write, attend_len=attend_len, dtype=dtype)
        else:
            if write_len is not None:  # padding tokens write nowhere: mark them past the write window
                write_pos = jnp.where(jnp.arange(T)[None, :] < write_len[:, None], write_pos, -1)
            row_args = ()  # per-row arguments after the page table
            if attention == "pallas_tpu":  # the kernel reads each row's pages up to its own length
                window = functools.partial(paged_tpu_attend_and_write,
                                           pages_per_block=pages_per_block_for(page_table.shape[1]))
            elif prefill_attention == "pallas":
                window = functools.partial(paged_pallas_attend_and_write, dtype=dtype)
                row_args = (write_index, write_len)
            else:
                window = functools.partial(paged_xla_attend_and_write, attend_len=attend_len, dtype=dtype,
                                           unique_writes=write_len is not None)
            if compact:  # the compact tokens' projections in and outputs out of the rows, per shard
                window, row_args = compact_attend_and_write(window), (token_index, *row_args)
            if sharded:  # the pool's pages are split like the rows: gathers and scatters stay local
                window = jax.shard_map(
                    window, mesh=mesh, check_vma=False, out_specs=out_specs,
                    in_specs=(PartitionSpec(rows, None), qkv_spec, cache_spec, cache_spec,
                              PartitionSpec(rows, None)) + (per_row,) * len(row_args),
                )

        def attend_fn(x, w, k_cache, v_cache):
            rows_x, tokens_x, D = x.shape  # (B, T), or (1, N) compacted
            qkv = (x.reshape(rows_x * tokens_x, D) @ w["wqkv"].reshape(D, -1)).reshape(rows_x, tokens_x, KV, R, K)
            if config.attention_bias:
                qkv = qkv + w["bqkv"]
            qkv = _rotate_and_norm(qkv, w, positions, config=config, inv_freq=inv_freq)
            if page_table is None:
                visible = jnp.arange(attend_len)[None, None, :] <= write_pos[:, :, None]  # [B, T, W]
                return window(write_pos, visible, qkv, k_cache, v_cache)
            if compact:  # [N, ...] to the rows and back
                out, k_cache, v_cache = window(write_pos, qkv[0], k_cache, v_cache, page_table, *row_args)
                return out[None], k_cache, v_cache
            return window(write_pos, qkv, k_cache, v_cache, page_table, *row_args)
    layer = functools.partial(_layer, config=config, dtype=dtype, attend_and_write=attend_fn)
    hidden = jnp.take(params.embed, tokens, axis=0).astype(dtype)
    new_k, new_v = [], []
    for w, k_cache, v_cache in zip(params.layers, cache.k, cache.v, strict=True):
        hidden, k_cache, v_cache = layer(hidden, w, k_cache, v_cache)
        new_k.append(k_cache)
        new_v.append(v_cache)
    hidden = rms_norm(hidden, params.final_norm.astype(dtype), config.rms_norm_eps)
    return hidden[0] if compact else hidden, LayerCache(k=tuple(new_k), v=tuple(new_v))


def _layer(h, w, k_cache, v_cache, *, config, dtype, attend_and_write):
    """One pre-norm block (attention then SwiGLU) that also writes its keys/values.

    Every matmul is a plain 2-D ``[B * T, in] @ [in, out]`` over a reshape of the weight (a
    bitcast): with the heads still split, XLA chose a contraction order that transposed
    ``wo`` (8 MB per layer at 1.7B) on every step.
    """
    eps = config.rms_norm_eps
    B, T, D = h.shape
    w = {name: x.astype(dtype) for name, x in w.items()}

    def matmul(x, weight, out_shape):
        return (x.reshape(B * T, -1) @ weight).reshape(B, T, *out_shape)

    x = rms_norm(h, w["attn_norm"], eps)
    out, k_cache, v_cache = attend_and_write(x, w, k_cache, v_cache)  # QKV projection + attention: [B, T, KV, G, K]
    h = h + matmul(out.reshape(B, T, -1), w["wo"].reshape(-1, D), (D,))
    x = rms_norm(h, w["mlp_norm"], eps)
    gate_up = matmul(x, w["w_gate_up"].reshape(D, -1), (2, -1))
    h = h + matmul(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w["w_down"], (D,))
    return h, k_cache, v_cache


def _rotate_and_norm(qkv, w, positions, *, config, inv_freq):
    """QK-norm and RoPE of the query and key rows of ``qkv [B, T, KV, G + 2, K]``, value row untouched.

    All G + 2 rows go through one elementwise pass (a per-row norm weight, the value row
    selected back), so XLA emits one fusion rather than one per slice of q, k and v.
    """
    B, T, KV, R, K = qkv.shape
    G = R - 2
    is_value = (jnp.arange(R) == G + 1)[:, None]  # [G + 2, 1]
    if config.qk_norm:
        ones = jnp.ones((1, K), qkv.dtype)
        weight = jnp.concatenate([jnp.broadcast_to(w["q_norm"], (G, K)), w["k_norm"][None], ones])
        qkv = jnp.where(is_value, qkv, rms_norm(qkv, weight, config.rms_norm_eps))
    rotated = apply_rope(qkv.reshape(B, T, KV * R, K), positions, inv_freq).reshape(qkv.shape)
    return jnp.where(is_value, qkv, rotated)


PALLAS_BLOCK = 32  # cache entries per kernel iteration (paged: see `kernel_block`)
PALLAS_METHOD = "dot"
PALLAS_WARPS = 4
PALLAS_STAGES = 3
PALLAS_QKV_SPLITS = 4  # the QKV projection as 4 partial products over slices of D, summed in the kernel
PALLAS_MIN_PROGRAMS = 512  # fewer (row, kv head) programs than this: split rows into chunks


def kernel_block(length: int, page_size: int | None = None, preferred: int | None = None) -> int:
    """The kernel's block (cache entries per loop iteration): ``preferred`` (`PALLAS_BLOCK`),
    halved until it divides the cache ``length`` and, with pages, is part of a page or whole
    pages (the kernel then gathers a block over several pages rather than shrinking it)."""
    block = PALLAS_BLOCK if preferred is None else preferred
    while block > 1 and (length % block or (page_size and page_size % block and block % page_size)):
        block //= 2
    return block


def kernel_chunks(programs: int, blocks: int, min_programs: int) -> int:
    """Chunks per (row, kv head): the fewest that give at least ``min_programs`` programs in all,
    at most one per cache block (the kernel splits each row's own entries into that many runs)."""
    return max(1, min(-(-min_programs // programs), blocks))


def pallas_attend_and_write(
    positions, rope_positions, partials, bias, norms, k_cache, v_cache, *, inv_freq, eps, dtype,
    min_programs: int | None = None, page_table=None,
):
    """One token per row through `decode_attention.decode_attention`: the QKV split-K sum, bias,
    QK-norm, RoPE, the cache write and attention in one kernel.

    Args:
      positions: ``[B]`` the new token's cache index.
      rope_positions: ``[B]`` its RoPE position.
      partials: ``[P, B, KV, G + 2, K]`` float32 partial sums of the QKV projection.
      bias: ``[KV, G + 2, K]`` QKV bias, or None.
      norms: ``(q_norm, k_norm)`` weights, or ``()`` without QK-norm.
      k_cache, v_cache: ``[B, KV, S, K]``.
      inv_freq: ``[K / 2]`` RoPE inverse frequencies; eps: the QK-norm epsilon; dtype: the
        compute dtype.
      min_programs: split each row's entries into the fewest chunks that give at least
        this many (row, kv head, chunk) programs (`kernel_chunks`).
      page_table: ``[B, Tp]`` page ids: the caches are then pools ``[N, KV, P, K]`` (see
        `paged_xla_attend_and_write`); the kernel's block is `kernel_block`'s.

    Returns:
      ``(out [B, 1, KV, G, K], k_cache, v_cache)``.
    """
    _, B, KV, _, _ = partials.shape
    if page_table is None:
        S, page_size = k_cache.shape[2], None
        if S % PALLAS_BLOCK:
            raise ValueError(f"pallas decode attention: the cache length {S} must be a multiple of {PALLAS_BLOCK}")
    else:
        page_size = k_cache.shape[2]
        S = page_table.shape[1] * page_size
    block = kernel_block(S, page_size)
    min_programs = PALLAS_MIN_PROGRAMS if min_programs is None else min_programs
    chunks = kernel_chunks(B * KV, S // block, min_programs)
    q_norm, k_norm = (x.astype(dtype) for x in norms) if norms else (None, None)
    out, k_cache, v_cache = decode_attention(
        partials, positions, k_cache, v_cache, bias=bias, rope_positions=rope_positions,
        inv_freq=jnp.asarray(inv_freq, jnp.float32), q_norm=q_norm, k_norm=k_norm, eps=eps, dtype=dtype,
        page_table=page_table, block_k=block, chunks=chunks, method=PALLAS_METHOD, num_warps=PALLAS_WARPS, num_stages=PALLAS_STAGES,
    )
    return out[:, None], k_cache, v_cache
