"""Causal attention of packed prefill rows over a paged KV pool: one Pallas GPU kernel per layer.

The rollout engine's prefill call (`rollout.paged_prefill`) packs pieces of C new tokens,
one sequence each, into rows; row r's tokens sit at cache entries ``[starts[r], starts[r] +
lengths[r])`` and its queries attend over the sequence's pages through the row's page
table. The XLA path (`cache_attention.paged_xla_attend_and_write`) gathers every row's whole window
(the call's longest reach, in pages) into a copy, writes ``[R, KV, G, C, W]`` float32
scores and runs softmax over them: several passes over the window and ~8 kernels per layer
(docs/benchmarks.md, "Prefill").

This kernel reads K/V straight from the pool instead, after the XLA scatter has written the
rows' new keys and values. One program per (row, kv head, query block): the query block is
``block_q`` rows of the row's C x G queries flattened token-major (rows ``t * G + g``), so a
block's rows are contiguous tokens and the row's causal position is its token t. It runs an
online softmax (float32 logits, max, sum and accumulator) over blocks of ``block_k`` cache
entries read through the page table, stopping at the row's own reach (``starts + lengths``,
and no further than its block's last token), not the call's window; the dots run on tensor
cores (``dot``) in the compute dtype. A key block is either part of one page (``block_k``
divides P, a power of two of blocks per page: one table lookup, a contiguous load) or
gathered entry by entry (each entry's page looked up: any page size, so pages of 16 do not
force blocks of 16), as the decode kernel (`decode_attention`) does.

Query t of row r sees entries ``j <= starts[r] + t``. Queries past a row's length (padding
tokens; every query of a row of length 0) see at most the row's real entries and their
outputs are unused; a query block with no real token reads nothing and outputs zeros.

Off GPU the kernel runs in Pallas's interpreter (tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK_Q = 64  # flattened (token, query head) rows per program
BLOCK_K = 64  # cache entries per loop iteration
NUM_WARPS = 4
NUM_STAGES = 2
_MIN_ROWS = 16  # the smallest M of a tensor-core tile


def _kernel(q_ref, start_ref, length_ref, table_ref, k_ref, v_ref, o_ref, *, C, G, block_q, block_k, page_size,
            dtype):
    """One (row, kv head, query block) program.

    Refs: q and o the row's ``[C, G, K]`` queries / outputs of this kv head, start and length
    scalars, table the row's page table ``[Tp]``, k and v every page of this kv head ``[N, P, K]``.
    """
    K, Tp = q_ref.shape[-1], table_ref.shape[0]
    start, length = start_ref[...], length_ref[...]
    c = pl.program_id(2)
    flat = c * block_q + jnp.arange(block_q)  # this block's rows of the flattened [C * G] queries
    token, head = flat // G, flat % G
    live = flat < C * G
    cols = jnp.arange(K)
    q_at = (token[:, None], head[:, None], cols[None, :])
    q = plgpu.load(q_ref.at[q_at], mask=live[:, None], other=0.0).astype(dtype)
    last = jnp.minimum(token, length - 1)  # the row's last real token this query may see
    first_token, last_token = c * block_q // G, (jnp.minimum((c + 1) * block_q, C * G) - 1) // G
    reach = start + jnp.minimum(last_token + 1, length)  # entries [0, reach) hold what the block sees
    num_blocks = jnp.where(first_token < length, pl.cdiv(reach, block_k), 0)
    offsets = jnp.arange(block_k)
    per_page = page_size // block_k  # key blocks per page when a block is part of one
    # (shift and mask of the loop index: Triton's lowering of jnp's // and % on it failed, jax 0.11.2)
    contiguous = page_size % block_k == 0 and per_page & (per_page - 1) == 0
    scale = 1.0 / math.sqrt(K)
    neg = jnp.float32(-1e30)  # finite: exp(neg - m) underflows to 0 without inf - inf

    def load(ref, i, valid):
        """Key block i's ``[block_k, K]`` entries of ``ref``, read through the page table."""
        if contiguous:  # part of one page
            page = table_ref[jnp.minimum(lax.shift_right_logical(i, per_page.bit_length() - 1), Tp - 1)]
            source = ref.at[page, pl.ds(lax.bitwise_and(i, per_page - 1) * block_k, block_k), :]
        else:  # each entry's page looked up
            index = i * block_k + offsets
            pages = plgpu.load(table_ref.at[jnp.minimum(index // page_size, Tp - 1)], mask=valid, other=0)
            source = ref.at[pages[:, None], (index % page_size)[:, None], cols[None, :]]
        return plgpu.load(source, mask=valid[:, None], other=0.0).astype(dtype)

    def body(i, carry):
        o, m, denom = carry
        index = i * block_k + offsets
        valid = index < reach
        visible = index[None, :] <= (start + last)[:, None]  # [block_q, block_k]
        s = plgpu.dot(q, load(k_ref, i, valid).T).astype(jnp.float32) * scale
        s = jnp.where(visible, s, neg)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_next[:, None]), 0.0)
        correction = jnp.exp(m - m_next)
        o = o * correction[:, None] + plgpu.dot(p.astype(dtype), load(v_ref, i, valid)).astype(jnp.float32)
        return o, m_next, denom * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros((block_q, K), jnp.float32), jnp.full((block_q,), neg), jnp.zeros((block_q,), jnp.float32))
    o, _, denom = lax.fori_loop(0, num_blocks, body, init)
    out = o / jnp.where(denom > 0, denom, 1.0)[:, None]  # a block that read nothing: zeros, not NaN
    plgpu.store(o_ref.at[q_at], out.astype(o_ref.dtype), mask=live[:, None])


