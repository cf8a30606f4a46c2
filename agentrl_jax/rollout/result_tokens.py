"""`ResultTokens`: JetStream's packed per-slot result layout, plus logprobs as pytree leaves.

JetStream packs one step's results for all slots into one int array so that a single
device-to-host copy brings everything back:

    data[slot * samples_per_slot + s] = [tokens | valid | lengths]

with `tokens_idx`, `valid_idx`, `length_idx` naming the column ranges. This module keeps
that layout (columns 0, 1, 2 when samples_per_slot == 1) and adds `log_prob` (the
temperature-scaled full-distribution logprob, what the trainer computes) and
`truncated_log_prob` (under the top-k/top-p distribution actually sampled) as float32
leaves. When `generate` runs N steps per dispatch, every leaf gains a leading [N] axis.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class SlotData:
    """One slot's results: tokens/valid [..., samples], lengths/log_probs [..., samples]."""

    tokens: Any
    valid: Any
    lengths: Any
    log_prob: Any
    truncated_log_prob: Any


@struct.dataclass
class ResultTokens:
    """Packed tokens | valid | lengths (int32) with per-token float32 logprobs.

    Attributes:
      data: [..., R, 3 * samples_per_slot] int32, R = slots * samples_per_slot rows.
      log_prob: [..., R] float32, log softmax(z / tau)[token].
      truncated_log_prob: [..., R] float32, logprob under the truncated sampler.
      tokens_idx, valid_idx, length_idx: column ranges in `data` (static).
      samples_per_slot: rows per slot (static).
    """

    data: Any
    log_prob: Any
    truncated_log_prob: Any
    tokens_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 1))
    valid_idx: tuple[int, int] = struct.field(pytree_node=False, default=(1, 2))
    length_idx: tuple[int, int] = struct.field(pytree_node=False, default=(2, 3))
    samples_per_slot: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def pack(cls, tokens, valid, lengths, log_prob, truncated_log_prob) -> ResultTokens:
        """Pack [..., R] tokens/valid/lengths and logprobs (samples_per_slot = 1)."""
        data = jnp.stack(
            [tokens.astype(jnp.int32), valid.astype(jnp.int32), lengths.astype(jnp.int32)], axis=-1
        )
        return cls(
            data=data,
            log_prob=log_prob.astype(jnp.float32),
            truncated_log_prob=truncated_log_prob.astype(jnp.float32),
        )

    @property
    def tokens(self):
        return self.data[..., self.tokens_idx[0]]

    @property
    def valid(self):
        return self.data[..., self.valid_idx[0]].astype(bool)

    @property
    def lengths(self):
        return self.data[..., self.length_idx[0]]

    def copy_to_host_async(self) -> None:
        """Start the device-to-host copies of every leaf (JetStream API)."""
        for leaf in jax.tree.leaves(self):
            if hasattr(leaf, "copy_to_host_async"):
                leaf.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        """The same results as NumPy arrays (blocks on the device)."""
        return jax.tree.map(np.asarray, self)

    def get_result_at_slot(self, slot: int) -> SlotData:
        """Results of one slot (JetStream API); leading step axes are kept."""
        rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
        cols = lambda idx: slice(idx[0], idx[1])  # noqa: E731
        return SlotData(
            tokens=self.data[..., rows, cols(self.tokens_idx)],
            valid=self.data[..., rows, cols(self.valid_idx)],
            lengths=self.data[..., rows, cols(self.length_idx)][..., 0],
            log_prob=self.log_prob[..., rows],
            truncated_log_prob=self.truncated_log_prob[..., rows],
        )
