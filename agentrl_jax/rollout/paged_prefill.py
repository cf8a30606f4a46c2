"""Batched prefill straight into KV pages: the rows of one tick, packed into one jitted call.

`Engine.prefill_insert` takes `PrefillRow`s (one per sequence: its new tokens, where they
start, its pages) and `Admission`s (the decode slots to fill from a row's last position).
`pack_rows` lays them out as fixed arrays, each row in the data shard that owns its pages
so the prefill's attention and cache writes stay on its devices; `prefill_insert_step` is
the traced body.

The compiled shapes are a small closed set, so a run can compile them all at warm-up
(`Engine.warmup`) and never during its work: every sequence's tokens are cut into pieces
of one fixed width C (``row_tokens``), each piece one packed row that reads the
sequence's page table; the rows per shard are a power of two up to the driver's token
budget / C (`rows_bucket`), and the attention window a power of two of pages from a
floor up to the table (`window_pages`). Admissions and page copies are padded to the
slot count. Pieces of one sequence in one call are exact: each layer writes every row's
keys and values into the pages before any row attends, and a piece's queries see only
entries up to their own position. A sequence wastes less than C padded tokens, where a
layout of one row per sequence padded every row to the longest one's bucket.

The rows still pad: a session's next turn (its last sampled token and a ~32-token tool
observation) fills half a row of 64, and a call's rows are rounded up to a power of two.
So the call is compacted (`CompactTokens`): each shard's real tokens, in row order, padded
to n = k x C (k on the ladder 2, 3, 4, 6, 8, 12, ... of `tokens_bucket`), go through every
layer's token-wise work (embedding, norms, projections, RoPE, MLP; `models.decode.forward`'s
``token_index``), and only the attention and the KV write see the ``[R, C]`` rows. Padding
is at most a third of what a call computes, above a floor of two rows' worth (at C = 64,
128 tokens: under a few hundred tokens a GPU matmul is bound by reading its weights, so
fewer save little) and of a quarter of the rows (which bounds the token buckets per row
bucket to five); where n would reach the rows' R x C, the call runs the rows as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from agentrl_jax.models.decode import AttentionPlan, forward
from agentrl_jax.rollout.pages import TRASH_PAGE, pages_for
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import SamplingParams, SlotSampling, sample_next_token
from agentrl_jax.rollout.state import STOP_IDS, STOP_SEQUENCES, DecodeState


@dataclasses.dataclass
class Admission:
    """A decode slot filled from a `PrefillRow`.

    Attributes:
      slot: the slot (in the row's shard).
      pages: the slot's page table; the slot takes over one reference to each page.
      key: [2] uint32, the request's key (`request_key(seed, sample)`).
      generated: tokens this sample has sampled before (the fold-in index of the next one).
      sampling: its sampling parameters.
      forced_token: >= 0 to feed this (already sampled) token instead of sampling one: a
        preempted sequence resuming.
      limit: the length at which the slot stops advancing on the device (`DecodeState.limits`;
        None: ``max_target_length``).
      stop_ids: token ids that stop it on the device (as many as the state holds, the lowest first;
        the host checks them all).
      stop_sequences: token sequences that stop it on the device when its newest tokens are one of
        them (its stop strings' `StopMatcher.sequences`; the first ones the state holds room for,
        longer ones skipped: the host checks them all).
      recent: the turn's tokens before the one it feeds first (a resumed sequence's; the device
        matches stop sequences against them and the tokens after).
    """

    slot: int
    pages: Sequence[int]
    key: np.ndarray
    generated: int
    sampling: SamplingParams
    forced_token: int = -1
    limit: int | None = None
    stop_ids: Sequence[int] = ()
    stop_sequences: Sequence[Sequence[int]] = ()
    recent: Sequence[int] = ()


@dataclasses.dataclass
class PrefillRow:
    """New tokens of one sequence, written into its pages.

    Attributes:
      shard: the data shard that owns ``pages``.
      pages: local page ids covering entries ``[0, start + len(tokens))``.
      start: entries already in the pages (earlier turns, a shared prompt).
      tokens: the new tokens (at most ``max_prefill_length``).
      admissions: slots to fill from this row's last position (none for a middle chunk).
      copies: ``(src, dst)`` pages of the shard to copy after the write (copy-on-write).
    """

    shard: int
    pages: Sequence[int]
    start: int
    tokens: np.ndarray
    admissions: list[Admission] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CompactTokens:
    """The real tokens of `PackedRows`' rows, D blocks of n (one per data shard, in row order, then
    padding): what a compacted call computes."""

    tokens: np.ndarray  # [D * n]
    positions: np.ndarray  # [D * n]
    index: np.ndarray  # [D * n] r * C + c, r the row within its shard; padding: R * C (past every shard's rows)


@dataclasses.dataclass
class PackedRows:
    """`pack_rows`' arrays: R = D x rows-per-shard rows of C tokens (the row width), M admissions,
    and page copies padded to the slot count; ``compact``: the call's tokens when it is compacted."""

    tokens: np.ndarray  # [R, C]
    tables: np.ndarray  # [R, window] local page ids
    starts: np.ndarray  # [R]
    lengths: np.ndarray  # [R] real tokens per row (0 for padding rows: they write nothing)
    adm_token: np.ndarray  # [M] the call's hidden state of the admission's row's last token (see `prefill_insert_step`)
    adm_slot: np.ndarray  # [M], S for padding (dropped)
    adm_key: np.ndarray  # [M, 2]
    adm_generated: np.ndarray  # [M]
    adm_forced: np.ndarray  # [M], -1 = sample
    adm_length: np.ndarray  # [M] the slot's length after the prefill
    adm_limit: np.ndarray  # [M] the length at which it stops (`DecodeState.limits`)
    adm_stops: tuple[np.ndarray, np.ndarray, np.ndarray]  # device-side stops: ids [M, I], sequences [M, Q, L]
    # (right-aligned), the turn's tokens before its first [M, L] (right-aligned); -1 padded
    adm_order: np.ndarray  # [M] admission order (ready slots take free decode lanes in this order)
    sampling: tuple[np.ndarray, np.ndarray, np.ndarray]  # temperature, top_k, top_p [M]
    copy_src: np.ndarray  # [max(S, copies)] global page ids
    copy_dst: np.ndarray  # [max(S, copies)], -1 for padding
    admitted: list[Admission]
    num_copies: int = 0  # real pairs at the front of copy_src / copy_dst
    compact: CompactTokens | None = None

    @property
    def computed_tokens(self) -> int:
        """Tokens the call's dense layers compute (padding included)."""
        return self.tokens.size if self.compact is None else self.compact.tokens.size


