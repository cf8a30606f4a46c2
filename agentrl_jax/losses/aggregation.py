"""Reduce per-token losses to a scalar with a normalizer fixed for the whole minibatch.

    loss = sum_s w_s sum_t m_{s,t} l_{s,t} / Z

    mode                     w_s        Z (from `global_normalizer`, over the minibatch)
    token-mean               1          number of loss tokens
    seq-mean-token-mean      1 / n_s    number of sequences with >= 1 loss token
    seq-mean-token-sum       1          number of sequences with >= 1 loss token
    seq-mean-token-sum-norm  1          that number * max_response_length (Dr.GRPO constant)

n_s is the sequence's own loss-token count. Z is computed once for the minibatch and
passed to every micro-batch, so the sum of the micro-batch losses (and gradients) equals
the full-batch loss exactly, provided a sequence is not split across micro-batches.
Dr.GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1.
"""

from __future__ import annotations

from typing import Literal

import chex
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from agentrl_jax.losses.sequences import sequence_sums, sequence_to_tokens

Aggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
AGGREGATIONS: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; known aggregations: {list(AGGREGATIONS)}")


def global_normalizer(
    loss_mask: Float[Array, "B T"],
    mode: Aggregation,
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
    max_response_length: int | None = None,
) -> Float[Array, ""]:
    """The denominator Z of `mode` for a whole minibatch (see the module docstring).

    Args:
      loss_mask: [B, T] mask of the WHOLE minibatch (all micro-batches).
      mode: one of AGGREGATIONS.
      sequence_ids, num_sequences: packed layout (None: one sequence per row).
      max_response_length: the Dr.GRPO constant, required for seq-mean-token-sum-norm.
    Returns:
      float32 scalar Z.
    """
    _check_mode(mode)
    chex.assert_rank(loss_mask, 2)
    mask = (loss_mask > 0).astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(mask)
    num_nonempty = jnp.sum(sequence_sums(mask, sequence_ids, num_sequences) > 0).astype(jnp.float32)
    if mode == "seq-mean-token-sum-norm":
        if max_response_length is None or max_response_length < 1:
            raise ValueError(
                "max_response_length (a positive int) is required for seq-mean-token-sum-norm, "
                f"got {max_response_length!r}"
            )
        return num_nonempty * jnp.float32(max_response_length)
    return num_nonempty


def aggregate(
    per_token_loss: Float[Array, "B T"],
    loss_mask: Float[Array, "B T"],
    mode: Aggregation,
    normalizer: Float[Array, ""],
    *,
    sequence_ids: Int[Array, "B T"] | None = None,
    num_sequences: int | None = None,
) -> Float[Array, ""]:
    """sum_s w_s sum_t m l / Z for one (micro-)batch; Z from `global_normalizer`.

    Args:
      per_token_loss: [B, T] loss terms (any value where loss_mask is 0; it is ignored).
      loss_mask: [B, T] of this micro-batch.
      mode: one of AGGREGATIONS.
      normalizer: scalar Z of the whole minibatch; Z <= 0 (no loss tokens anywhere) gives 0.
      sequence_ids, num_sequences: packed layout (None: one sequence per row).
    Returns:
      scalar loss.
    """
    _check_mode(mode)
    chex.assert_rank(per_token_loss, 2)
    chex.assert_equal_shape([per_token_loss, loss_mask])
    mask = loss_mask > 0
    terms = jnp.where(mask, per_token_loss, 0.0)
    if mode == "seq-mean-token-mean":
        counts = sequence_sums(mask.astype(terms.dtype), sequence_ids, num_sequences)
        per_token_counts = sequence_to_tokens(counts, terms, sequence_ids)
        terms = jnp.where(mask, terms / jnp.maximum(per_token_counts, 1.0), 0.0)
    normalizer = jnp.asarray(normalizer, terms.dtype)
    return jnp.sum(terms) / jnp.where(normalizer > 0, normalizer, 1.0)
