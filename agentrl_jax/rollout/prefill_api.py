"""The Driver's prefill path of the `Engine` (the `PagedPrefillAPI` mixin): `prefill_insert`
writes a tick's new tokens straight into KV pages and fills decode slots in one call, over a
closed set of compiled shapes (`prefill_shapes`: rows, row width, attention window and the
tokens the dense layers compute) that `warmup` compiles before a run; the packing, the
compaction and the traced bodies are in `paged_prefill`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.profiler import TraceAnnotation
from jax.sharding import NamedSharding, PartitionSpec

from agentrl_jax.models.decode import DecodeParams
from agentrl_jax.rollout.decode_step import KERNEL_ATTENTION
from agentrl_jax.rollout.paged_prefill import (
    AdmissionArrays,
    PackedRows,
    PrefillRow,
    call_layout,
    copy_pages,
    empty_pack,
    pack_rows,
    prefill_insert_step,
    rows_bucket,
    window_pages,
)
from agentrl_jax.rollout.pages import pages_for
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.state import DecodeState, attend_bucket

logger = logging.getLogger(__name__)


class PrefillShape(NamedTuple):
    """One compiled `prefill_insert` program: ``rows`` packed rows of ``row_tokens`` (C), an
    attention ``window`` in pages, and the ``tokens`` its dense layers compute (all shards; ``rows``
    x C when the call is not compacted)."""

    rows: int
    row_tokens: int
    window: int
    tokens: int


class PagedPrefillAPI:
    """`Engine` methods of the paged prefill (uses the engine's mesh, slots, pages and programs)."""

    def prefill_insert(
        self, params: DecodeParams, decode_state: DecodeState, rows: Sequence[PrefillRow], *,
        row_cap: int | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """Prefill several sequences' new tokens into their pages and fill decode slots, in one call.

        Row r writes the KV of ``rows[r].tokens`` at entries ``[start, start + len)`` of its
        pages (earlier entries, e.g. a session's previous turns or a shared prompt, are read,
        not recomputed); then its ``copies`` duplicate pages (copy-on-write of a group's last
        partial page; a second, small call: `paged_prefill.copy_pages`); then each admission samples its first token from the row's last
        position (or takes its forced token) and fills its slot. See `paged_prefill`.
        ``row_cap``: packed rows per shard that the caller's token budget allows (the driver's
        budget / `prefill_row_tokens`): a call with fewer pieces pads up to at most this many.

        Returns:
          the new decode state and `ResultTokens` with one row per admission, in order
          (valid = 0 for forced tokens).
        """
        if not rows:
            raise ValueError("prefill_insert: no rows")
        with TraceAnnotation("engine/pack"):
            packed = self._pack(rows, row_cap)
        for m, a in enumerate(packed.admitted):
            self.pages.assign(a.slot, a.pages, int(packed.adm_length[m]), truncating=a.sampling.truncates)
        return self._run_prefill(params, self._sync(decode_state), packed)

    def _pack(self, rows: Sequence[PrefillRow], row_cap: int | None) -> PackedRows:
        reach = max(r.start + len(r.tokens) for r in rows)
        packed = pack_rows(
            rows, num_shards=self.num_shards, num_slots=self._slots, slots_per_shard=self._slots_per_shard,
            pages_per_shard=self.memory_plan.pages_per_shard, page_size=self.page_size,
            row_tokens=self.prefill_row_tokens, row_cap=row_cap, window=self._prefill_window(reach),
            max_prefill=self._max_prefill, max_length=self.max_target_length, compaction=self.prefill_compaction,
            first_order=self._admissions, stop_width=self.device_stop_ids, stop_seqs=self.device_stop_sequences,
        )
        self._admissions += len(packed.admitted)
        return packed

    def prefill_shape(self, rows: Sequence[PrefillRow], row_cap: int | None = None) -> PrefillShape:
        """The `PrefillShape` of the `prefill_insert` call for ``rows``."""
        C, D = self.prefill_row_tokens, self.num_shards
        pieces = [sum(-(-len(r.tokens) // C) for r in rows if r.shard == d) for d in range(D)]
        tokens = [sum(len(r.tokens) for r in rows if r.shard == d) for d in range(D)]
        per_shard, computed = call_layout(max(pieces), max(tokens), row_tokens=C, row_cap=row_cap,
                                          compaction=self.prefill_compaction)
        reach = max(r.start + len(r.tokens) for r in rows)
        return PrefillShape(D * per_shard, C, self._prefill_window(reach), D * computed)

    def prefill_shapes(self, token_budget: int) -> list[PrefillShape]:
        """Every `PrefillShape` a driver with this prefill token budget per tick meets: the closed set
        `warmup` compiles (rows per shard: powers of two up to budget / C; computed tokens: the
        buckets of `paged_prefill.tokens_bucket` of each row bucket)."""
        C = self.prefill_row_tokens
        cap = max(token_budget // C, 1)
        layouts = sorted({call_layout(r, t, row_tokens=C, row_cap=cap, compaction=self.prefill_compaction)
                          for r in {rows_bucket(n, cap) for n in range(1, cap + 1)} for t in range(1, r * C + 1)})
        windows, w = [], self._prefill_window(1)
        while True:
            windows.append(w)
            if w >= self.table_width:
                break
            w = self._prefill_window(2 * w * self.page_size)
        D = self.num_shards
        return [PrefillShape(D * r, C, w, D * n) for r, n in layouts for w in windows]

    def _prefill_window(self, reach: int) -> int:
        """Prefill attention window in pages: a power of two from 4 x attend_granule entries up;
        with the "pallas" prefill attention the whole table (the kernel reads each row's entries
        up to its own reach, whatever the table's width, so one width means fewer programs)."""
        if self.prefill_attention == "pallas":
            return self.table_width
        return window_pages(reach, page_size=self.page_size, floor=pages_for(4 * self._attend_granule, self.page_size),
                            table_width=self.table_width)

    def _run_prefill(self, params: DecodeParams, decode_state: DecodeState, packed: PackedRows,
                     truncation: bool | None = None):
        fn, args = self._prefill_call(params, decode_state, packed, truncation)
        with TraceAnnotation("engine/launch"):
            decode_state, first = fn(*args)
        if packed.num_copies or not packed.admitted:  # (no admission: a warm-up call compiles the copies too)
            key = packed.copy_src.shape[0]
            if key not in self._copy_fns:
                self._copy_fns[key] = jax.jit(copy_pages, donate_argnums=(0,), out_shardings=self.state_shardings)
            with TraceAnnotation("engine/launch_copies"):
                decode_state = self._copy_fns[key](decode_state, packed.copy_src, packed.copy_dst)
        return decode_state, first

    def _prefill_call(self, params: DecodeParams, decode_state: DecodeState, packed: PackedRows,
                      truncation: bool | None = None) -> tuple[Any, tuple]:
        """The jitted prefill program for ``packed``'s shape and its arguments; ``truncation``: compile
        the top-k / top-p sampling path (default: when an admission truncates, `SamplingParams.truncates`)."""
        if truncation is None:
            truncation = any(a.sampling.truncates for a in packed.admitted)
        key = (packed.tables.shape, packed.computed_tokens, packed.adm_token.shape[0], truncation)
        if key not in self._paged_prefill_fns:
            step = functools.partial(prefill_insert_step, plan=self.prefill_plan, page_size=self.page_size,
                                     row_tokens=self.prefill_row_tokens, truncation=truncation)
            self._paged_prefill_fns[key] = jax.jit(step, donate_argnums=(1,), out_shardings=(self.state_shardings, None))
        by_row = NamedSharding(self._mesh, PartitionSpec(self._rows_spec))
        by_row2 = NamedSharding(self._mesh, PartitionSpec(self._rows_spec, None))
        # compact tokens: D blocks of n, one per shard like the rows
        compact = packed.compact
        tokens = (packed.tokens, by_row2) if compact is None else (compact.tokens, by_row)
        with TraceAnnotation("engine/put_rows"):
            placed = jax.device_put(
                (tokens[0], packed.tables, packed.starts, packed.lengths,
                 None if compact is None else (compact.positions, compact.index)),
                (tokens[1], by_row2, by_row, by_row, None if compact is None else (by_row, by_row)),
            )
        # host arrays go to the jitted call as they are: it transfers them in one go (an eager
        # jnp.asarray per array cost more host time than the transfers)
        return self._paged_prefill_fns[key], (params, decode_state, *placed, AdmissionArrays.of(packed))

    def warmup(self, params: DecodeParams, decode_state: DecodeState, *, token_budget: int,
               num_steps: int | None, truncation: bool = False) -> tuple[DecodeState, dict[str, float]]:
        """Compile now every program a driver with this prefill budget and dispatch length runs.

        Runs each shape of `prefill_shapes` once with padding rows only (they write the trash
        page; no slot changes), one ``num_steps`` decode dispatch ("pallas": the only decode
        program; "xla": one per attention window, each run once) while no slot is live, and
        the batched slot frees of every size. With ``truncation`` the prefill and decode
        programs are compiled twice: also with the top-k / top-p sampling path, which calls
        run while a request with `SamplingParams.truncates` is admitted or decoding.
        With a persistent compilation cache the programs are loaded, not compiled, on restart.

        Returns:
          the decode state and ``{"prefill_shapes", "decode_shapes", "seconds"}`` (shapes, not
          counting the sampling variants).
        """
        if self.pages.live_slots():
            raise RuntimeError("Engine.warmup: slots are live; warm up before the first request")
        started = time.perf_counter()
        variants = (False, True) if truncation else (False,)
        for shape, truncates in itertools.product(self.prefill_shapes(token_budget), variants):
            packed = empty_pack(rows=shape.rows, row_tokens=shape.row_tokens, window=shape.window,
                                num_slots=self._slots, tokens=shape.tokens, stop_width=self.device_stop_ids,
                                stop_seqs=self.device_stop_sequences)
            decode_state, _ = self._run_prefill(params, self._sync(decode_state), packed, truncates)
        steps = 1 if num_steps is None else num_steps
        lengths = [self.table_width * self.page_size] if self.decode_attention in KERNEL_ATTENTION else sorted(
            {min(pages_for(attend_bucket(n, self.max_target_length, self._attend_granule), self.page_size),
                 self.table_width) * self.page_size for n in range(steps, self.max_target_length + steps + 1)})
        for attend_len, truncates in itertools.product(lengths, variants):  # no live slot: all write the trash page
            decode_state, _ = self._dispatch(params, self._sync(decode_state), num_steps, attend_len, truncates)
        frees = 1
        while True:  # the batched slot frees, padded to powers of two (`KVPages.take_deactivations`; slot S: dropped)
            decode_state = self._deactivate(decode_state, np.full((frees,), self._slots, np.int32))
            if frees >= self._slots:
                break
            frees *= 2
        jax.block_until_ready(decode_state)
        stats = {"prefill_shapes": len(self.prefill_shapes(token_budget)), "decode_shapes": len(lengths),
                 "seconds": time.perf_counter() - started}
        logger.info("rollout warm-up: %d prefill and %d decode programs in %.1f s", stats["prefill_shapes"],
                    stats["decode_shapes"], stats["seconds"])
        return decode_state, stats
