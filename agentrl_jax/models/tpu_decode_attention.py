"""Paged decode attention on TPU: one Pallas (Mosaic) kernel reading each slot's pages up to its length.

The engine's XLA decode path gathers every slot's window of pages, padded to the longest
slot, into ``[B, KV, W, K]`` before attending. This kernel reads the rollout engine's page
pools ``[N, KV, P, K]`` (`models.decode.LayerCache`) in place instead: one program per
(slot, kv head) walks that slot's page table and copies only the pages below its own
length from HBM to VMEM, so a short slot costs its own pages, not the longest slot's.

Per program:

- the page table and lengths are scalar-prefetched into SMEM, so page ids are known
  before any copy starts;
- the pages are read in blocks of ``pages_per_block`` pages; a block is
  ``pages_per_block`` async copies of one page of one kv head (``pool[page, head]``, a
  contiguous ``[P, K]`` tile, the same in our page-major pool as in a head-major one) into
  one half of a two-slot VMEM buffer, while the other half is being attended (double
  buffering: block ``i + 1`` is in flight during block ``i``'s compute);
- the G query heads of the kv head attend with an online (flash) softmax in float32: the
  running max, the running sum and the ``[G, K]`` accumulator are the loop's carry. Keys
  and values stay in the pool's dtype in HBM and VMEM and are widened to float32 for the
  dots (no bf16 cast of a float32 pool).

Nothing is read outside the pool: page ids are clamped to ``[0, N)`` and table columns to
``[0, Tp)``, and lengths to ``[0, Tp * P]``; a slot of length 0 runs no block and returns
zeros. Entries of the last block past the slot's length are masked out of the logits and
their values zeroed (a page's tail may hold anything).

The kernel only attends: the caller writes the new token's key/value through the page
table first (`models.cache_attention.paged_xla_attend_and_write`'s scatter), and counts it in
``lengths``.

Off TPU it runs in Pallas's TPU interpreter (tests), which simulates the DMAs and
semaphores but does not check Mosaic's layout rules; `tpu_kernel_fits` states the shapes
expected to lower on a TPU.

Dimension letters: B slots, KV kv heads, G query heads per kv head, K head dim, N pages,
P page size, Tp pages per slot in the table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DEFAULT_PAGES_PER_BLOCK = 4  # pages per DMA step (shrunk to a divisor of Tp)
_LANES = 128  # the minor tile dimension of a TPU vreg


def tpu_kernel_fits(head_dim: int, page_size: int, cache_dtype) -> bool:
    """Whether the kernel's tiles lower cleanly on a TPU: the head dim a multiple of the 128
    lanes and a page a whole number of sublane tiles of the cache dtype (8 rows of 32 bits,
    so 16 rows of bf16), so a ``[pages, P, K]`` block reshapes to ``[pages * P, K]`` freely."""
    rows = 8 * (4 // jnp.dtype(cache_dtype).itemsize)
    return head_dim % _LANES == 0 and page_size % rows == 0


def pages_per_block_for(table_width: int, preferred: int = DEFAULT_PAGES_PER_BLOCK) -> int:
    """The largest divisor of the table's ``table_width`` pages not above ``preferred`` (a
    block never straddles the table's end)."""
    block = max(1, min(preferred, table_width))
    while table_width % block:
        block -= 1
    return block


