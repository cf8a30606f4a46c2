"""Per-sequence reductions over [B, T] token arrays, for plain and packed rows.

A row of a TrainBatch either holds one trajectory (`sequence_ids=None`: row b is
sequence b) or several packed ones (`sequence_ids[b, t]` in [0, num_sequences) names the
trajectory of each token; padding may carry any id as long as its loss_mask is 0).
Every sequence-level quantity in the losses goes through these two functions, so packed
and unpacked layouts give the same numbers.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def _check_layout(values: Array, sequence_ids: Array | None, num_sequences: int | None) -> None:
    chex.assert_rank(values, 2)
    if sequence_ids is None:
        return
    chex.assert_equal_shape([values, sequence_ids])
    if num_sequences is None:
        raise ValueError("num_sequences must be given (a static int) when sequence_ids is given")


def sequence_sums(
    values: Float[Array, "B T"],
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Float[Array, "S"]:
    """Sum of `values` over the tokens of each sequence: [S] (S = B when sequence_ids is None)."""
    _check_layout(values, sequence_ids, num_sequences)
    if sequence_ids is None:
        return jnp.sum(values, axis=1)
    return jax.ops.segment_sum(
        values.reshape(-1), sequence_ids.reshape(-1), num_segments=num_sequences
    )


def sequence_to_tokens(
    per_sequence: Float[Array, "S"],
    like: Float[Array, "B T"],
    sequence_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """Broadcast a per-sequence value [S] back onto the tokens [B, T] of each sequence."""
    chex.assert_rank(per_sequence, 1)
    if sequence_ids is None:
        return jnp.broadcast_to(per_sequence[:, None], like.shape)
    return per_sequence[sequence_ids]


def sequence_token_counts(
    loss_mask: Float[Array, "B T"],
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Float[Array, "S"]:
    """Number of loss tokens of each sequence: [S]."""
    return sequence_sums(loss_mask.astype(jnp.float32), sequence_ids, num_sequences)
