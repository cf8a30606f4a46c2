"""The attention step of the rollout engine's forward (`decode.forward`): the QKV projection,
the write of the new tokens' keys and values into the KV cache, and attention over it; every
strategy but the fused GPU decode kernel's (`decode.PallasDecodeAttention`).

- `DenseAttention`: a dense ``[B, KV, S, K]`` cache; `project_qkv`, then
  `xla_attend_and_write`: scatter, then `grouped_attention` over the first ``attend_len`` entries.
- `PagedAttention`: a pool of pages ``[N, KV, P, K]`` and a page table; `project_qkv`, then one of
  - `paged_xla_attend_and_write`: scatter through the table (`paged_write`), gather each row's
    window of pages, attend. Used on CPU and for the prefill off GPU.
  - `paged_pallas_attend_and_write`: the same scatter, then the Pallas GPU prefill kernel
    (`prefill_attention`), which reads each row's pages up to its own reach.
  - `paged_tpu_attend_and_write`: one token per row; the same scatter, then the Pallas TPU
    decode kernel (`tpu_decode_attention`), which reads each row's pages up to its length.
  - `compact_attend_and_write` around either prefill function: compact tokens (the real
    tokens of the packed rows only) scattered into the rows, attended and written, gathered back.
- `ShardSpecs`: on a mesh, the paged functions run per shard (`jax.shard_map`).

Dimension letters: B batch, T tokens, S cache length, W attention window, N pages, P page
size, D width, KV kv heads, G query heads per kv head, K head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.layers import apply_rope, rms_norm
from agentrl_jax.models.prefill_attention import (
    prefill_attention as prefill_attention_kernel,
)
from agentrl_jax.models.tpu_decode_attention import paged_decode_attention, pages_per_block_for

TRASH_PAGE = 0  # see rollout.pages: the page every write that must go nowhere lands on


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


def xla_attend_and_write(write_pos, visible, qkv, k_cache, v_cache, *, attend_len, dtype):
    """Scatter the new keys/values into the cache, then `grouped_attention` over its first ``attend_len`` entries.

    Args:
      write_pos: ``[B, T]`` cache index of each new token (past the end: dropped).
      visible: ``[B, T, W]``.
      qkv: ``[B, T, KV, G + 2, K]``: G query rows, the key row, the value row per kv head.
      k_cache, v_cache: ``[B, KV, S, K]``.

    Returns:
      ``(out [B, T, KV, G, K], k_cache, v_cache)``.
    """
    G = qkv.shape[3] - 2
    q, k, v = qkv[:, :, :, :G], qkv[:, :, :, G], qkv[:, :, :, G + 1]
    rows = jnp.arange(k_cache.shape[0])[:, None]
    k_cache = k_cache.at[rows, :, write_pos].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, :, write_pos].set(v.astype(v_cache.dtype), mode="drop")
    window = (k_cache[:, :, :attend_len].astype(dtype), v_cache[:, :, :attend_len].astype(dtype))
    return grouped_attention(q, *window, visible), k_cache, v_cache


def paged_xla_attend_and_write(write_pos, qkv, k_pool, v_pool, page_table, *, attend_len, dtype,
                               unique_writes: bool = False):
    """`xla_attend_and_write` over a pool of pages: scatter the new keys/values through the page
    table, gather each row's first ``ceil(attend_len / P)`` pages into a window, attend.

    With ``unique_writes`` the tokens at ``write_pos < 0`` (padding) are dropped rather than
    sent to the trash page, and the rest are scattered as unique indices. XLA's GPU scatter
    otherwise has to allow for colliding writes (the trash page takes every padding token's),
    which cost more than the keys' and values' bytes (docs/benchmarks.md, "Prefill"). The
    queries of dropped tokens still attend (their outputs are not used).

    Args:
      write_pos: ``[B, T]`` cache index of each new token (with ``unique_writes``, < 0: not written).
      qkv: ``[B, T, KV, G + 2, K]``.
      k_pool, v_pool: ``[N, KV, P, K]`` pages (local to this shard).
      page_table: ``[B, Tp]`` int32 page ids; entries past a row's pages point at the trash
        page (`rollout.pages.TRASH_PAGE`), and so do writes past the table's end.

    Returns:
      ``(out [B, T, KV, G, K], k_pool, v_pool)``.
    """
    B, _, KV, R, K = qkv.shape
    G = R - 2
    P = k_pool.shape[2]
    k_pool, v_pool = paged_write(write_pos, qkv, k_pool, v_pool, page_table, unique_writes=unique_writes)
    n = -(-attend_len // P)
    pages = page_table[:, :n]

    def window(pool):  # [B, n, KV, P, K] -> [B, KV, n * P, K]
        return pool[pages].transpose(0, 2, 1, 3, 4).reshape(B, KV, n * P, K).astype(dtype)

    visible = jnp.arange(n * P)[None, None, :] <= write_pos[:, :, None]
    return grouped_attention(qkv[:, :, :, :G], window(k_pool), window(v_pool), visible), k_pool, v_pool


def paged_write(write_pos, qkv, k_pool, v_pool, page_table, *, unique_writes: bool = False):
    """The keys/values rows of ``qkv`` scattered through the page table (`paged_xla_attend_and_write`'s
    write): ``(k_pool, v_pool)``."""
    G = qkv.shape[3] - 2
    P, Tp = k_pool.shape[2], page_table.shape[1]
    k, v = qkv[:, :, :, G], qkv[:, :, :, G + 1]
    index = write_pos // P
    page = jnp.take_along_axis(page_table, jnp.clip(index, 0, Tp - 1), axis=1)
    offset = write_pos % P
    if unique_writes:  # padding and writes past the table: an index past the pool, dropped
        page = jnp.where((write_pos >= 0) & (index < Tp), page, k_pool.shape[0])
        write = {"mode": "drop", "unique_indices": True}
    else:
        page, write = jnp.where(index < Tp, page, TRASH_PAGE), {}  # [B, T]
    k_pool = k_pool.at[page, :, offset].set(k.astype(k_pool.dtype), **write)
    v_pool = v_pool.at[page, :, offset].set(v.astype(v_pool.dtype), **write)
    return k_pool, v_pool


def paged_pallas_attend_and_write(write_pos, qkv, k_pool, v_pool, page_table, starts, lengths, *, dtype):
    """`paged_xla_attend_and_write` with the attention in `prefill_attention.prefill_attention`: the
    same scatter (padding dropped, unique indices), then the kernel reads each row's own entries
    ``[0, starts + lengths)`` from the pool (no window copy, no score matrix).

    Args:
      write_pos: ``[B, T]`` cache index of each new token (< 0: padding, not written).
      qkv, k_pool, v_pool, page_table: as `paged_xla_attend_and_write`.
      starts, lengths: ``[B]`` each row's first entry and real tokens.

    Returns:
      ``(out [B, T, KV, G, K] in dtype, k_pool, v_pool)``.
    """
    G = qkv.shape[3] - 2
    k_pool, v_pool = paged_write(write_pos, qkv, k_pool, v_pool, page_table, unique_writes=True)
    out = prefill_attention_kernel(qkv[:, :, :, :G].astype(dtype), k_pool, v_pool, page_table, starts, lengths)
    return out, k_pool, v_pool


def paged_tpu_attend_and_write(write_pos, qkv, k_pool, v_pool, page_table, *, pages_per_block):
    """One token per row: scatter its key/value through the page table as
    `paged_xla_attend_and_write` does, then `tpu_decode_attention.paged_decode_attention` over
    each row's entries ``[0, write_pos[b]]`` read from the pools (no window, no gather).

    Args:
      write_pos: ``[B, 1]`` cache index of the new token (past the table: the trash page).
      qkv: ``[B, 1, KV, G + 2, K]``.
      k_pool, v_pool: ``[N, KV, P, K]`` pages (local to this shard).
      page_table: ``[B, Tp]`` int32 page ids.
      pages_per_block: pages per kernel DMA step (divides Tp).

    Returns:
      ``(out [B, 1, KV, G, K], k_pool, v_pool)``.
    """
    G = qkv.shape[3] - 2
    P, Tp = k_pool.shape[2], page_table.shape[1]
    k_pool, v_pool = paged_write(write_pos, qkv, k_pool, v_pool, page_table)
    q = qkv[:, 0, :, :G]
    lengths = jnp.minimum(write_pos[:, 0] + 1, Tp * P)
    out = paged_decode_attention(q, k_pool, v_pool, lengths, page_table, pages_per_block=pages_per_block)
    return out[:, None], k_pool, v_pool


def compact_attend_and_write(window):
    """``window`` (`paged_xla_attend_and_write` or `paged_pallas_attend_and_write`, arguments bound
    but the arrays) for the N compact tokens of a paged prefill rather than its ``[R, C]`` rows.

    The returned function takes ``(write_pos, qkv, k_pool, v_pool, page_table, token_index,
    *row_args)``: ``qkv [N, KV, G + 2, K]`` holds the compact tokens' projections and
    ``token_index [N]`` int32 where each sits in the rows (flat ``r * C + c``; ``>= R * C``:
    compact padding). It scatters them into zero rows ``[R, C, KV, G + 2, K]`` (the layout's
    padding tokens get zeros; `forward` marks them unwritten through ``write_pos < 0``), runs
    ``window(write_pos, rows, k_pool, v_pool, page_table, *row_args)`` and gathers the outputs of
    the compact tokens back: ``(out [N, KV, G, K], k_pool, v_pool)``, zeros for compact padding.
    The scatter declares its indices unique: the real tokens' are, and the padding's are past the
    rows, dropped (as `paged_write`'s padding pages are).
    """

    def attend(write_pos, qkv, k_pool, v_pool, page_table, token_index, *row_args):
        R, C = write_pos.shape
        rows = jnp.zeros((R * C, *qkv.shape[1:]), qkv.dtype).at[token_index].set(
            qkv, mode="drop", unique_indices=True)
        out, k_pool, v_pool = window(write_pos, rows.reshape(R, C, *qkv.shape[1:]), k_pool, v_pool, page_table,
                                     *row_args)
        out = jnp.take(out.reshape(R * C, *out.shape[2:]), token_index, axis=0, mode="fill", fill_value=0)
        return out, k_pool, v_pool

    return attend


@dataclasses.dataclass(frozen=True)
class ShardSpecs:
    """The ``PartitionSpec``s of the per-shard cache writes and attentions (`jax.shard_map`)."""

    mesh: Mesh
    cache: PartitionSpec  # the cache buffers': rows (pages), kv heads
    per_row: PartitionSpec  # [B] arrays
    table: PartitionSpec  # [B, Tp] page tables, [B, T] write positions
    qkv: PartitionSpec  # the projection: [B, T, KV, G + 2, K], or compacted [N, KV, G + 2, K]

    @classmethod
    def of(cls, mesh: Mesh, cache_spec: PartitionSpec, compact: bool) -> ShardSpecs:
        rows, heads = cache_spec[0], cache_spec[1]
        qkv = PartitionSpec(rows, heads) if compact else PartitionSpec(rows, None, heads)
        return cls(mesh, cache_spec, PartitionSpec(rows), PartitionSpec(rows, None), qkv)

    def shard_map(self, fn: Callable, in_specs: tuple) -> Callable:
        """``fn`` per shard, returning ``(out, k_cache, v_cache)`` sharded like the projection and the cache."""
        return jax.shard_map(fn, mesh=self.mesh, check_vma=False, in_specs=in_specs,
                             out_specs=(self.qkv, self.cache, self.cache))


def project_qkv(x, w, positions, *, config, inv_freq):
    """The QKV projection of ``x [B, T, D]`` (bias, QK-norm, RoPE): ``[B, T, KV, G + 2, K]``."""
    rows, tokens, D = x.shape  # (B, T), or (1, N) compacted
    KV, K = config.num_kv_heads, config.head_dim
    R = config.num_heads // KV + 2
    qkv = (x.reshape(rows * tokens, D) @ w["wqkv"].reshape(D, -1)).reshape(rows, tokens, KV, R, K)
    if config.attention_bias:
        qkv = qkv + w["bqkv"]
    return rotate_and_norm(qkv, w, positions, config=config, inv_freq=inv_freq)


def rotate_and_norm(qkv, w, positions, *, config, inv_freq):
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


@dataclasses.dataclass(frozen=True)
class DenseAttention:
    """A dense cache ``[B, KV, S, K]``: project, scatter the new keys/values at ``write_pos``,
    attend over the first ``attend_len`` entries (`xla_attend_and_write`)."""

    config: DecoderConfig
    dtype: Any
    inv_freq: np.ndarray
    attend_len: int
    write_pos: jax.Array  # [B, T]
    positions: jax.Array  # [B, T] RoPE positions

    def __call__(self, x, w, k_cache, v_cache):
        qkv = project_qkv(x, w, self.positions, config=self.config, inv_freq=self.inv_freq)
        visible = jnp.arange(self.attend_len)[None, None, :] <= self.write_pos[:, :, None]  # [B, T, W]
        return xla_attend_and_write(self.write_pos, visible, qkv, k_cache, v_cache, attend_len=self.attend_len,
                                    dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """A paged cache: project, then ``window`` writes through the page table and attends
    (`cache_attention`'s paged functions, compacted and per shard where asked)."""

    config: DecoderConfig
    inv_freq: np.ndarray
    window: Callable  # (write_pos, qkv, k_pool, v_pool, page_table, *row_args) -> (out, k_pool, v_pool)
    write_pos: jax.Array  # [B, T], < 0: padding, not written
    positions: jax.Array
    page_table: jax.Array
    row_args: tuple  # per-row arrays after the page table
    compact: bool

    @classmethod
    def build(cls, config, dtype, inv_freq, attend_len, write_pos, positions, page_table, specs, *, attention,
              prefill_attention, write_index, write_len, token_index) -> PagedAttention:
        T = write_pos.shape[1]
        if write_len is not None:  # padding tokens write nowhere: mark them past the write window
            write_pos = jnp.where(jnp.arange(T)[None, :] < write_len[:, None], write_pos, -1)
        row_args = ()
        if attention == "pallas_tpu":  # the kernel reads each row's pages up to its own length
            window = functools.partial(paged_tpu_attend_and_write,
                                       pages_per_block=pages_per_block_for(page_table.shape[1]))
        elif prefill_attention == "pallas":
            window = functools.partial(paged_pallas_attend_and_write, dtype=dtype)
            row_args = (write_index, write_len)
        else:
            window = functools.partial(paged_xla_attend_and_write, attend_len=attend_len, dtype=dtype,
                                       unique_writes=write_len is not None)
        compact = token_index is not None
        if compact:  # the compact tokens' projections in and outputs out of the rows, per shard
            window, row_args = compact_attend_and_write(window), (token_index, *row_args)
        if specs is not None:  # the pool's pages are split like the rows: gathers and scatters stay local
            window = specs.shard_map(window, (specs.table, specs.qkv, specs.cache, specs.cache, specs.table)
                                     + (specs.per_row,) * len(row_args))
        return cls(config, inv_freq, window, write_pos, positions, page_table, row_args, compact)

    def __call__(self, x, w, k_cache, v_cache):
        qkv = project_qkv(x, w, self.positions, config=self.config, inv_freq=self.inv_freq)
        if self.compact:  # [N, ...] to the rows and back
            out, k_cache, v_cache = self.window(self.write_pos, qkv[0], k_cache, v_cache, self.page_table,
                                                *self.row_args)
            return out[None], k_cache, v_cache
        return self.window(self.write_pos, qkv, k_cache, v_cache, self.page_table, *self.row_args)
