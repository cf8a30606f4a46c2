"""JetStream's dense prefixes next to the paged cache: the traced bodies of `Engine.prefill`,
`Engine.insert` and `Engine.extract_prefix`.

JetStream's `prefill` takes no decode state, so its result is a dense, batch-1 KV row
(`Prefix`) outside the page pool; `insert` copies it into pages, `extract_prefix` copies
pages back out. The `Driver` never uses them: it prefills straight into pages
(`paged_prefill`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from agentrl_jax.models.decode import LayerCache, forward
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import next_token_logits, sample, step_keys
from agentrl_jax.rollout.state import DecodeState, Prefix


def _resize_row(cache: LayerCache, capacity: int) -> LayerCache:
    """Keep the first `capacity` entries of a cache row, zero-padding when it is shorter."""

    def one(x):
        have = x.shape[2]
        if have >= capacity:
            return x[:, :, :capacity]
        return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - have), (0, 0)))

    return cache.map(one)


def prefill_step(params, old_cache, start, tokens, true_length, keys, generated, sampling, *, capacity, config,
                 cache_dtype, dtype):
    """Traced body of `Engine.prefill`: the prompt chunk through the model into a dense row, G first tokens."""
    if old_cache is None:
        cache = LayerCache.init(config, 1, capacity, cache_dtype)
    else:
        cache = _resize_row(old_cache, capacity)
    positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    hidden, cache = forward(
        params, tokens[None], positions[None], cache, start[None],
        config=config, attend_len=capacity, dtype=dtype,
    )
    last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, keepdims=True)
    logits = next_token_logits(last, *params.output_embedding())
    num_samples = keys.shape[0]
    logits = jnp.broadcast_to(logits, (num_samples, logits.shape[-1]))
    first, log_prob, truncated = sample(logits, step_keys(keys, generated), sampling)
    prefix = Prefix(
        cache=cache,
        length=start + true_length,
        first_tokens=first,
        log_prob=log_prob,
        truncated_log_prob=truncated,
        keys=keys,
        generated=generated + 1,
        sampling=sampling,
    )
    ones = jnp.ones((num_samples,), jnp.int32)
    return prefix, ResultTokens.pack(first, ones, generated + 1, log_prob, truncated)


def insert_step(prefix: Prefix, state: DecodeState, slots, pages, *, num_pages):
    """Traced body of `Engine.insert`: a dense prefix row into ``num_pages`` pages of each slot, slot scalars set."""
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
    )


def extract_step(state: DecodeState, pages, slot, length, generated, *, capacity):
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
    )
