"""JetStream's dense prefixes next to the paged cache: `DensePrefixEngine`, the `Engine` with
JetStream's `prefill`, `insert`, `bulk_insert` and `extract_prefix`, and their traced bodies.

JetStream's `prefill` takes no decode state, so its result is a dense, batch-1 KV row
(`Prefix`) outside the page pool; `insert` copies it into pages (the G slots of a
`bulk_insert` share the prompt's full pages and each own a copy of the last partial
page), `extract_prefix` copies pages back out. The `Driver` never uses them: it prefills
straight into pages (`paged_prefill`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.models.decode import AttentionPlan, DecodeParams, LayerCache, forward
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.pages import TRASH_PAGE, OutOfPages, pages_for
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import SamplingParams, SlotSampling, request_key, sample_next_token
from agentrl_jax.rollout.state import (
    DecodeState,
    Prefix,
    prefill_bucket,
    prefix_shardings,
)


def _resize_row(cache: LayerCache, capacity: int) -> LayerCache:
    """Keep the first `capacity` entries of a cache row, zero-padding when it is shorter."""

    def one(x):
        have = x.shape[2]
        if have >= capacity:
            return x[:, :, :capacity]
        return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - have), (0, 0)))

    return cache.map(one)


def prefill_step(params, old_cache, start, tokens, true_length, keys, generated, sampling, *, capacity, config,
                 cache_dtype, dtype, truncation):
    """Traced body of `Engine.prefill`: the prompt chunk through the model into a dense row, G first tokens
    (``truncation``: the samples use top-k / top-p; `sampling.sample`)."""
    if old_cache is None:
        cache = LayerCache.init(config, 1, capacity, cache_dtype)
    else:
        cache = _resize_row(old_cache, capacity)
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    hidden, cache = forward(params, tokens[None], positions[None], cache, start[None], AttentionPlan(config, dtype),
                            attend_len=capacity)
    last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, keepdims=True)
    first, log_prob, truncated = sample_next_token(params, last, keys, generated, sampling, truncation=truncation)
    num_samples = keys.shape[0]
    prefix = Prefix(
        cache=cache,
        length=start + true_length,
        first_tokens=first,
        log_prob=log_prob,
        truncated_log_prob=truncated,
        keys=keys,
        generated=generated + 1,
        sampling=sampling,
        truncating=jnp.asarray(truncation),
    )
    ones = jnp.ones((num_samples,), jnp.int32)
    return prefix, ResultTokens.pack(first, ones, generated + 1, log_prob, truncated)


def insert_step(prefix: Prefix, state: DecodeState, slots, pages, order, *, num_pages, max_length):
    """Traced body of `Engine.insert`: a dense prefix row into ``num_pages`` pages of each slot, slot scalars set
    (no device-side stop: the slots decode up to ``max_length``; ``order``: their admission order)."""
    P, K = state.page_size, state.cache.k[0].shape[3]

    def write(pool, row):  # row [1, KV, C, K] -> num_pages pages [n, KV, P, K]
        need = num_pages * P
        row = row[0, :, :need]
        row = jnp.pad(row, ((0, 0), (0, need - row.shape[1]), (0, 0)))
        blocks = row.reshape(row.shape[0], num_pages, P, K).transpose(1, 0, 2, 3).astype(pool.dtype)
        for g in range(slots.shape[0]):
            pool = pool.at[pages[g]].set(blocks)
        return pool

    def put(field, values):
        return field.at[slots].set(values)

    return state.replace(
        cache=jax.tree.map(write, state.cache, prefix.cache),
        lengths=put(state.lengths, jnp.broadcast_to(prefix.length, slots.shape)),
        last_tokens=put(state.last_tokens, prefix.first_tokens),
        generated=put(state.generated, prefix.generated),
        keys=put(state.keys, prefix.keys),
        sampling=jax.tree.map(put, state.sampling, prefix.sampling),
        active=put(state.active, True),
        limits=put(state.limits, max_length),
        stop_ids=put(state.stop_ids, -1),
        stop_seqs=put(state.stop_seqs, -1),
        recent=put(state.recent, -1),
        order=put(state.order, order),
    )


def extract_step(state: DecodeState, pages, slot, length, generated, truncating, *, capacity):
    """Traced body of `Engine.extract_prefix`: a slot's pages gathered into a dense prefix row."""
    def gather(pool):  # [n, KV, P, K] -> [1, KV, capacity, K]
        blocks = pool[pages]
        row = blocks.transpose(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[3])
        return row[None, :, :capacity]

    one = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
    return Prefix(
        cache=state.cache.map(gather),
        length=length,
        first_tokens=one(state.last_tokens),
        log_prob=jnp.zeros((1,), jnp.float32),
        truncated_log_prob=jnp.zeros((1,), jnp.float32),
        keys=one(state.keys),
        generated=generated[None],
        sampling=jax.tree.map(one, state.sampling),
        truncating=truncating,
    )