def _kernel(lengths_ref, table_ref, q_ref, k_hbm, v_hbm, out_ref, k_buf, v_buf, sems, *,
            pages_per_block, table_width, num_pages):
    """One (slot, kv head) program: ``out[G, K] = softmax(q k^T / sqrt(K)) v`` over the slot's entries.

    Refs: lengths [B] and the flattened table [B * Tp] (SMEM, prefetched); q [G, K] float32;
    k/v pools [N, KV, P, K] left in HBM; out [G, K] float32; k/v VMEM buffers
    [2, pages_per_block, P, K]; DMA semaphores [2 (k, v), 2 (buffer half)].
    """
    b, h = pl.program_id(0), pl.program_id(1)
    page_size, head_dim = k_hbm.shape[2], k_hbm.shape[3]
    block = pages_per_block * page_size
    length = jnp.clip(lengths_ref[b], 0, table_width * page_size)
    num_blocks = (length + block - 1) // block

    def copies(i, half):
        """The 2 * pages_per_block page copies of block ``i`` into buffer half ``half``."""
        out = []
        for j in range(pages_per_block):
            column = jnp.minimum(i * pages_per_block + j, table_width - 1)
            page = jnp.clip(table_ref[b * table_width + column], 0, num_pages - 1)
            for kind, (pool, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                out.append(pltpu.make_async_copy(pool.at[page, h], buf.at[half, j], sems.at[kind, half]))
        return out

    @pl.when(num_blocks > 0)
    def _():
        for copy in copies(0, 0):
            copy.start()

    q = q_ref[...]
    G = q.shape[0]
    scale = jnp.float32(1.0 / head_dim ** 0.5)

    def body(i, carry):
        running_max, running_sum, acc = carry
        half = i % 2

        @pl.when(i + 1 < num_blocks)
        def _():
            for copy in copies(i + 1, 1 - half):
                copy.start()

        for copy in copies(i, half):
            copy.wait()
        k = k_buf[half].reshape(block, head_dim).astype(jnp.float32)
        v = v_buf[half].reshape(block, head_dim).astype(jnp.float32)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32) * scale  # [G, block]
        logits = jnp.where(i * block + lax.broadcasted_iota(jnp.int32, (G, block), 1) < length, logits, -jnp.inf)
        new_max = jnp.maximum(running_max, logits.max(axis=1, keepdims=True))  # finite: entry i * block is visible
        probs = jnp.exp(logits - new_max)
        rescale = jnp.exp(running_max - new_max)
        v = jnp.where(i * block + lax.broadcasted_iota(jnp.int32, (block, head_dim), 0) < length, v, 0.0)
        update = lax.dot_general(probs, v, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        return new_max, rescale * running_sum + probs.sum(axis=1, keepdims=True), rescale * acc + update

    init = (jnp.full((G, 1), -jnp.inf, jnp.float32), jnp.zeros((G, 1), jnp.float32),
            jnp.zeros((G, head_dim), jnp.float32))
    _, total, acc = lax.fori_loop(0, num_blocks, body, init)
    out_ref[...] = jnp.where(total > 0, acc / jnp.where(total > 0, total, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "interpret"))
def paged_decode_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    *,
    pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> jax.Array:
    """Grouped-query attention of one query token per slot over its paged cache entries.

    ``out[b, n, g] = softmax_j(q[b, n, g] . k[b, n, j] / sqrt(K)) v[b, n, j]`` over the
    slot's entries ``j < lengths[b]``, entry j of slot b being entry ``j % P`` of page
    ``page_table[b, j // P]`` of kv head n (float32 logits, softmax and accumulation).

    Args:
      q: ``[B, KV, G, K]`` queries (any float dtype; widened to float32).
      k_pool, v_pool: ``[N, KV, P, K]`` pages, read in their own dtype.
      lengths: ``[B]`` int32 entries per slot, the new token's included (0: an inactive
        slot, whose output is zeros).
      page_table: ``[B, Tp]`` int32 page ids.
      pages_per_block: pages per DMA step, static; must divide Tp (`pages_per_block_for`).
      interpret: run in Pallas's TPU interpreter (default: off TPU), or its settings
        (`pltpu.InterpretParams`, e.g. race detection).

    Returns:
      ``[B, KV, G, K]`` in ``q.dtype``.
    """
    B, KV, G, K = q.shape
    N, _, P, _ = k_pool.shape
    Tp = page_table.shape[1]
    if k_pool.shape != v_pool.shape or k_pool.shape[1] != KV or k_pool.shape[3] != K:
        raise ValueError(f"paged_decode_attention: pools {k_pool.shape}, {v_pool.shape} must both be "
                         f"[N, KV={KV}, P, K={K}] for queries {q.shape}")
    if page_table.shape[0] != B or lengths.shape != (B,):
        raise ValueError(f"paged_decode_attention: page_table {page_table.shape} and lengths {lengths.shape} "
                         f"must have {B} rows")
    if not 0 < pages_per_block <= Tp or Tp % pages_per_block:
        raise ValueError(f"paged_decode_attention: pages_per_block={pages_per_block} must divide the "
                         f"table's {Tp} pages")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if interpret is True:
        interpret = pltpu.InterpretParams()
    # q as [B, KV * G, 1, K] (a (G, K) block over a unit second-minor dim): with G < 8 the
    # block would otherwise be a partial (8, 128) tile of the array
    query_spec = pl.BlockSpec((None, G, None, K), lambda b, h, *_: (b, h, 0, 0))
    buffer = pltpu.VMEM((2, pages_per_block, P, K), k_pool.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, pages_per_block=pages_per_block, table_width=Tp, num_pages=N),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, KV),
            in_specs=[query_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=query_spec,
            scratch_shapes=[buffer, pltpu.VMEM((2, pages_per_block, P, K), v_pool.dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct((B, KV * G, 1, K), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(lengths.astype(jnp.int32), page_table.reshape(-1).astype(jnp.int32),
      q.astype(jnp.float32).reshape(B, KV * G, 1, K), k_pool, v_pool)
    return out.reshape(B, KV, G, K).astype(q.dtype)