def rows_bucket(rows: int, cap: int | None = None) -> int:
    """Packed rows per shard for ``rows`` pieces: the next power of two, or ``cap`` (the
    driver's token budget / C) when that is smaller and still holds them."""
    bucket = 1 << max(rows - 1, 0).bit_length()
    return min(bucket, cap) if cap is not None and rows <= cap else bucket


def tokens_bucket(tokens: int, rows: int, row_tokens: int) -> int:
    """Tokens per shard a compacted call computes for ``tokens`` real ones in ``rows`` packed rows of
    C = ``row_tokens``: k x C, k the first of 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 x
    powers of two: at most a third padding) that holds them and is at least ``rows`` / 4 (at most
    five buckets per row bucket); ``rows`` x C (no compaction) where k would reach ``rows``."""
    need = max(-(-tokens // row_tokens), -(-rows // 4), 2)
    k = 2
    while k < need:
        k = k * 3 // 2 if k & (k - 1) == 0 else k * 4 // 3
    return min(k, rows) * row_tokens


def call_layout(pieces: int, tokens: int, *, row_tokens: int, row_cap: int | None, compaction: bool) -> tuple[int, int]:
    """``(rows, computed tokens)`` per shard of a call whose fullest shard has ``pieces`` pieces and
    ``tokens`` real tokens (`rows_bucket`, `tokens_bucket`; without ``compaction``, the rows' tokens)."""
    rows = rows_bucket(pieces, row_cap)
    return rows, tokens_bucket(tokens, rows, row_tokens) if compaction else rows * row_tokens


def window_pages(reach: int, *, page_size: int, floor: int, table_width: int) -> int:
    """The prefill's attention window in pages for rows reaching ``reach`` entries: a power of
    two >= ``floor`` pages, at most the page table's width."""
    need = max(pages_for(reach, page_size), floor, 1)
    return min(1 << (need - 1).bit_length(), table_width)


def pack_rows(
    rows: Sequence[PrefillRow], *, num_shards: int, num_slots: int, slots_per_shard: int, pages_per_shard: int,
    page_size: int, row_tokens: int, row_cap: int | None, window: int, max_prefill: int, max_length: int,
    compaction: bool, first_order: int = 0, stop_width: int = STOP_IDS,
    stop_seqs: tuple[int, int] = STOP_SEQUENCES,
) -> PackedRows:
    """Cut the rows into pieces of ``row_tokens`` and lay them out in their shards' blocks of rows;
    with ``compaction``, also the compact tokens where they are fewer than the rows' (`call_layout`);
    admissions are numbered from ``first_order`` (`PackedRows.adm_order`)."""
    for r in rows:
        n = len(r.tokens)
        if not 1 <= n <= max_prefill:
            raise ValueError(f"prefill_insert: {n} tokens in a row; 1 to max_prefill_length={max_prefill}")
        if r.start + n >= max_length or len(r.pages) < pages_for(r.start + n, page_size):
            raise ValueError(
                f"prefill_insert: a row of {r.start} + {n} tokens with {len(r.pages)} pages of {page_size} "
                f"(max_target_length={max_length})"
            )
    C = row_tokens
    pieces = [[(r, at) for r in rows if r.shard == d for at in range(0, len(r.tokens), C)] for d in range(num_shards)]
    shard_tokens = [sum(len(r.tokens) for r in rows if r.shard == d) for d in range(num_shards)]
    rows_per_shard, n = call_layout(max(len(x) for x in pieces), max(shard_tokens), row_tokens=C, row_cap=row_cap,
                                    compaction=compaction)
    R = num_shards * rows_per_shard
    tokens = np.zeros((R, C), np.int32)
    tables = np.full((R, window), TRASH_PAGE, np.int32)
    starts, lengths = np.zeros((R,), np.int32), np.zeros((R,), np.int32)
    last = {}  # id(row) -> its last piece's packed row (where its admissions sample)
    for d in range(num_shards):
        for j, (r, at) in enumerate(pieces[d]):
            i, piece = d * rows_per_shard + j, r.tokens[at:at + C]
            tokens[i, : len(piece)], starts[i], lengths[i] = piece, r.start + at, len(piece)
            tables[i, : min(len(r.pages), window)] = r.pages[:window]
            last[id(r)] = i
    if n < rows_per_shard * C:
        compact, last_token = _compact(tokens, starts, lengths, num_shards, n)
    else:
        compact, last_token = None, np.arange(R, dtype=np.int32) * C + lengths - 1  # in the flat [R * C]
    admitted = [(last[id(r)], a) for r in rows for a in r.admissions]  # results in the caller's order
    M = max(num_slots, len(admitted))  # fixed: one compiled shape fewer per prefill call
    out = PackedRows(
        tokens, tables, starts, lengths, *_admission_arrays(M, num_slots, stop_width, stop_seqs),
        *_copies(rows, pages_per_shard, num_slots), admitted=[a for _, a in admitted],
        num_copies=sum(len(r.copies) for r in rows), compact=compact,
    )
    for m, (i, a) in enumerate(admitted):
        if a.slot // slots_per_shard != i // rows_per_shard:
            raise ValueError(f"prefill_insert: slot {a.slot} is not in the shard of its row's pages")
        out.adm_token[m], out.adm_slot[m], out.adm_key[m] = last_token[i], a.slot, a.key
        out.adm_generated[m] = a.generated
        out.adm_forced[m], out.adm_length[m] = a.forced_token, starts[i] + lengths[i]
        out.adm_limit[m] = max_length if a.limit is None else min(a.limit, max_length)
        stops = sorted(a.stop_ids)[:stop_width]
        ids, seqs, recent = out.adm_stops
        ids[m, : len(stops)] = stops
        fitting = [list(q) for q in a.stop_sequences if 1 <= len(q) <= stop_seqs[1]][: stop_seqs[0]]
        for j, q in enumerate(fitting):
            seqs[m, j, stop_seqs[1] - len(q):] = q
        before = list(a.recent)[-stop_seqs[1]:]
        if before:
            recent[m, stop_seqs[1] - len(before):] = before
        out.adm_order[m] = first_order + m
        for field, value in zip(out.sampling, (a.sampling.temperature, a.sampling.top_k, a.sampling.top_p)):
            field[m] = value
    return out


def empty_pack(*, rows: int, row_tokens: int, window: int, num_slots: int, tokens: int | None = None,
               stop_width: int = STOP_IDS, stop_seqs: tuple[int, int] = STOP_SEQUENCES) -> PackedRows:
    """A pack of padding rows only (no admission, padding page copies that copy nothing): the
    arrays a warm-up call compiles with, compacted to ``tokens`` (all padding) when fewer than the
    rows'. Its rows write nothing."""
    compact = None
    if tokens is not None and tokens < rows * row_tokens:
        compact = CompactTokens(np.zeros((tokens,), np.int32), np.zeros((tokens,), np.int32),
                                np.full((tokens,), rows * row_tokens, np.int32))
    return PackedRows(
        np.zeros((rows, row_tokens), np.int32), np.full((rows, window), TRASH_PAGE, np.int32),
        np.zeros((rows,), np.int32), np.zeros((rows,), np.int32),
        *_admission_arrays(num_slots, num_slots, stop_width, stop_seqs),
        np.zeros((num_slots,), np.int32), np.full((num_slots,), -1, np.int32), admitted=[], compact=compact,
    )


def _admission_arrays(M: int, num_slots: int, stop_width: int, stop_seqs: tuple[int, int]) -> tuple:
    """`PackedRows`' M admission fields, every one padding (slot S: dropped), from ``adm_token`` to ``sampling``."""
    zeros = lambda dtype=np.int32: np.zeros((M,), dtype)  # noqa: E731
    stops = (np.full((M, stop_width), -1, np.int32), np.full((M, *stop_seqs), -1, np.int32),
             np.full((M, stop_seqs[1]), -1, np.int32))
    return (zeros(), np.full((M,), num_slots, np.int32), np.zeros((M, 2), np.uint32), zeros(),
            np.full((M,), -1, np.int32), zeros(), zeros(), stops, zeros(),
            (zeros(np.float32), zeros(), np.ones((M,), np.float32)))


def _compact(tokens, starts, lengths, num_shards: int, n: int) -> tuple[CompactTokens, np.ndarray]:
    """Each shard's real tokens of the rows ``tokens [R, C]`` in row order, padded to ``n``; and
    each row's last token among them (padding rows: unused)."""
    R, C = tokens.shape
    per_shard = R // num_shards
    size = num_shards * n
    out = CompactTokens(np.zeros((size,), np.int32), np.zeros((size,), np.int32), np.full((size,), R * C, np.int32))
    last_token = np.zeros((R,), np.int32)
    for d in range(num_shards):
        rows = slice(d * per_shard, (d + 1) * per_shard)
        flat = np.flatnonzero(np.arange(C)[None, :] < lengths[rows, None])  # r * C + c within the shard's rows
        at = d * n + np.arange(flat.size)
        out.index[at], out.tokens[at] = flat, tokens[rows].reshape(-1)[flat]
        out.positions[at] = starts[rows][flat // C] + flat % C
        last_token[rows] = d * n + np.cumsum(lengths[rows]) - 1
    return out, last_token


def _copies(rows: Sequence[PrefillRow], pages_per_shard: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r.shard * pages_per_shard + s, r.shard * pages_per_shard + t) for r in rows for s, t in r.copies]
    size = max(size, len(pairs))
    src, dst = np.zeros((size,), np.int32), np.full((size,), -1, np.int32)
    for i, (s, t) in enumerate(pairs):
        src[i], dst[i] = s, t
    return src, dst  # padding: dst -1, dropped by `copy_pages`


def copy_pages(state: DecodeState, copy_src, copy_dst) -> DecodeState:
    """Traced body of the page copies after a prefill (copy-on-write of a group's last partial page).

    A call of its own: inside the prefill program, the copies' gather and scatter on a pool
    that the layers' attention also read made XLA copy every layer's whole pool (twice) to
    keep the reads ordered, a cost that grew with the KV budget, not with the tokens
    prefilled. Alone, the scatter updates the donated pool in place.

    Padding pairs (``copy_dst < 0``) are dropped and the real ones, whose destinations are
    fresh pages, are scattered as unique indices: XLA's GPU scatter serializes colliding
    writes, so 64 padding copies of one page cost more than the copies' bytes
    (docs/benchmarks.md, "Prefill").
    """

    def copy(pool):
        dst = jnp.where(copy_dst < 0, pool.shape[0], copy_dst)  # past the pool: dropped
        return pool.at[dst].set(pool[copy_src], mode="drop", unique_indices=True)

    return state.replace(cache=state.cache.map(copy))


@struct.dataclass
class AdmissionArrays:
    """The M admissions of a `prefill_insert` call on the device (`PackedRows`' ``adm_*`` arrays)."""

    token: jax.Array  # [M] the call's hidden state the admission samples from (flat: [R * C] or [N])
    slot: jax.Array  # [M], S for padding (dropped)
    key: jax.Array  # [M, 2]
    generated: jax.Array  # [M]
    forced: jax.Array  # [M], -1 = sample
    length: jax.Array  # [M] the slot's length after the prefill
    limit: jax.Array  # [M]
    stops: tuple  # device-side stop ids, stop sequences, the turn's tokens before its first
    order: jax.Array  # [M]
    sampling: SlotSampling

    @classmethod
    def of(cls, packed: PackedRows) -> AdmissionArrays:
        return cls(packed.adm_token, packed.adm_slot, packed.adm_key, packed.adm_generated, packed.adm_forced,
                   packed.adm_length, packed.adm_limit, packed.adm_stops, packed.adm_order,
                   SlotSampling(*packed.sampling))


def prefill_insert_step(params, state: DecodeState, tokens, tables, starts, lengths, compact, adm: AdmissionArrays,
                        *, plan: AttentionPlan, page_size, row_tokens, truncation=True):
    """Traced body of `Engine.prefill_insert`: write the rows' KV, sample, fill slots (the page
    copies follow in `copy_pages`); ``plan``: `forward`'s attention, its ``prefill_attention`` the
    prefill's; ``truncation``: compile the top-k / top-p sampling path (`sampling.sample`).

    ``compact``: None, ``tokens`` being the rows ``[R, C]`` (every token of every row computed),
    or ``(positions [N], token_index [N])`` of `CompactTokens`, ``tokens`` being their ``[N]``
    tokens. ``adm.token [M]``: each admission's hidden state among the call's, flat (``[R * C]``
    or ``[N]``)."""
    kw = dict(attend_len=tables.shape[1] * page_size, page_table=tables, write_len=lengths)
    if compact is None:
        positions = starts[:, None] + jnp.arange(row_tokens, dtype=jnp.int32)[None]
        hidden, cache = forward(params, tokens, positions, state.cache, starts, plan, **kw)
    else:
        positions, token_index = compact
        hidden, cache = forward(params, tokens, positions, state.cache, starts, plan, token_index=token_index,
                                row_tokens=row_tokens, **kw)
    sampled, log_prob, truncated = sample_next_token(params, hidden.reshape(-1, hidden.shape[-1])[adm.token], adm.key,
                                                     adm.generated, adm.sampling, truncation=truncation)
    forced = adm.forced >= 0
    first = jnp.where(forced, adm.forced, sampled)
    stop_ids, stop_seqs, before = adm.stops
    recent = jnp.concatenate([before[:, 1:], first[:, None]], axis=1)  # the turn's tokens so far, newest last
    generated = jnp.where(forced, adm.generated, adm.generated + 1)

    def put(field, values):
        return field.at[adm.slot].set(values, mode="drop")

    state = state.replace(
        cache=cache,
        lengths=put(state.lengths, adm.length),
        last_tokens=put(state.last_tokens, first),
        generated=put(state.generated, generated),
        keys=put(state.keys, adm.key),
        sampling=jax.tree.map(put, state.sampling, adm.sampling),
        active=put(state.active, True),
        limits=put(state.limits, adm.limit),
        stop_ids=put(state.stop_ids, stop_ids),
        stop_seqs=put(state.stop_seqs, stop_seqs),
        recent=put(state.recent, recent),
        order=put(state.order, adm.order),
    )
    valid = ~forced & (adm.slot < state.lengths.shape[0])
    return state, ResultTokens.pack(first, valid, generated, log_prob, truncated)
