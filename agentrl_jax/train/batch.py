"""Trajectories -> fixed-shape training rows.

Token ids pass straight through: a row holds exactly the ids the engine sampled and the
observation ids the environment appended, never a re-tokenization of text.

Alignment: position ``t`` of a row feeds token ``t`` to the model, which predicts
``targets[t]`` (the next token of the same trajectory). Every per-token training array
(``loss_mask``, ``rollout_logprobs``, ``advantages``, ``params_versions``) is aligned
with ``targets``: ``loss_mask[t]`` is 1 iff the policy sampled ``targets[t]``. The last
token of each trajectory has no target and is masked.

Two layouts:
- padded (``pack=False``): one trajectory per row, rows padded to the row length;
  ``sequence_ids[r, :] == r``.
- packed (``pack=True``): first-fit-decreasing packing of several trajectories per row,
  separated by ``segment_ids`` (1, 2, ... per row; 0 = padding) with positions restarting
  at 0 per segment; ``sequence_ids`` names each token's trajectory for sequence-level
  losses (``agentrl_jax.losses.sequences``).

Row length and row count are rounded up (``bucket_length``, ``row_multiple``) so that the
jitted forward/update compile for few distinct shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import struct


@dataclasses.dataclass
class TokenRecord:
    """One trajectory's tokens, as the agent loop produced them (all length n).

    Attributes:
      token_ids: prompt + every turn + every observation, exactly as sampled / appended.
      loss_mask: 1 on tokens the policy sampled, 0 on prompt, observations, template glue.
      rollout_logprobs: the engine's logprob for sampled tokens (0 elsewhere).
      params_versions: params version that sampled each token (-1 elsewhere).
      advantages: optional per-token advantages (0 where loss_mask is 0).
    """

    token_ids: Sequence[int]
    loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    params_versions: Sequence[int]
    advantages: Sequence[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "rollout_logprobs", "params_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"TokenRecord.{name} has {len(getattr(self, name))} entries, token_ids has {n}")
        if self.advantages is not None and len(self.advantages) != n:
            raise ValueError(f"TokenRecord.advantages has {len(self.advantages)} entries, token_ids has {n}")
        if n < 2:
            raise ValueError("a trajectory needs at least 2 tokens (a prompt token and a sampled one)")


@struct.dataclass
class TrainBatch:
    """Fixed-shape training rows [R, S]; see the module docstring for the alignment."""

    input_ids: np.ndarray  # [R, S] int32
    positions: np.ndarray  # [R, S] int32
    segment_ids: np.ndarray  # [R, S] int32, 0 = padding
    targets: np.ndarray  # [R, S] int32
    loss_mask: np.ndarray  # [R, S] float32
    rollout_logprobs: np.ndarray  # [R, S] float32
    advantages: np.ndarray  # [R, S] float32
    params_versions: np.ndarray  # [R, S] int32
    sequence_ids: np.ndarray  # [R, S] int32, index of the trajectory of each token

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def rows(self, start: int, stop: int) -> "TrainBatch":
        """Rows [start, stop) of every field."""
        return TrainBatch(**{f.name: getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)})


def bucket_length(n: int, minimum: int = 32, maximum: int | None = None) -> int:
    """The smallest power of two >= max(n, minimum), capped at ``maximum`` (if n fits)."""
    b = max(minimum, 1 << max(0, int(n - 1).bit_length()))
    if maximum is not None:
        if n > maximum:
            raise ValueError(f"sequence of {n} tokens exceeds the row length limit {maximum}")
        b = min(b, maximum)
    return b


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_first_fit(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """First-fit-decreasing bin packing: indices of trajectories per row."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if lengths[i] > row_length:
            raise ValueError(f"trajectory {i} has {lengths[i]} tokens, more than the row length {row_length}")
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(row_length - lengths[i])
    return rows


def build_batch(
    records: Sequence[TokenRecord],
    *,
    pack: bool = False,
    row_length: int | None = None,
    max_row_length: int | None = None,
    row_multiple: int = 1,
    pad_token_id: int = 0,
) -> TrainBatch:
    """Lay trajectories out as fixed-shape rows.

    Args:
      records: the trajectories.
      pack: pack several trajectories per row (segment ids) instead of one per row.
      row_length: the row length S; default: the bucketed longest trajectory.
      max_row_length: a trajectory longer than this is an error (no silent truncation).
      row_multiple: the row count is rounded up to a multiple of this (empty rows have
        loss_mask 0 everywhere), e.g. minibatches x micro-batches x data-parallel size.
      pad_token_id: id written in padding positions (never a target of a loss token).

    Returns:
      A TrainBatch of numpy arrays.
    """
    if not records:
        raise ValueError("build_batch: no trajectories")
    lengths = [len(r.token_ids) for r in records]
    if row_length is None:
        row_length = bucket_length(max(lengths), maximum=max_row_length)
    elif max(lengths) > row_length:
        raise ValueError(f"a trajectory has {max(lengths)} tokens, more than row_length={row_length}")
    layout = pack_first_fit(lengths, row_length) if pack else [[i] for i in range(len(records))]
    n_rows = _round_up(len(layout), row_multiple)

    shape = (n_rows, row_length)
    out = {
        "input_ids": np.full(shape, pad_token_id, np.int32),
        "positions": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "targets": np.full(shape, pad_token_id, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "rollout_logprobs": np.zeros(shape, np.float32),
        "advantages": np.zeros(shape, np.float32),
        "params_versions": np.full(shape, -1, np.int32),
        "sequence_ids": np.zeros(shape, np.int32),
    }
    for r, members in enumerate(layout):
        cursor = 0
        for seg, i in enumerate(members, start=1):
            rec = records[i]
            n = lengths[i]
            sl = slice(cursor, cursor + n)
            tgt = slice(cursor, cursor + n - 1)
            ids = np.asarray(rec.token_ids, np.int32)
            out["input_ids"][r, sl] = ids
            out["positions"][r, sl] = np.arange(n, dtype=np.int32)
            out["segment_ids"][r, sl] = seg
            out["sequence_ids"][r, sl] = i
            out["targets"][r, tgt] = ids[1:]
            out["loss_mask"][r, tgt] = np.asarray(rec.loss_mask, np.float32)[1:]
            out["rollout_logprobs"][r, tgt] = np.asarray(rec.rollout_logprobs, np.float32)[1:]
            out["params_versions"][r, tgt] = np.asarray(rec.params_versions, np.int32)[1:]
            if rec.advantages is not None:
                out["advantages"][r, tgt] = np.asarray(rec.advantages, np.float32)[1:]
            cursor += n
    # Empty padding rows point at sequence 0 with mask 0: harmless for segment sums.
    out["advantages"] *= out["loss_mask"]
    out["rollout_logprobs"] *= out["loss_mask"]
    return TrainBatch(**out)
