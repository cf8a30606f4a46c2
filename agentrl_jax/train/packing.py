"""Packing trajectories into token-budget rows, and micro-batches by tokens.

The RL batch is built in the padded layout (``build_batch``: one trajectory per row,
``[N, T]``), because advantages, teacher contexts and metrics are per trajectory. The
forward and backward passes run on packed rows instead: several trajectories per row of
``row_length`` tokens, separated by segment ids (1, 2, ... per row; 0 = padding), with
positions restarting at 0 in each segment. A :class:`PackPlan` is the map between the
two layouts; :func:`pack_arrays` gathers padded arrays into packed rows and
:func:`unpack` scatters per-token results (logprobs, entropy) back, so packing is
invisible to everything outside the forward pass.

Micro-batches are counted in tokens: ``rows_per_micro = micro_batch_tokens // row_length``
rows of one plan form a micro-batch and the plan's row count is a multiple of it. A
trajectory is never split across rows, so it is never split across micro-batches either,
and the minibatch normalizer (``losses.global_normalizer``, computed on the padded
layout) keeps the accumulated gradient equal to the full minibatch's.

Packing is first-fit decreasing (``batch.pack_first_fit``): deterministic (ties keep the
input order), and at most ``max_segments`` trajectories share a row (the fused cuDNN
attention path takes a static per-row segment table of that size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.train.batch import bucket_length, pack_first_fit

# Bound on trajectories per packed row: the static segment table of cuDNN's packed kernel.
MAX_SEGMENTS = 64
# Per-token fields and their padding value in packed rows (ids of padding are never targets
# of a loss token; params_versions -1 marks "not sampled").
_FILL = {"params_versions": -1}
# Fields the plan lays out itself rather than gathers.
_LAYOUT_FIELDS = ("positions", "segment_ids", "sequence_ids")


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each trajectory of a padded ``[N, T]`` batch sits in packed ``[R, S]`` rows.

    Attributes:
      rows: per packed row, the padded-batch row indices of its trajectories, in order.
      lengths: ``[N]`` tokens of every trajectory of the padded batch (0 for unused rows).
      row_length: S, tokens per packed row.
      padded_length: T of the padded layout.
      num_rows: R, including empty rows appended to reach a whole number of micro-batches.
      rows_per_micro: rows per micro-batch (R is a multiple of it).
      max_segments: bound on trajectories per row.
    """

    rows: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]
    row_length: int
    padded_length: int
    num_rows: int
    rows_per_micro: int
    max_segments: int

    @property
    def num_micro_batches(self) -> int:
        return self.num_rows // self.rows_per_micro

    @property
    def segment_bound(self) -> int:
        """The static segments-per-row bound the attention is compiled for: the most
        trajectories any row holds, rounded up to a power of two (few compiled shapes), at
        most ``max_segments``.

        cuDNN's packed kernel sizes its backward scratch by rows x bound x row length, so a
        bound far above what the rows hold costs memory that grows with the row length
        (docs/benchmarks.md, "RL update on packed rows"); a bound of 1 (one trajectory per
        row) runs the mask-free padded-row attention instead.
        """
        return segment_bound(max((len(members) for members in self.rows), default=1), self.max_segments)

    @property
    def trajectories(self) -> np.ndarray:
        """Padded-batch rows held by the plan, in packed order."""
        return np.asarray([i for members in self.rows for i in members], np.int64)

    def gather_index(self) -> np.ndarray:
        """``[R, S]`` flat index into the padded ``[N * T]`` arrays, -1 on padding."""
        index = np.full((self.num_rows, self.row_length), -1, np.int64)
        for r, members in enumerate(self.rows):
            cursor = 0
            for i in members:
                n = int(self.lengths[i])
                index[r, cursor : cursor + n] = i * self.padded_length + np.arange(n)
                cursor += n
        return index

    def scatter_index(self) -> np.ndarray:
        """``[N, T]`` flat index into the packed ``[R * S]`` arrays, -1 off the plan."""
        index = np.full((len(self.lengths), self.padded_length), -1, np.int64)
        gather = self.gather_index().reshape(-1)
        real = np.flatnonzero(gather >= 0)
        index.reshape(-1)[gather[real]] = real
        return index

    def segment_ids(self) -> np.ndarray:
        """``[R, S]`` int32: 1, 2, ... for the trajectories of a row, 0 on padding."""
        out = np.zeros((self.num_rows, self.row_length), np.int32)
        for r, members in enumerate(self.rows):
            cursor = 0
            for seg, i in enumerate(members, start=1):
                out[r, cursor : cursor + int(self.lengths[i])] = seg
                cursor += int(self.lengths[i])
        return out


def segment_bound(most: int, cap: int = MAX_SEGMENTS) -> int:
    """The static segments-per-row bound for rows of at most ``most`` segments: ``most``
    rounded up to a power of two, at most ``cap``; 0 (the segment mask) when ``most`` is
    above ``cap``, since cuDNN's packed kernel drops segments beyond its bound."""
    if most > cap:
        return 0
    return min(1 << (max(most, 1) - 1).bit_length(), cap)


