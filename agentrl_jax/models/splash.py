"""Causal attention within the segments of packed rows on TPU: JAX's Pallas splash attention.

``jax.experimental.pallas.ops.tpu.splash_attention`` is a flash-attention kernel for TPUs
that takes segment ids: query t sees key s iff ``s <= t`` (a static causal mask, whose fully
masked blocks it skips) and both carry the same id. Grouped-query attention runs its
multi-query form once per kv head (``vmap``), over that head's H / KV query heads.

Off TPU the kernel runs in Pallas's interpreter, which is how the tests check it against the
XLA segment mask (values and gradients); it has not run on a TPU in this repository yet.
Under a (data, fsdp, tensor) mesh it runs per shard (``shard_map``: batch over the data
axes, heads over tensor, as the decoder's activation rules place them), since XLA cannot
partition a Pallas kernel. The mesh is the one set with ``jax.set_mesh``, else the decoder's
own (``Decoder(mesh=...)``, for calls outside ``sharding.under_mesh``). Rows whose length is not a
multiple of 128 are padded for the kernel. The kernel names its saved residuals (output,
logsumexp) ``RESIDUAL_NAME``, which the "attention_saveable" remat policies keep
(``models/remat.py``).

Dimension letters: B batch, T tokens, H query heads, KV kv heads, G = H / KV, K head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from agentrl_jax.sharding import DEFAULT_RULES, MESH_AXES, Rules, logical_to_spec

BLOCKS = (512, 256, 128)  # kernel block sizes tried, largest first (TPU lanes: multiples of 128)
# The name the kernel gives its saved residuals, kept by remat's "attention_saveable" policies.
RESIDUAL_NAME = "splash_attention_residuals"


def _block(length: int) -> int:
    for block in BLOCKS:
        if length % block == 0:
            return block
    raise ValueError(f"splash attention needs a row length divisible by 128, got {length} "
                     "(algorithm.pack_row_tokens, or the padded row length)")


def _local(q, k, v, segment_ids, *, interpret: bool):
    """Splash attention of one shard: q ``[B, T, H, K]``, k, v ``[B, T, KV, K]``, ids ``[B, T]``."""
    # imported here: the Pallas TPU package is needed only when this path runs
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    B, T, H, K = q.shape
    KV = k.shape[2]
    G = H // KV
    block = _block(T)
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                  block_kv_dq=block)
    mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((T, T)) for _ in range(G)])
    kernel = kernel_lib.make_splash_mqa_single_device(mask=mask, block_sizes=sizes, interpret=interpret,
                                                      residual_checkpoint_name=RESIDUAL_NAME)
    scale = jnp.asarray(K ** -0.5, q.dtype)
    q_heads = (q * scale).reshape(B, T, KV, G, K).transpose(0, 2, 3, 1, 4)  # head h = kv * G + g
    k_heads, v_heads = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B, KV, T, K]

    def one_row(q_row, k_row, v_row, ids):
        segments = kernel_lib.SegmentIds(q=ids, kv=ids)
        return jax.vmap(lambda qh, kh, vh: kernel(qh, kh, vh, segment_ids=segments))(q_row, k_row, v_row)

    out = jax.vmap(one_row)(q_heads, k_heads, v_heads, segment_ids)  # [B, KV, G, T, K]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, K)


def splash_packed_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    interpret: bool | None = None,
    rules: Rules | None = DEFAULT_RULES,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Causal attention within segments (ids 1, 2, ...; 0 = padding) on the splash kernel.

    Padding queries attend to padding keys only (finite, and never seen by a real query);
    their outputs are set to 0, as on the cuDNN path (``layers.packed_attention``).

    Args:
      q: ``[B, T, H, K]``; k, v: ``[B, T, KV, K]`` (T is padded to a multiple of 128 for
        the kernel: causality keeps the padding out of every real query's view).
      segment_ids: ``[B, T]`` int.
      interpret: run in Pallas's interpreter (default: off TPU).
      rules: the logical-axis rules that place batch and heads when a mesh is set.
      mesh: the (data, fsdp, tensor) mesh when none is set with ``jax.set_mesh``.

    Returns:
      ``[B, T, H, K]``.
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    length = q.shape[1]
    padded = -(-length // BLOCKS[-1]) * BLOCKS[-1]
    if padded != length:  # padding tokens (id 0) after the row: no earlier query sees them
        q, k, v = (jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - length)))
    segment_ids = segment_ids.astype(jnp.int32)
    local = functools.partial(_local, interpret=interpret)
    context = jax.sharding.get_abstract_mesh()
    mesh = context if mesh is None or not context.empty else mesh
    if rules is None or mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        out = local(q, k, v, segment_ids)
    else:
        spec = functools.partial(logical_to_spec, rules=rules, mesh=mesh)
        q_spec = spec(("batch", "sequence", "heads", "head_dim"), shape=q.shape)
        kv_spec = spec(("batch", "sequence", "kv_heads", "head_dim"), shape=k.shape)
        if q_spec[2] != kv_spec[2]:  # a shard must hold whole groups: both head axes split alike, or neither
            q_spec, kv_spec = (PartitionSpec(*s[:2], None, *s[3:]) for s in (q_spec, kv_spec))
        ids_spec = spec(("batch", "sequence"), shape=segment_ids.shape)
        out = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec), out_specs=q_spec,
                            check_vma=False)(q, k, v, segment_ids)
    out = jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out[:, :length]
