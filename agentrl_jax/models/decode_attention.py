"""Decode attention that also finishes the QKV projection and writes the cache: one Pallas GPU kernel per layer.

One decode step per row. Per (row, kv head) the kernel takes the QKV projection's G + 2
rows (G queries, the new key, the new value), optionally as float32 split-K partial sums
plus a bias, and

- finishes them: sums the partials and adds the bias (rounded to the model dtype like the
  matmul's output), then QK-norm and RoPE (`rms_norm`, `apply_rope`) on the query and
  key rows, from gathered loads (rotate-half is a column permutation of the same row);
- writes the new key and value into cache entry ``positions[b]`` of the aliased, donated
  ``[B, KV, S, K]`` buffers (dropped past the end, as ``.at[].set(mode="drop")``);
- attends the G queries over entries ``[0, positions[b])`` read straight from the buffers
  (contiguous ``[S, K]`` per kv head) in blocks of ``block_k``, plus the new entry, which
  seeds the online softmax from registers. Loads are masked to entries before
  ``positions[b]``, so the write never races a read.

So the engine's step has no split-K reduction, no QK-norm/RoPE pass, no scatter into the
cache and no combine after the kernel: 6 fewer kernels per layer than XLA + JAX's
``pallas.ops.gpu.decode_attention`` (docs/benchmarks.md, "Decode"). One program per (row, kv head)
when there are many rows; with few rows, or rows of ragged lengths, each row's own entries
are split evenly into chunks of whole blocks (more, smaller programs keep the SMs busy and
even out long and short rows) whose float32 partial results a few XLA ops combine. A chunk
with no entries (a short row's upper chunks, an idle row's) stores an empty partial and
skips the projection and the loads.

Two ways to compute a block's logits and outputs: ``"dot"`` (``tl.dot`` on the tensor
cores with the G heads padded to a 16-row tile; the faster one on an H200, docs/benchmarks.md
"Decode") and ``"vector"`` (elementwise multiply and reduce on the CUDA cores, one query head
at a time, probabilities kept in float32). Logits, softmax and accumulation are float32.

Paged caches: with a ``page_table`` the k/v buffers are pools of pages ``[N, KV, P, K]``
and each program reads its row's blocks through the table and writes the new entry through
it; the loop, masks and softmax are the same. A block is either part of one page
(``block_k`` divides P: one table lookup per block, a contiguous load) or several whole
pages (P divides ``block_k``: a gathered load, each entry's page looked up), so the block,
which sets the loop's trip count and the tensor-core tile, need not shrink with the page.

The program itself is `decode_attention_kernel.program`; this module checks the inputs, lays
out the blocks and combines the chunks. Off GPU the kernel runs in Pallas's interpreter (tests).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from agentrl_jax.models.decode_attention_kernel import DOT_ROWS, program

METHODS = ("vector", "dot")


def _check_inputs(qkv, positions, k_cache, v_cache, page_table, bias, q_norm, k_norm, *, block_k, chunks,
                  method) -> tuple[int, int]:
    """`decode_attention`'s shape and argument rules, one error line each: ``(page_size, S)``
    (page size 0 without a page table)."""
    if method not in METHODS:
        raise ValueError(f"decode_attention: method must be one of {METHODS}, got {method!r}")
    B, KV, R, K = qkv.shape[-4:]
    G = R - 2
    if page_table is None:
        page_size, S = 0, k_cache.shape[2]
        cache_shape_ok = k_cache.shape == (B, KV, S, K)
    else:
        page_size = k_cache.shape[2]
        S = page_table.shape[-1] * page_size
        cache_shape_ok = k_cache.ndim == 4 and k_cache.shape[1:] == (KV, page_size, K) and page_table.shape[0] == B
        if page_size % block_k and block_k % page_size:
            raise ValueError(f"decode_attention: the page size {page_size} and block_k={block_k} must divide one "
                             "another (a block is part of a page or whole pages)")
    if G < 1 or not cache_shape_ok or v_cache.shape != k_cache.shape or positions.shape != (B,):
        raise ValueError(
            f"decode_attention: qkv {qkv.shape} ([B, KV, G + 2, K]), positions {positions.shape}, caches "
            f"{k_cache.shape}, {v_cache.shape} ([B, KV, S, K], or pages [N, KV, P, K] with a page table) "
            "do not fit together"
        )
    if bias is not None and bias.shape != (KV, R, K):
        raise ValueError(f"decode_attention: bias {bias.shape} must be [KV, G + 2, K] = {(KV, R, K)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("decode_attention: pass both q_norm and k_norm, or neither")
    if S % block_k or chunks < 1:
        raise ValueError(f"decode_attention: cache length {S} must be a multiple of block_k={block_k}, and "
                         f"chunks={chunks} at least 1")
    if method == "dot" and G > DOT_ROWS:
        raise ValueError(f"decode_attention: method 'dot' takes at most {DOT_ROWS} query heads per kv head")
    return page_size, S


@functools.partial(
    jax.jit, static_argnames=("eps", "dtype", "block_k", "chunks", "method", "num_warps", "num_stages", "interpret"),
    donate_argnums=(2, 3),
)
def decode_attention(  # long: argument docs and the pallas_call's block specs, which read best side by side
    qkv: jax.Array,
    positions: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    page_table: jax.Array | None = None,
    bias: jax.Array | None = None,
    rope_positions: jax.Array | None = None,
    inv_freq: jax.Array | None = None,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    eps: float = 1e-6,
    dtype: Any = None,
    block_k: int = 64,
    chunks: int = 1,
    method: str = "dot",
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write one new key/value per row into the cache and attend over the row's entries.

    Args:
      qkv: ``[B, KV, G + 2, K]``: per kv head its G queries, then the new key, then the new
        value (the QKV projection's output); or ``[P, B, KV, G + 2, K]`` float32 partial
        sums of a split-K projection, which the kernel adds up (and rounds to ``dtype``).
      positions: ``[B]`` int32; the new entry goes to index ``positions[b]`` (dropped if
        ``>= S``) and row b attends over entries ``[0, positions[b]]``.
      k_cache, v_cache: ``[B, KV, S, K]``, donated; S a multiple of ``block_k``.
        With ``page_table``: pools of pages ``[N, KV, P, K]`` (P a multiple or a divisor of ``block_k``).
      page_table: ``[B, T]`` int32, row b's cache entry t lives at entry ``t % P`` of page
        ``page_table[b, t // P]``; S = T * P. Rows that must not write anywhere real point
        every entry at a scratch page (the engine's trash page).
      bias: ``[KV, G + 2, K]`` added to the projection (attention bias), or None.
      rope_positions: ``[B]`` RoPE positions (default: ``positions``); used with inv_freq.
      inv_freq: ``[K / 2]`` float32 RoPE inverse frequencies: queries and key are rotated
        in the kernel (``apply_rope``'s half-split layout). None: qkv is already rotated.
      q_norm, k_norm: ``[K]`` QK-norm weights (RMSNorm of each query / key head before
        RoPE, as `rms_norm`), both or neither.
      eps: the QK-norm epsilon.
      dtype: the model's compute dtype (default: qkv's; required with partials).
      block_k: cache entries per loop iteration.
      chunks: programs per (row, kv head), each over a ``1 / chunks`` share of the row's own
        entries (whole blocks; a row shorter than ``chunks`` blocks leaves some empty); more
        than one adds a float32 combine in XLA (for few rows, or rows of ragged lengths).
      method: "dot" or "vector" (see the module docstring).
      num_warps, num_stages: Triton launch parameters.
      interpret: run in Pallas's interpreter (default: off GPU).

    Returns:
      ``(out [B, KV, G, K] in dtype, k_cache, v_cache)``.
    """
    partials = qkv.shape[0] if qkv.ndim == 5 else 0
    if partials and dtype is None:
        raise ValueError("decode_attention: pass the model dtype with split-K partials")
    dtype = jnp.dtype(qkv.dtype if dtype is None else dtype)
    B, KV, R, K = qkv.shape[-4:]
    G = R - 2
    page_size, S = _check_inputs(qkv, positions, k_cache, v_cache, page_table, bias, q_norm, k_norm,
                                 block_k=block_k, chunks=chunks, method=method)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret and (K & (K - 1) or K < 16):
        raise ValueError(f"decode_attention: the Triton kernel needs a power-of-two head dim >= 16, got {K}")
    normalize = chunks == 1
    rows = DOT_ROWS if method == "dot" else G  # the output block's query rows

    def head(*tail):  # a block of one (row, kv head); tail: the trailing block dims
        return pl.BlockSpec((None, None, *tail), lambda b, h, c: (b, h) + (0,) * len(tail))

    def part(*tail):  # a chunk's own output block
        return pl.BlockSpec((None, None, None, *tail), lambda b, h, c: (c, b, h) + (0,) * len(tail))

    cache_shape = jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)
    if page_size:  # every page of one kv head: the program finds its row's entries through the page table
        num_pages = k_cache.shape[0]
        cache_spec = pl.BlockSpec((num_pages, None, page_size, K), lambda b, h, c: (0, h, 0, 0))
    else:
        cache_spec = head(S, K)
    if normalize:
        out_specs = [cache_spec, cache_spec, head(rows, K)]
        out_shape = [cache_shape, cache_shape, jax.ShapeDtypeStruct((B, KV, G, K), dtype)]
    else:
        out_specs = [cache_spec, cache_spec, part(rows, K), part(rows), part(rows)]
        out_shape = [cache_shape, cache_shape] + [
            jax.ShapeDtypeStruct((chunks, B, KV, G, *tail), jnp.float32) for tail in ((K,), (), ())
        ]
    rope, norm = inv_freq is not None, q_norm is not None
    kernel = functools.partial(program, G=G, block_k=block_k, chunks=chunks, method=method, normalize=normalize,
                               partials=partials, bias=bias is not None, rope=rope, norm=norm, eps=eps, dtype=dtype,
                               page_size=page_size, length=S)
    per_row = pl.BlockSpec((None,), lambda b, h, c: (b,))
    whole = pl.BlockSpec((K,), lambda b, h, c: (0,))
    if partials:
        qkv_spec = pl.BlockSpec((partials, None, None, R, K), lambda b, h, c: (0, b, h, 0, 0))
    else:
        qkv_spec = head(R, K)
    inputs, in_specs = [qkv, positions.astype(jnp.int32)], [qkv_spec, per_row]
    if page_size:
        inputs.append(page_table.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((None, page_table.shape[-1]), lambda b, h, c: (b, 0)))
    if bias is not None:
        inputs.append(bias)
        in_specs.append(pl.BlockSpec((None, R, K), lambda b, h, c: (h, 0, 0)))
    if rope:
        rope_positions = positions if rope_positions is None else rope_positions
        freq = jnp.concatenate([inv_freq, inv_freq]).astype(jnp.float32)
        inputs += [rope_positions.astype(jnp.int32), freq]
        in_specs += [per_row, whole]
    if norm:
        inputs += [q_norm, k_norm]
        in_specs += [whole, whole]
    cache_index = len(inputs)
    outs = pl.pallas_call(
        kernel,
        grid=(B, KV, chunks),
        in_specs=in_specs + [cache_spec, cache_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={cache_index: 0, cache_index + 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="decode_attention",
    )(*inputs, k_cache, v_cache)
    if normalize:
        k_cache, v_cache, out = outs
        return out, k_cache, v_cache
    k_cache, v_cache, o, m, denom = outs
    return _combine(o, m, denom).astype(dtype), k_cache, v_cache


def _combine(o, m, denom):
    """The chunks' float32 partials ``o [C, B, KV, G, K]``, ``m``, ``denom [C, B, KV, G]`` combined
    into one softmax-weighted output, as the single-chunk kernel normalizes its own."""
    m_all = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_all)  # [chunks, B, KV, G]; empty chunks have denom = 0
    return jnp.sum(o * weight[..., None], axis=0) / jnp.sum(denom * weight, axis=0)[..., None]
