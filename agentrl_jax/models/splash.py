"""Causal attention within segments on TPU: JAX's Pallas splash-attention kernel.

``jax.nn.dot_product_attention`` takes no segment ids, and on TPU its masked route is XLA
with a ``[B, 1, T, T]`` mask. The splash kernel (``jax.experimental.pallas.ops.tpu.
splash_attention``) is a flash-attention kernel that skips the key blocks a causal mask
hides and compares segment ids inside each block, so packed rows (several trajectories
per row, ``train.packing``) and right-padded rows both stay on one fused kernel with no
T^2 buffer. The decoder runs every training forward (no KV cache) through
:func:`splash_attention` when ``attention_impl`` is "splash"; cached prefill and decode
keep their own attention.

The kernel takes one sequence ``[H, T, K]``; it is ``vmap``-ed over the rows. Grouped
query attention is native (query head h reads kv head ``h // (H / KV)``, as
``layers.attention``). The kernel does not scale q. Under a (data, fsdp, tensor) mesh (set
with ``jax.set_mesh``, or the decoder's own ``mesh``) the call is wrapped in ``shard_map``
(XLA cannot partition a Mosaic kernel): rows over the batch axes, heads over tensor.

Off TPU the kernel runs only in Pallas interpret mode (every grid step as XLA ops, orders
of magnitude slower): "splash_interpret" selects that, for tests on CPU. The kernel's
speed on a TPU is unmeasured in this repository (docs/benchmarks.md).

Dimension letters: B batch, T tokens, H query heads, KV key/value heads, K head dim.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from agentrl_jax.sharding import DEFAULT_RULES, MESH_AXES, Rules, logical_to_spec

SPLASH_IMPLS = ("splash", "splash_interpret")
# The name the kernel gives its saved residuals (attention output, logsumexp), kept by the
# "attention_saveable" remat policies (models/remat.py).
RESIDUAL_NAME = "splash_attention_residuals"
# Rows are padded to a multiple of this (the kernel's kv compute block must be a multiple
# of the TPU's 128 lanes); blocks are the largest of these that divides the padded row.
_ROW_MULTIPLE = 128
_BLOCKS = (512, 256, 128)
# The id of that padding: no real token's (real ids are >= 0, masked tokens' >= -T).
_PAD_ID = -(2**31)


def check_backend(implementation: str | None, backend: str | None = None) -> None:
    """Refuse "splash" off TPU: elsewhere the kernel runs only in interpret mode.

    Raises:
      ValueError: naming ``attention_impl`` and the backend.
    """
    backend = jax.default_backend() if backend is None else backend
    if implementation == "splash" and backend != "tpu":
        raise ValueError(
            f"attention_impl='splash' is a TPU Pallas kernel but the JAX backend is {backend!r}; there it "
            "would run in Pallas interpret mode (far too slow to train). Use 'xla' (or 'cudnn' on a GPU); "
            "tests on CPU pass 'splash_interpret'."
        )


def splash_segment_ids(
    batch: int,
    length: int,
    *,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    lengths: jax.Array | None = None,
) -> jax.Array:
    """Per-token ids such that "same id and key <= query" is the decoder's training mask.

    ``lengths`` (right-padded rows): 1 on ``[0, lengths[b])``, 0 on padding. Otherwise the
    given ``segment_ids`` (zeros when None: one segment per row), with every token whose
    ``attention_mask`` is 0 given its own id ``-1 - t``, so it is no real query's key and
    sees only itself: exactly ``layers.packed_causal_mask``. Real segment ids are >= 0.

    Returns:
      ``[B, T]`` int32.
    """
    if lengths is not None:
        if segment_ids is not None or attention_mask is not None:
            raise ValueError("Decoder: pass either lengths or segment_ids/attention_mask, not both")
        chex.assert_shape(lengths, (batch,))
        return (jnp.arange(length)[None, :] < lengths[:, None]).astype(jnp.int32)
    ids = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    chex.assert_shape(ids, (batch, length))
    if attention_mask is not None:
        chex.assert_shape(attention_mask, (batch, length))
        ids = jnp.where(attention_mask.astype(bool), ids, -1 - jnp.arange(length, dtype=jnp.int32)[None, :])
    return ids


def block_sizes(length: int):
    """Forward and backward tiles (the kernel's ``BlockSizes``) for rows of ``length``
    tokens (a multiple of 128).

    The largest of 512 / 256 / 128 that divides the row, for every block (MaxText's default
    is 512 throughout); not tuned on a TPU here.
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if length % _ROW_MULTIPLE:
        raise ValueError(f"splash attention: row length {length} is not a multiple of {_ROW_MULTIPLE}")
    block = next(b for b in _BLOCKS if length % b == 0)
    return splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    interpret: bool = False,
    rules: Rules | None = DEFAULT_RULES,
    mesh: Mesh | None = None,
) -> jax.Array:
    """``softmax(q k^T / sqrt(K) + log mask) v`` with mask "key <= query, same segment id".

    Rows whose length is not a multiple of 128 are padded at the end for the kernel and
    sliced back; causality keeps the padding out of every real query's view.

    Args:
      q: ``[B, T, H, K]``; k, v: ``[B, T, KV, K]``.
      segment_ids: ``[B, T]`` int (:func:`splash_segment_ids`).
      interpret: run the kernel in Pallas interpret mode (any backend; slow).
      rules: logical-axis rules for the ``shard_map`` under a (data, fsdp, tensor) mesh.
      mesh: that mesh when none is set with ``jax.set_mesh`` (which wins when set).

    Returns:
      ``[B, T, H, K]`` in ``q.dtype``.
    """
    chex.assert_rank([q, k, v], 4)
    chex.assert_equal_shape([k, v])
    B, T, H, K = q.shape
    chex.assert_shape(segment_ids, (B, T))
    chex.assert_equal(H % k.shape[2], 0)
    padded = -(-T // _ROW_MULTIPLE) * _ROW_MULTIPLE
    if padded != T:
        pad = ((0, 0), (0, padded - T), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - T)), constant_values=_PAD_ID)
    # [B, T, N, K] -> [B, N, T, K]: the kernel's head-major layout.
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * jnp.asarray(1 / math.sqrt(K), q.dtype), k, v))
    run = functools.partial(_attend_rows, interpret=interpret)
    context = jax.sharding.get_abstract_mesh()
    mesh = context if mesh is None or not context.empty else mesh
    if rules is not None and not mesh.empty and set(MESH_AXES) <= set(mesh.axis_names):
        q_spec = logical_to_spec(("batch", "heads", "sequence", "head_dim"), rules, shape=q.shape, mesh=mesh)
        kv_spec = logical_to_spec(("batch", "kv_heads", "sequence", "head_dim"), rules, shape=k.shape, mesh=mesh)
        if q_spec[1] != kv_spec[1]:
            # Query heads are split over an axis the kv heads cannot be: give every query
            # head its own copy of its kv head, so each shard holds matching groups.
            k, v = (jnp.repeat(x, H // k.shape[1], axis=1) for x in (k, v))
            kv_spec = q_spec
        ids_spec = PartitionSpec(q_spec[0], None)
        run = jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec), out_specs=q_spec,
                            check_vma=False)
    out = run(q, k, v, segment_ids)
    return jnp.swapaxes(out, 1, 2)[:, :T]


def _attend_rows(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, interpret: bool) -> jax.Array:
    """The kernel on ``[B, H, T, K]`` / ``[B, KV, T, K]`` rows (the local shard under a mesh)."""
    # Imported here, as layers.packed_attention imports cuDNN's: the decoder must import on
    # any JAX build, and only this path needs the kernel.
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _, H, T, _ = q.shape
    causal = splash.MultiHeadMask([splash.CausalMask((T, T))] * H)
    kernel = splash.make_splash_mha(
        causal, head_shards=1, q_seq_shards=1, block_sizes=block_sizes(T),
        residual_checkpoint_name=RESIDUAL_NAME, interpret=interpret,
    )
    ids = segment_ids.astype(jnp.int32)
    return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, splash.SegmentIds(q=ids, kv=ids)))(q, k, v, ids)
