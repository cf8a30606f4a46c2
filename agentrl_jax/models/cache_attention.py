"""Attention over a KV cache that first writes the new tokens' keys and values: the functions
`decode.forward`'s layers call, apart from the fused GPU decode kernel's wrapper.

- `xla_attend_and_write`: a dense ``[B, KV, S, K]`` cache; scatter, then `grouped_attention`
  over the first ``attend_len`` entries.
- `paged_xla_attend_and_write`: a pool of pages ``[N, KV, P, K]`` and a page table; scatter
  through the table (`paged_write`), gather each row's window of pages, attend. Used on CPU
  and for the prefill off GPU.
- `paged_pallas_attend_and_write`: the same scatter, then the Pallas GPU prefill kernel
  (`prefill_attention`), which reads each row's pages up to its own reach.
- `paged_tpu_attend_and_write`: one token per row; the same scatter, then the Pallas TPU
  decode kernel (`tpu_decode_attention`), which reads each row's pages up to its length.
- `compact_attend_and_write`: either paged prefill function above for compact tokens (the real
  tokens of the packed rows only): scatter them into the rows, attend and write, gather back.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.models.prefill_attention import (
    prefill_attention as prefill_attention_kernel,
)
from agentrl_jax.models.tpu_decode_attention import paged_decode_attention

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