def plan_packing(
    lengths: Sequence[int],
    row_length: int,
    *,
    padded_length: int,
    trajectories: Sequence[int] | None = None,
    micro_batch_tokens: int = 0,
    row_multiple: int = 1,
    max_segments: int = MAX_SEGMENTS,
) -> PackPlan:
    """First-fit-decreasing packing of (a subset of) a padded batch into token-budget rows.

    Args:
      lengths: ``[N]`` real tokens of each padded-batch row (prompt + response).
      row_length: S, the token budget of one packed row; no trajectory may be longer.
      padded_length: T of the padded layout the plan maps from.
      trajectories: the padded rows to pack (e.g. one minibatch); default all with length > 0.
      micro_batch_tokens: token budget of a micro-batch; 0: the whole plan is one micro-batch
        (its row count rounded up to a power of two: few compiled shapes).
        Rows per micro-batch is ``micro_batch_tokens // row_length`` rounded down to a
        multiple of ``row_multiple`` (at least ``row_multiple``).
      row_multiple: rows per micro-batch are a multiple of this (the data-parallel size).
      max_segments: at most this many trajectories share a row.

    Returns:
      The plan; its row count is a whole number of micro-batches.
    """
    lengths = np.asarray(lengths, np.int64)
    if row_length < 1 or max_segments < 1 or row_multiple < 1:
        raise ValueError(
            f"plan_packing: row_length ({row_length}), max_segments ({max_segments}) and "
            f"row_multiple ({row_multiple}) must be >= 1"
        )
    chosen = np.flatnonzero(lengths > 0) if trajectories is None else np.asarray(trajectories, np.int64)
    too_long = [int(i) for i in chosen if lengths[i] > row_length]
    if too_long:
        raise ValueError(
            f"trajectory {too_long[0]} has {lengths[too_long[0]]} tokens, more than the packed row "
            f"length {row_length} (algorithm.pack_row_tokens)"
        )
    rows = [tuple(int(chosen[j]) for j in members) for members in _first_fit(lengths[chosen], row_length, max_segments)]
    if micro_batch_tokens:
        rows_per_micro = max(micro_batch_tokens // row_length // row_multiple, 1) * row_multiple
    else:  # one micro-batch; its row count a power of two, so the update compiles for few shapes
        rows_per_micro = -(-(1 << (max(len(rows), 1) - 1).bit_length()) // row_multiple) * row_multiple
    num_rows = -(-max(len(rows), 1) // rows_per_micro) * rows_per_micro
    return PackPlan(
        rows=tuple(rows),
        lengths=tuple(int(n) for n in lengths),
        row_length=row_length,
        padded_length=padded_length,
        num_rows=num_rows,
        rows_per_micro=rows_per_micro,
        max_segments=max_segments,
    )


def _first_fit(lengths: np.ndarray, row_length: int, max_segments: int) -> list[list[int]]:
    """``pack_first_fit``, then rows with more than ``max_segments`` members split in order."""
    out = []
    for members in pack_first_fit([int(n) for n in lengths], row_length):
        out.extend(members[k : k + max_segments] for k in range(0, len(members), max_segments))
    return out


def pack_arrays(plan: PackPlan, padded: dict[str, np.ndarray], *, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """Gather per-token ``[N, T]`` arrays of the padded layout into the plan's ``[R, S]`` rows.

    ``positions`` restart per segment (they are the padded positions), ``segment_ids``
    come from the plan, ``sequence_ids`` name each token's padded row (0 on padding, whose
    loss_mask is 0). Any other field is gathered with 0 on padding (``pad_token_id`` for
    ``input_ids``/``targets``, -1 for ``params_versions``).
    """
    for name, value in padded.items():
        if tuple(np.shape(value)[:2]) != (len(plan.lengths), plan.padded_length):
            raise ValueError(
                f"pack_arrays: {name} has shape {np.shape(value)}, expected [{len(plan.lengths)}, {plan.padded_length}]"
            )
    return gather_rows(padded, plan.gather_index(), plan.segment_ids(), pad_token_id=pad_token_id)


def gather_rows(padded: dict, index, segment_ids, *, pad_token_id: int = 0) -> dict:
    """:func:`pack_arrays` given the plan's ``gather_index`` and ``segment_ids``: numpy on the
    host, or ``jnp`` inside ``jit`` (the update packs its minibatch from the step's device
    arrays this way).
    """
    xp = np if isinstance(index, np.ndarray) else jnp
    padded_length = next(iter(padded.values())).shape[1]
    real = index >= 0
    safe = xp.where(real, index, 0)
    out = {}
    for name, value in padded.items():
        if name in _LAYOUT_FIELDS:
            continue
        fill = pad_token_id if name in ("input_ids", "targets") else _FILL.get(name, 0)
        flat = value.reshape(-1)
        out[name] = xp.where(real, xp.take(flat, safe, axis=0), xp.asarray(fill, value.dtype)).astype(value.dtype)
    out["positions"] = xp.where(real, safe % padded_length, 0).astype(np.int32)
    out["segment_ids"] = xp.asarray(segment_ids, np.int32)
    out["sequence_ids"] = xp.where(real, safe // padded_length, 0).astype(np.int32)
    return out


def unpack(plan: PackPlan, packed, fill: float = 0.0):
    """Per-token values ``[R, S]`` of packed rows back to the padded ``[N, T]`` layout.

    Works on numpy and on device arrays (a gather; inside ``jit`` too). Positions a
    trajectory does not occupy, and padded rows the plan does not hold, get ``fill``.
    """
    index = plan.scatter_index()
    xp = np if isinstance(packed, np.ndarray) else jnp
    if tuple(packed.shape) != (plan.num_rows, plan.row_length):
        raise ValueError(f"unpack: got shape {tuple(packed.shape)}, the plan has [{plan.num_rows}, {plan.row_length}]")
    flat = packed.reshape(-1)
    values = xp.take(flat, xp.asarray(np.maximum(index, 0)), axis=0)
    return xp.where(xp.asarray(index >= 0), values, xp.asarray(fill, packed.dtype))


def packing_stats(plan: PackPlan) -> dict[str, float]:
    """Fill of the packed rows vs the padded layout (for the metrics)."""
    real = float(sum(int(plan.lengths[i]) for i in plan.trajectories))
    held = len(plan.trajectories)
    return {
        "pack/rows": float(plan.num_rows),
        "pack/micro_batches": float(plan.num_micro_batches),
        "pack/fill": real / max(plan.num_rows * plan.row_length, 1),
        "pack/padded_fill": real / max(held * plan.padded_length, 1),
    }


def row_length_for(lengths: Sequence[int], row_tokens: int) -> int:
    """``row_tokens``, or the bucketed longest trajectory where one is longer (it never splits)."""
    longest = max((int(n) for n in lengths), default=1)
    return row_tokens if longest <= row_tokens else bucket_length(longest)


def packed_logprobs(
    forward: Callable[[Any, dict[str, jax.Array], int], jax.Array],
    params: Any,
    inputs: dict[str, np.ndarray],
    *,
    row_tokens: int,
    micro_batch_tokens: int,
    max_segments: int = MAX_SEGMENTS,
    pad_token_id: int = 0,
    put: Callable[[np.ndarray], jax.Array] = jnp.asarray,
) -> jax.Array:
    """Per-token values (logprobs) of padded forward inputs, computed on packed rows.

    Every forward pass of the trainer (old, reference, teacher) goes through here when
    packing is on, so they share one layout; the result is in the padded layout again.
    Only the packed inputs travel host -> device: the micro-batches' results are joined and
    unpacked on the device, so no forward waits for the previous one's result on the host.

    Args:
      forward: ``(params, packed micro-batch arrays, segment bound) -> [rows, S]`` (a jitted
        packed forward; the bound is the plan's static :attr:`PackPlan.segment_bound`).
      inputs: ``input_ids``, ``positions``, ``segment_ids``, ``targets`` ``[N, T]`` (padded).
      row_tokens, micro_batch_tokens, max_segments: see :func:`plan_packing`.
      put: host array -> device array (the trainer's: replicated on its mesh).

    Returns:
      ``[N, T]`` float32 device array; 0 off the trajectories.
    """
    lengths = (np.asarray(inputs["segment_ids"]) > 0).sum(axis=1)
    plan = plan_packing(lengths, row_length_for(lengths, row_tokens), padded_length=inputs["input_ids"].shape[1],
                        micro_batch_tokens=micro_batch_tokens, max_segments=max_segments)
    packed = pack_arrays(plan, inputs, pad_token_id=pad_token_id)
    step = plan.rows_per_micro
    parts = [forward(params, {k: put(v[s : s + step]) for k, v in packed.items()}, plan.segment_bound)
             for s in range(0, plan.num_rows, step)]
    return _unpack_on_device(parts, put(plan.scatter_index().astype(np.int32)))


@jax.jit
def _unpack_on_device(parts: list[jax.Array], index: jax.Array) -> jax.Array:
    """:func:`unpack` of the concatenated ``parts`` with the plan's scatter ``index`` (fill 0)."""
    flat = jnp.concatenate(parts, axis=0).astype(jnp.float32).reshape(-1)
    return jnp.where(index >= 0, jnp.take(flat, jnp.maximum(index, 0), axis=0), 0.0)


def plan_minibatch(
    segment_ids: np.ndarray, trajectories: Sequence[int], *, row_tokens: int, micro_batch_tokens: int
) -> PackPlan:
    """The update's plan for one minibatch: ``trajectories`` (padded rows) of a ``[N, T]`` batch."""
    lengths = (np.asarray(segment_ids) > 0).sum(axis=1)
    chosen = [int(i) for i in trajectories if lengths[i] > 0]
    return plan_packing(lengths, row_length_for(lengths[chosen], row_tokens), padded_length=segment_ids.shape[1],
                        trajectories=chosen, micro_batch_tokens=micro_batch_tokens)
