"""The rollout engine's forward: T new tokens per row through the decoder, writing their keys and
values into a KV cache.

Its `_decoder_block` reads beside the trainer's (`decoder._decoder_block`), step for step:
RMSNorm, attention, ``wo``, RMSNorm, SwiGLU, with the same numerics (float32 RMSNorm
statistics, float32 attention logits and softmax, the same RoPE), so decoding reproduces the
trainer's forward. It differs in layout (`decode_params`: one weight dict per layer, layers
unrolled, QKV and gate/up fused, one cache buffer per layer; every matmul a plain 2-D one) and
in its attention step, which also projects QKV and writes the cache. The caller chooses that
step once, as an `AttentionPlan` (the engine builds one per program kind), and `forward` asks
the plan for this call's strategy before the layers run:

- `DenseAttention` (``attention="xla"``, a dense cache): QK-norm and RoPE as one XLA pass over
  the ``[B, T, KV, G + 2, K]`` projection, a per-row scatter into the cache, and an einsum
  over the window of the first ``attend_len`` entries (kv-head major: a batched matmul over
  ``B * KV``, no repeat of kv heads). On GPU XLA copies the window out of the buffer first,
  which costs about as much as the attention itself.
- `PagedAttention` (a page table): the same projection, then a write through the page table
  and one of three attentions (`cache_attention`): XLA over a gathered window; the Pallas GPU
  prefill kernel (``prefill_attention="pallas"``, `prefill_attention`), which reads each
  row's own pages; or the Pallas TPU decode kernel (``attention="pallas_tpu"``,
  `tpu_decode_attention`), which copies each row's pages up to its length from HBM. Given
  ``token_index`` the paged prefill runs compacted: every layer's token-wise work on the rows'
  real tokens only, the attention and cache write on the rows.
- `PallasDecodeAttention` (``attention="pallas"``, one token per row, the engine's decode
  step on GPU): the QKV projection as `DecodeKernel.qkv_splits` float32 partial products, then one
  kernel per layer (`decode_attention.decode_attention`) sums them, adds the bias, applies
  QK-norm and RoPE, writes the new key/value and attends over each row's own filled entries:
  no window, no scatter, no separate normalization or split-K reduction kernels.

On a mesh of several devices the cache writes and attention of the paged and Pallas
strategies run per shard (`jax.shard_map`): rows and kv heads are independent and every
row's pages lie in its own shard of the pool.

Dimension letters: B batch, T tokens, S cache length, W attention window, D width, H heads,
KV kv heads, G query heads per kv head, K head dim, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from agentrl_jax.models.cache_attention import DenseAttention, PagedAttention, ShardSpecs
from agentrl_jax.models.config import DecoderConfig
from agentrl_jax.models.decode_attention import METHODS, decode_attention
from agentrl_jax.models.decode_params import (  # noqa: F401 (the rollout engine imports its layout from here)
    DecodeParams,
    LayerCache,
    decode_params_axes,
    to_decode_params,
)
from agentrl_jax.models.layers import rms_norm, rope_frequencies

ATTENTION_IMPLS = ("xla", "pallas", "pallas_tpu")
PREFILL_ATTENTION_IMPLS = ("xla", "pallas")  # "pallas": the GPU kernel of `models.prefill_attention`


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
    """The GPU decode kernel's settings (`PallasDecodeAttention`, `decode_attention.decode_attention`);
    `bench/decode.py --kernel` tunes them, an engine takes them as `EngineConfig.decode_kernel`.

    Attributes:
      block_k: cache entries per kernel iteration (paged: see `kernel_block`).
      method: "dot" or "vector" (`decode_attention`).
      warps, stages: Triton's ``num_warps`` and ``num_stages``.
      qkv_splits: the QKV projection as this many float32 partial products over slices of D,
        summed in the kernel (1 where it does not divide D).
      min_programs: fewer (row, kv head) programs than this: split rows into chunks (`kernel_chunks`).
    """

    block_k: int = 32
    method: str = "dot"
    warps: int = 4
    stages: int = 3
    qkv_splits: int = 4
    min_programs: int = 512

    def __post_init__(self):
        for name in ("block_k", "warps", "stages", "qkv_splits", "min_programs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DecodeKernel: {name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.method not in METHODS:
            raise ValueError(f"DecodeKernel: method must be one of {METHODS}, got {self.method!r}")


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """What `forward`'s attention step is, chosen once by its caller (the engine, per program kind):
    the architecture, the compute dtype, the decode and prefill attentions, the GPU kernel's
    settings and, on a mesh of several devices, the mesh and the cache buffers' ``PartitionSpec``
    (the kernel, or with a page table the paged cache write and attention, then run per shard,
    `jax.shard_map`: rows and kv heads are independent and every row's pages lie in its own shard
    of the pool).

    Attributes:
      attention: "xla" (einsums), "pallas" (GPU kernel; one token per row) or "pallas_tpu" (the
        XLA paged write, then the TPU kernel of `tpu_decode_attention`; one token per row, a
        paged cache).
      prefill_attention: with a page table and ``write_len`` (the engine's prefill), "xla"
        (`paged_xla_attend_and_write`: a gathered window and einsums) or "pallas" (the same
        scatter, then `prefill_attention.prefill_attention` reads each row's own entries).
      kernel: the "pallas" attention's `DecodeKernel`.
    """

    config: DecoderConfig
    dtype: Any
    attention: str = "xla"
    prefill_attention: str = "xla"
    kernel: DecodeKernel = DecodeKernel()
    mesh: Mesh | None = None
    cache_spec: PartitionSpec | None = None

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"forward: attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        if self.prefill_attention not in PREFILL_ATTENTION_IMPLS:
            raise ValueError(f"forward: prefill_attention must be one of {PREFILL_ATTENTION_IMPLS}, "
                             f"got {self.prefill_attention!r}")

    def strategy(self, write_pos, positions, *, attend_len, write_index, page_table, write_len, token_index):
        """This call's attention step: `PallasDecodeAttention`, `DenseAttention` or `PagedAttention`."""
        config, dtype = self.config, self.dtype
        inv_freq = rope_frequencies(config)
        multi = self.mesh is not None and self.mesh.size > 1
        specs = ShardSpecs.of(self.mesh, self.cache_spec, token_index is not None) if multi else None
        if self.attention == "pallas":
            return PallasDecodeAttention.build(config, dtype, inv_freq, write_pos, positions, page_table, self.kernel,
                                               specs)
        if page_table is None:
            return DenseAttention(config, dtype, inv_freq, attend_len, write_pos, positions)
        return PagedAttention.build(
            config, dtype, inv_freq, attend_len, write_pos, positions, page_table, specs, attention=self.attention,
            prefill_attention=self.prefill_attention, write_index=write_index, write_len=write_len,
            token_index=token_index,
        )


def forward(
    params: DecodeParams,
    tokens: jax.Array,
    positions: jax.Array,
    cache: LayerCache,
    write_index: jax.Array,
    plan: AttentionPlan,
    *,
    attend_len: int,
    page_table: jax.Array | None = None,
    write_len: jax.Array | None = None,
    token_index: jax.Array | None = None,
    row_tokens: int | None = None,
) -> tuple[jax.Array, LayerCache]:
    """Final hidden states of ``[B, T]`` new tokens and the cache with their keys/values.

    Args:
      params: `DecodeParams`.
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 RoPE positions.
      cache: `LayerCache` with buffers ``[B, KV, S, K]``.
      write_index: ``[B]`` int32; row b's tokens go to entries ``[write_index[b],
        write_index[b] + T)`` (entries past S are dropped).
      plan: the `AttentionPlan`: architecture, compute dtype, attention (a kernel takes T = 1),
        the kernel's settings, the mesh.
      attend_len: W, static; queries read cache entries ``[0, W)`` only, so every row must
        have ``write_index[b] + T <= W`` for its result to be exact (``W <= S``).
      page_table: ``[B, T]`` int32 local page ids: the cache buffers are then pools of pages
        ``[N, KV, P, K]`` and row b's entry t lives at entry ``t % P`` of page
        ``page_table[b, t // P]`` (`paged_xla_attend_and_write`); ``attend_len <= T * P``.
      write_len: ``[B]`` int32, with a page table: row b's real tokens; the keys/values of its
        padding tokens (``t >= write_len[b]``) are not written anywhere, and the real ones,
        which the caller guarantees land on distinct entries, are scattered as unique indices.
        The padding tokens' hidden states are then meaningless.
      token_index: with a page table and ``write_len`` (and the "xla" attention), compact the
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
    _, T = _check_arguments(tokens, positions, cache, write_index, plan, attend_len=attend_len, page_table=page_table,
                            write_len=write_len, token_index=token_index, row_tokens=row_tokens)
    compact = token_index is not None
    if compact:
        tokens, positions = tokens[None], positions[None]  # the token-wise parts: one row of the N tokens
    write_pos = write_index[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    attend_and_write = plan.strategy(write_pos, positions, attend_len=attend_len, write_index=write_index,
                                     page_table=page_table, write_len=write_len, token_index=token_index)
    config, dtype = plan.config, plan.dtype
    block = functools.partial(_decoder_block, config=config, dtype=dtype, attend_and_write=attend_and_write)
    hidden = jnp.take(params.embed, tokens, axis=0).astype(dtype)
    new_k, new_v = [], []
    for w, k_cache, v_cache in zip(params.layers, cache.k, cache.v, strict=True):
        hidden, k_cache, v_cache = block(hidden, w, k_cache, v_cache)
        new_k.append(k_cache)
        new_v.append(v_cache)
    hidden = rms_norm(hidden, params.final_norm.astype(dtype), config.rms_norm_eps)
    return hidden[0] if compact else hidden, LayerCache(k=tuple(new_k), v=tuple(new_v))


def _check_arguments(tokens, positions, cache, write_index, plan, *, attend_len, page_table, write_len, token_index,
                     row_tokens) -> tuple[int, int]:
    """`forward`'s argument rules, one error line each: ``(B, T)`` of the rows."""
    if token_index is not None:
        if page_table is None or write_len is None or plan.attention != "xla":
            raise ValueError("forward: token_index (the compacted paged prefill) needs a page_table, write_len "
                             "and attention='xla'")
        if row_tokens is None or row_tokens < 1:
            raise ValueError(f"forward: row_tokens must be the rows' width (>= 1) with token_index, got {row_tokens}")
        chex.assert_rank(tokens, 1)
        chex.assert_equal_shape([tokens, positions, token_index])
        B, T = write_index.shape[0], row_tokens
    else:
        if row_tokens is not None:
            raise ValueError("forward: row_tokens is the width of the rows of a token_index; pass both or neither")
        chex.assert_rank(tokens, 2)
        chex.assert_equal_shape([tokens, positions])
        B, T = tokens.shape
    chex.assert_shape(write_index, (B,))
    if plan.attention != "xla" and T != 1:
        raise ValueError(f"forward: the {plan.attention} decode attention takes one token per row, got T={T}")
    if plan.attention == "pallas_tpu" and page_table is None:
        raise ValueError("forward: the pallas_tpu decode attention reads a paged cache; pass a page_table")
    if plan.prefill_attention == "pallas" and (page_table is None or write_len is None or plan.attention != "xla"):
        raise ValueError("forward: prefill_attention='pallas' needs a page_table and write_len (the paged prefill)")
    capacity = cache.max_len if page_table is None else page_table.shape[1] * cache.k[0].shape[2]
    if not 0 < attend_len <= capacity:
        raise ValueError(f"forward: attend_len={attend_len} must be in [1, {capacity}]")
    return B, T


def _decoder_block(h, w, k_cache, v_cache, *, config, dtype, attend_and_write):
    """One pre-norm block: ``h + Attn(RMSNorm(h))``, then ``h + SwiGLU(RMSNorm(h))``, the
    attention also writing this layer's keys/values into ``k_cache``, ``v_cache``.

    Every matmul is a plain 2-D ``[B * T, in] @ [in, out]`` over a reshape of the weight (a
    bitcast): with the heads still split, XLA chose a contraction order that transposed
    ``wo`` (8 MB per layer at 1.7B) on every step.

    Returns:
      ``(h [B, T, D], k_cache, v_cache)``.
    """
    cast = {name: value.astype(dtype) for name, value in w.items()}
    eps = config.rms_norm_eps
    B, T, D = h.shape

    def matmul(x, weight, out_shape):
        return (x.reshape(B * T, -1) @ weight).reshape(B, T, *out_shape)

    x = rms_norm(h, cast["attn_norm"], eps)
    out, k_cache, v_cache = attend_and_write(x, cast, k_cache, v_cache)  # QKV projection + attention: [B, T, KV, G, K]
    h = h + matmul(out.reshape(B, T, -1), cast["wo"].reshape(-1, D), (D,))
    x = rms_norm(h, cast["mlp_norm"], eps)
    gate_up = matmul(x, cast["w_gate_up"].reshape(D, -1), (2, -1))  # SwiGLU, gate and up in one matmul
    h = h + matmul(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], cast["w_down"], (D,))
    return h, k_cache, v_cache


@dataclasses.dataclass(frozen=True)
class PallasDecodeAttention:
    """One token per row through the GPU kernel (`pallas_attend_and_write`): the QKV projection as
    float32 partial products here, its sum, bias, QK-norm, RoPE, the cache write and attention there."""

    config: DecoderConfig
    kernel: Callable  # (page_table, write_pos [B], positions [B], partials, bias, norms, k, v) -> (out, k, v)
    qkv_splits: int
    page_table: jax.Array | None
    write_pos: jax.Array  # [B]
    positions: jax.Array  # [B]

    @classmethod
    def build(cls, config, dtype, inv_freq, write_pos, positions, page_table, settings: DecodeKernel,
              specs) -> PallasDecodeAttention:
        def kernel(table, *args):
            return pallas_attend_and_write(
                *args, inv_freq=inv_freq, eps=config.rms_norm_eps, dtype=dtype, page_table=table, settings=settings,
            )

        if specs is not None:  # rows and kv heads are independent (a row's pages are in its shard): per shard
            heads = specs.cache[1]
            kernel = specs.shard_map(kernel, (specs.table, specs.per_row, specs.per_row,
                                              PartitionSpec(None, specs.cache[0], heads), PartitionSpec(heads),
                                              PartitionSpec(), specs.cache, specs.cache))
        return cls(config, kernel, settings.qkv_splits, page_table, write_pos[:, 0], positions[:, 0])

    def __call__(self, x, w, k_cache, v_cache):
        config = self.config
        B, _, D = x.shape
        KV, R = config.num_kv_heads, config.num_heads // config.num_kv_heads + 2
        splits = self.qkv_splits if D % self.qkv_splits == 0 else 1
        # [P, B, KV, G + 2, K] partial products over P slices of D, float32
        partials = jnp.einsum(
            "bpd,pdn->pbn", x.reshape(B, splits, D // splits), w["wqkv"].reshape(splits, D // splits, -1),
            preferred_element_type=jnp.float32,
        ).reshape(splits, B, KV, R, config.head_dim)
        bias = w["bqkv"] if config.attention_bias else None
        norms = (w["q_norm"], w["k_norm"]) if config.qk_norm else ()
        return self.kernel(self.page_table, self.write_pos, self.positions, partials, bias, norms, k_cache, v_cache)


def kernel_block(length: int, page_size: int | None = None, preferred: int = DecodeKernel.block_k) -> int:
    """The kernel's block (cache entries per loop iteration): ``preferred`` (`DecodeKernel.block_k`),
    halved until it divides the cache ``length`` and, with pages, is part of a page or whole
    pages (the kernel then gathers a block over several pages rather than shrinking it)."""
    block = preferred
    while block > 1 and (length % block or (page_size and page_size % block and block % page_size)):
        block //= 2
    return block


def kernel_chunks(programs: int, blocks: int, min_programs: int) -> int:
    """Chunks per (row, kv head): the fewest that give at least ``min_programs`` programs in all,
    at most one per cache block (the kernel splits each row's own entries into that many runs)."""
    return max(1, min(-(-min_programs // programs), blocks))


def pallas_attend_and_write(
    positions, rope_positions, partials, bias, norms, k_cache, v_cache, *, inv_freq, eps, dtype,
    settings: DecodeKernel = DecodeKernel(), page_table=None,
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
      settings: the kernel's `DecodeKernel`: its block, method, warps and stages, and
        ``min_programs``: split each row's entries into the fewest chunks that give at least
        this many (row, kv head, chunk) programs (`kernel_chunks`).
      page_table: ``[B, Tp]`` page ids: the caches are then pools ``[N, KV, P, K]`` (see
        `paged_xla_attend_and_write`); the kernel's block is then `kernel_block`'s.

    Returns:
      ``(out [B, 1, KV, G, K], k_cache, v_cache)``.
    """
    _, B, KV, _, _ = partials.shape
    if page_table is None:
        S, page_size = k_cache.shape[2], None
        if S % settings.block_k:
            raise ValueError(f"pallas decode attention: the cache length {S} must be a multiple of {settings.block_k}")
    else:
        page_size = k_cache.shape[2]
        S = page_table.shape[1] * page_size
    block = kernel_block(S, page_size, settings.block_k)
    chunks = kernel_chunks(B * KV, S // block, settings.min_programs)
    q_norm, k_norm = (x.astype(dtype) for x in norms) if norms else (None, None)
    out, k_cache, v_cache = decode_attention(
        partials, positions, k_cache, v_cache, bias=bias, rope_positions=rope_positions,
        inv_freq=jnp.asarray(inv_freq, jnp.float32), q_norm=q_norm, k_norm=k_norm, eps=eps, dtype=dtype,
        page_table=page_table, block_k=block, chunks=chunks, method=settings.method, num_warps=settings.warps,
        num_stages=settings.stages,
    )
    return out[:, None], k_cache, v_cache