class DensePrefixEngine(Engine):
    """The `Engine` with JetStream's dense-prefix calls (same arguments as `Engine`).

    ``min_prefill_bucket`` (an `Engine` argument) is the smallest padded length of `prefill`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prefill_fns: dict[tuple, Any] = {}
        self._insert_fns: dict[int, Any] = {}
        self._extract_fns: dict[int, Any] = {}

    @property
    def samples_per_slot(self) -> int:
        return 1

    def _global(self, shard: int, pages: Sequence[int]) -> list[int]:
        """Shard-local page ids as ids of the whole pool."""
        return [shard * self.memory_plan.pages_per_shard + p for p in pages]

    def get_prefix_destination_sharding(self, capacity: int | None = None, num_samples: int = 1) -> Prefix:
        """The sharding of a `Prefix` of `capacity` cache entries (JetStream API)."""
        capacity = self._max_prefill if capacity is None else capacity
        return prefix_shardings(self.config, capacity, num_samples, self.cache_dtype, self._mesh, self._rules)

    # ---- prefill (JetStream: a prompt's KV as a dense prefix row) ----------------------

    def prefill(
        self,
        *,
        params: DecodeParams,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray | Sequence[int],
        true_length: int,
        sampler: SamplingParams | None = None,
        num_samples: int = 1,
    ) -> tuple[Prefix, ResultTokens]:
        """Prefill a prompt (or extend `existing_prefix` with new tokens) and sample G first tokens.

        The prefix is a dense KV row outside the page pool (JetStream's prefill takes no
        decode state); `insert` moves it into pages. The `Driver` instead prefills straight
        into pages (`prefill_insert`).

        Args:
          params: params from `load_params`.
          existing_prefix: a prefix to continue (multi-turn); its keys and sample counter carry
            over, and only `padded_tokens[:true_length]` runs through the model.
          padded_tokens: [T] int token ids; padded to a power-of-two bucket here if needed.
          true_length: number of real tokens in `padded_tokens`.
          sampler: sampling params of the request (default greedy). Its `seed` (default 0)
            keys the samples unless `existing_prefix` carries keys.
          num_samples: G samples of this prompt (a GRPO group); each gets its own key
            `fold_in(PRNGKey(seed), g)` and its own first token.

        Returns:
          `(prefix, result)` with `result` holding the G first tokens (rows = samples).
        """
        sampler = sampler if sampler is not None else SamplingParams(temperature=0.0)
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 1 <= true_length <= tokens.shape[0]:
            raise ValueError(f"prefill: true_length={true_length} must be in [1, {tokens.shape[0]}]")
        bucket = prefill_bucket(true_length, self._min_bucket, self._max_prefill)
        tokens = np.pad(tokens[:true_length], (0, bucket - true_length))
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        total = start + true_length
        if total >= self.max_target_length:
            raise ValueError(
                f"prefill: prompt of {total} tokens (existing prefix {start} + {true_length} new) leaves "
                f"no room to generate within max_target_length={self.max_target_length}"
            )
        capacity = min(prefill_bucket(total, self._min_bucket, 1 << 62), self.max_target_length)
        if existing_prefix is None:
            keys = jnp.stack([request_key(sampler.seed or 0, g) for g in range(num_samples)])
            generated = jnp.zeros((num_samples,), jnp.int32)
            old_cache = None
        else:
            if existing_prefix.num_samples != num_samples:
                raise ValueError(
                    f"prefill: existing_prefix has {existing_prefix.num_samples} samples, "
                    f"num_samples={num_samples}; a continuation keeps its sample count"
                )
            keys, generated, old_cache = existing_prefix.keys, existing_prefix.generated, existing_prefix.cache
        truncation = sampler.truncates
        key = (bucket, capacity, None if old_cache is None else old_cache.max_len, num_samples, truncation)
        if key not in self._prefill_fns:
            self._prefill_fns[key] = jax.jit(
                functools.partial(prefill_step, capacity=capacity, config=self.config, cache_dtype=self.cache_dtype,
                                  dtype=self._dtype, truncation=truncation),
                out_shardings=(self.get_prefix_destination_sharding(capacity, num_samples), None),
            )
        sampling = SlotSampling.from_params(sampler, num_samples)
        return self._prefill_fns[key](
            params, old_cache, jnp.int32(start), jnp.asarray(tokens), jnp.int32(true_length), keys, generated, sampling
        )

    # ---- insert (JetStream: a dense prefix into pages) ----------------------------------

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Move sample 0 of `prefix` into `slot`'s fresh pages (the decode state is donated)."""
        first = lambda x: x[:1]
        single = prefix.replace(
            first_tokens=first(prefix.first_tokens),
            log_prob=first(prefix.log_prob),
            truncated_log_prob=first(prefix.truncated_log_prob),
            keys=first(prefix.keys),
            generated=first(prefix.generated),
            sampling=jax.tree.map(first, prefix.sampling),
        )
        return self._insert_dense(single, decode_state, [slot])

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """The G samples of one prefill into G slots: one prompt, G rollouts (GRPO).

        Slots of one shard share the prompt's full pages (one copy, G references); each
        slot gets its own copy of the last, partial page, which it goes on writing.
        """
        if len(slots) != prefix.num_samples:
            raise ValueError(
                f"bulk_insert: {len(slots)} slots for a prefix with {prefix.num_samples} samples; "
                "prefill with num_samples=len(slots)"
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"bulk_insert: slots must be distinct, got {list(slots)}")
        return self._insert_dense(prefix, decode_state, list(slots))

    def _insert_dense(self, prefix: Prefix, state: DecodeState, slots: list[int]) -> DecodeState:
        length, truncating = int(prefix.length), bool(prefix.truncating)
        P = self.page_size
        full, n = length // P, pages_for(length, P)
        for slot in slots:
            self.pages.release_slot(slot)
        tables = []
        for shard in sorted({self.shard_of(s) for s in slots}):
            mine = [s for s in slots if self.shard_of(s) == shard]
            if self.pages.num_free(shard) < full + (n - full) * len(mine):
                raise OutOfPages(
                    f"insert: a prefix of {length} tokens into {len(mine)} slot(s) of shard {shard} needs "
                    f"{full + (n - full) * len(mine)} pages, {self.pages.num_free(shard)} are free"
                )
            shared = self.pages.alloc(shard, full)
            self.pages.incref(shard, shared * (len(mine) - 1))
            for slot in mine:
                pages = shared + self.pages.alloc(shard, n - full)
                self.pages.assign(slot, pages, length, truncating=truncating)
        tables = [self._global(self.shard_of(s), self.pages.slot_pages(s)) for s in slots]
        state = self._sync(state)
        if n not in self._insert_fns:
            self._insert_fns[n] = jax.jit(
                functools.partial(insert_step, num_pages=n, max_length=self.max_target_length), donate_argnums=(1,),
                out_shardings=self.state_shardings,
            )
        order = np.arange(self._admissions, self._admissions + len(slots), dtype=np.int32)
        self._admissions += len(slots)
        return self._insert_fns[n](prefix, state, jnp.asarray(slots, jnp.int32), jnp.asarray(tables, jnp.int32),
                                   jnp.asarray(order))

    def extract_prefix(self, decode_state: DecodeState, slot: int, *, length: int, generated: int) -> Prefix:
        """A dense copy of `slot`'s first `length` cache entries as a 1-sample `Prefix`.

        For JetStream-style callers that continue a trajectory with `prefill(existing_prefix=...)`;
        the `Driver` keeps a session's pages instead (no copy).

        Args:
          length: valid entries to keep (tokens whose k/v are already in the cache).
          generated: tokens the request has sampled so far (keeps its random stream).
        """
        if not 0 < length < self.max_target_length:
            raise ValueError(f"extract_prefix: length={length} must be in (0, {self.max_target_length})")
        capacity = min(prefill_bucket(length, self._min_bucket, 1 << 62), self.max_target_length)
        n = pages_for(capacity, self.page_size)
        pages = self._global(self.shard_of(slot), self.pages.slot_pages(slot))[:n]
        pages += [TRASH_PAGE] * (n - len(pages))
        decode_state = self._sync(decode_state)
        if capacity not in self._extract_fns:
            self._extract_fns[capacity] = jax.jit(
                functools.partial(extract_step, capacity=capacity),
                out_shardings=self.get_prefix_destination_sharding(capacity, 1),
            )
        return self._extract_fns[capacity](
            decode_state, jnp.asarray(pages, jnp.int32), jnp.int32(slot), jnp.int32(length), jnp.int32(generated),
            jnp.asarray(self.pages.truncating(slot)),
        )