def _check(q, k_pool, v_pool, page_table, starts, lengths, block_q, block_k, interpret):
    if q.ndim != 5 or k_pool.ndim != 4:
        raise ValueError(f"prefill_attention: q {q.shape} must be [R, C, KV, G, K] and k_pool {k_pool.shape} "
                         "[N, KV, P, K]")
    R, _, KV, _, K = q.shape
    if (k_pool.shape[1], k_pool.shape[3]) != (KV, K) or v_pool.shape != k_pool.shape:
        raise ValueError(f"prefill_attention: pools {k_pool.shape}, {v_pool.shape} do not fit q {q.shape} "
                         "([N, KV, P, K] with q's KV and K)")
    if page_table.ndim != 2 or page_table.shape[0] != R or starts.shape != (R,) or lengths.shape != (R,):
        raise ValueError(f"prefill_attention: page_table {page_table.shape}, starts {starts.shape}, lengths "
                         f"{lengths.shape} must be [R, Tp], [R], [R] with R = {R}")
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        if size < _MIN_ROWS or size & (size - 1):
            raise ValueError(f"prefill_attention: {name} must be a power of two >= {_MIN_ROWS}, got {size}")
    if not interpret and (K & (K - 1) or K < 16):
        raise ValueError(f"prefill_attention: the Triton kernel needs a power-of-two head dim >= 16, got {K}")


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "num_warps", "num_stages", "interpret"))
def prefill_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    starts: jax.Array,
    lengths: jax.Array,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention of R packed rows of C queries over their pages (see the module docstring).

    Args:
      q: ``[R, C, KV, G, K]`` queries (QK-normed and rotated), in the compute dtype.
      k_pool, v_pool: ``[N, KV, P, K]`` pages, already holding the rows' new keys/values.
      page_table: ``[R, Tp]`` int32; row r's entry j lives at entry ``j % P`` of page
        ``page_table[r, j // P]``; every row needs ``starts + lengths <= Tp * P``.
      starts: ``[R]`` int32, the cache entry of each row's first token.
      lengths: ``[R]`` int32, real tokens per row (0: a padding row, which reads nothing).
      block_q: flattened (token, head) query rows per program, a power of two >= 16.
      block_k: cache entries per loop iteration, a power of two >= 16.
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas's interpreter (default: off GPU).

    Returns:
      ``[R, C, KV, G, K]`` in q's dtype; query t of row r attends over entries
      ``j <= starts[r] + min(t, lengths[r] - 1)``.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    _check(q, k_pool, v_pool, page_table, starts, lengths, block_q, block_k, interpret)
    R, C, KV, G, K = q.shape
    N, _, P, _ = k_pool.shape
    block_q = min(block_q, max(_MIN_ROWS, 1 << (C * G - 1).bit_length()))  # no tile bigger than the row
    row = pl.BlockSpec((None, C, None, G, K), lambda r, h, c: (r, 0, h, 0, 0))
    scalar = pl.BlockSpec((None,), lambda r, h, c: (r,))
    pool = pl.BlockSpec((N, None, P, K), lambda r, h, c: (0, h, 0, 0))
    kernel = functools.partial(_kernel, C=C, G=G, block_q=block_q, block_k=block_k, page_size=P, dtype=q.dtype)
    return pl.pallas_call(
        kernel,
        grid=(R, KV, pl.cdiv(C * G, block_q)),
        in_specs=[row, scalar, scalar, pl.BlockSpec((None, page_table.shape[1]), lambda r, h, c: (r, 0)), pool, pool],
        out_specs=row,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_attention",
    )(q, starts.astype(jnp.int32), lengths.astype(jnp.int32), page_table.astype(jnp.int32), k_pool, v_pool)
