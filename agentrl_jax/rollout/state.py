"""Device-side state of the rollout engine: the decode slots and prefilled prefixes.

`DecodeState` holds S decode slots. Slot s owns row s of the KV cache (``[L, S, M, KV,
K]``) plus per-slot scalars: how many cache entries are valid (`lengths`, which is also the
position of the next token fed), the token to feed next (`last_tokens`), how many tokens
the request has sampled so far (`generated`, the fold-in index of its next random key), the
request's own key, and its sampling parameters as arrays (so changing them never
recompiles).

`Prefix` is the result of a prefill: the KV entries of a prompt (one cache row of
``C`` entries, of which `length` are valid), and G first tokens sampled from the prompt's
last position, one per sample of a group, each with its own key. The first tokens are
not in the cache yet: they are fed by the next decode step.

Both are `flax.struct` dataclasses (pytrees) and travel through `jax.jit` with donation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from agentrl_jax.models import KV_CACHE_AXES, DecoderConfig, KVCache
from agentrl_jax.rollout.sampling import SlotSampling
from agentrl_jax.sharding import Rules, tree_shardings


@struct.dataclass
class DecodeState:
    """S decode slots on the mesh.

    Attributes:
      cache: KV cache, k and v ``[L, S, M, KV, K]``.
      lengths: [S] int32 valid cache entries = position of `last_tokens`.
      last_tokens: [S] int32 the sampled token that the next step feeds.
      generated: [S] int32 tokens the request has sampled so far (rng fold-in index).
      keys: [S, 2] uint32 the request's PRNG key.
      sampling: per-slot temperature / top_k / top_p, each [S].
      active: [S] bool slot holds a live request.
    """

    cache: KVCache
    lengths: jax.Array
    last_tokens: jax.Array
    generated: jax.Array
    keys: jax.Array
    sampling: SlotSampling
    active: jax.Array


@struct.dataclass
class Prefix:
    """A prefilled prompt and its G first sampled tokens.

    Attributes:
      cache: KV entries of the prompt, k and v ``[L, 1, C, KV, K]``.
      length: [] int32 valid entries (the prompt length, including any earlier turns).
      first_tokens: [G] int32 tokens sampled from the prompt's last position.
      log_prob: [G] float32 their full-distribution logprobs (see `sampling`).
      truncated_log_prob: [G] float32 their logprobs under the truncated sampler.
      keys: [G, 2] uint32 per-sample PRNG keys.
      generated: [G] int32 tokens sampled so far by each sample (>= 1).
      sampling: per-sample sampling params, each [G].
    """

    cache: KVCache
    length: jax.Array
    first_tokens: jax.Array
    log_prob: jax.Array
    truncated_log_prob: jax.Array
    keys: jax.Array
    generated: jax.Array
    sampling: SlotSampling

    @property
    def num_samples(self) -> int:
        return self.first_tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.cache.k.shape[2]


def _slot_axes(config: DecoderConfig) -> DecodeState:
    """Logical axes of every DecodeState leaf (slots over the data axes, kv heads over tensor)."""
    del config
    per_slot = ("slots",)
    return DecodeState(
        cache=KVCache(k=KV_CACHE_AXES, v=KV_CACHE_AXES),
        lengths=per_slot,
        last_tokens=per_slot,
        generated=per_slot,
        keys=("slots", None),
        sampling=SlotSampling(temperature=per_slot, top_k=per_slot, top_p=per_slot),
        active=per_slot,
    )


def _prefix_axes(config: DecoderConfig) -> Prefix:
    del config
    per_sample = (None,)
    return Prefix(
        cache=KVCache(k=KV_CACHE_AXES, v=KV_CACHE_AXES),
        length=(),
        first_tokens=per_sample,
        log_prob=per_sample,
        truncated_log_prob=per_sample,
        keys=(None, None),
        generated=per_sample,
        sampling=SlotSampling(temperature=per_sample, top_k=per_sample, top_p=per_sample),
    )


def decode_state_shapes(config: DecoderConfig, slots: int, max_len: int, cache_dtype) -> DecodeState:
    """`jax.ShapeDtypeStruct` of every DecodeState leaf."""
    return jax.eval_shape(lambda: init_decode_state(config, slots, max_len, cache_dtype))


def decode_state_shardings(
    config: DecoderConfig, slots: int, max_len: int, cache_dtype, mesh: Mesh, rules: Rules
) -> DecodeState:
    """NamedSharding of every DecodeState leaf (non-divisible dims replicated)."""
    shapes = decode_state_shapes(config, slots, max_len, cache_dtype)
    return tree_shardings(_slot_axes(config), mesh, rules, shapes=shapes)


def prefix_shardings(
    config: DecoderConfig, capacity: int, num_samples: int, cache_dtype, mesh: Mesh, rules: Rules
) -> Prefix:
    """NamedSharding of every Prefix leaf (the batch-1 cache row is replicated over slots)."""
    cache_shape = KVCache.shape(config, 1, capacity)
    g = num_samples
    shapes = Prefix(
        cache=KVCache(k=jax.ShapeDtypeStruct(cache_shape, cache_dtype), v=jax.ShapeDtypeStruct(cache_shape, cache_dtype)),
        length=jax.ShapeDtypeStruct((), jnp.int32),
        first_tokens=jax.ShapeDtypeStruct((g,), jnp.int32),
        log_prob=jax.ShapeDtypeStruct((g,), jnp.float32),
        truncated_log_prob=jax.ShapeDtypeStruct((g,), jnp.float32),
        keys=jax.ShapeDtypeStruct((g, 2), jnp.uint32),
        generated=jax.ShapeDtypeStruct((g,), jnp.int32),
        sampling=SlotSampling(*(jax.ShapeDtypeStruct((g,), d) for d in (jnp.float32, jnp.int32, jnp.float32))),
    )
    return tree_shardings(_prefix_axes(config), mesh, rules, shapes=shapes)


def init_decode_state(config: DecoderConfig, slots: int, max_len: int, cache_dtype) -> DecodeState:
    """All slots free: zero cache, greedy sampling, inactive."""
    zeros = jnp.zeros((slots,), jnp.int32)
    return DecodeState(
        cache=KVCache.init(config, slots, max_len, cache_dtype),
        lengths=zeros,
        last_tokens=zeros,
        generated=zeros,
        keys=jnp.zeros((slots, 2), jnp.uint32),
        sampling=SlotSampling(
            temperature=jnp.zeros((slots,), jnp.float32),
            top_k=zeros,
            top_p=jnp.ones((slots,), jnp.float32),
        ),
        active=jnp.zeros((slots,), bool),
    )


def prefill_bucket(length: int, minimum: int, maximum: int) -> int:
    """The padded length of a prompt chunk: the next power of two >= length, within [minimum, maximum].

    Powers of two keep the number of compiled prefill shapes at log2(maximum / minimum) + 1.
    """
    if length < 1:
        raise ValueError(f"prefill: true_length must be >= 1, got {length}")
    if length > maximum:
        raise ValueError(
            f"prefill: {length} tokens exceed max_prefill_length={maximum}; raise "
            "max_prefill_length or prefill the prompt in chunks (existing_prefix)"
        )
    bucket = max(minimum, 1 << (length - 1).bit_length())
    return min(bucket, maximum)
