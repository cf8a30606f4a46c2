"""Device-side state of the rollout engine: the decode slots and prefilled prefixes.

`DecodeState` holds S decode slots over a paged KV cache: every layer's keys and values
are a pool of N pages ``[N, KV, P, K]`` (a `LayerCache` of pools, updated in place by the
decode step), and slot s reads and writes the pages listed in row s of `page_table`
(token t at entry ``t % P`` of page ``page_table[s, t // P]``; `rollout.pages` decides
which pages a slot gets). Per slot it also holds scalars: how many cache entries are valid (`lengths`, which is also the
position of the next token fed), the token to feed next (`last_tokens`), how many tokens
the request has sampled so far (`generated`, the fold-in index of its next random key), the
request's own key, and its sampling parameters as arrays (so changing them never
recompiles).

`Prefix` is the result of a prefill: the KV entries of a prompt (one row ``[1, KV, C, K]``
per layer, of which `length` entries are valid), and G first tokens sampled from the prompt's
last position, one per sample of a group, each with its own key. The first tokens are
not in the cache yet: they are fed by the next decode step.

Decode lanes: a decode step computes B rows (lanes), B = `DecodeState.lane_slot`'s length. With
B == S every slot is its own lane (the plain step). With B < S (`Engine(decode_batch=B)`) the
slots are the sequences held, and a slot admitted beyond the B lanes waits, ready (prefilled,
its first token sampled, its pages held), until a lane frees: on the device, a slot that
samples one of its `stop_ids`, completes one of its `stop_seqs` (a stop string's tokens,
matched against the `recent` tokens of its turn) or reaches its `limits` length is
deactivated within the dispatch, and at the next step its lane takes the ready slot
admitted first (`order`).
So a stop costs its lane nothing although the host only reads it a dispatch later
(`decode_step.lane_decode_step`).

Both are `flax.struct` dataclasses (pytrees) and travel through `jax.jit` with donation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from agentrl_jax.models import DecoderConfig
from agentrl_jax.models.decode import LayerCache
from agentrl_jax.rollout.sampling import SlotSampling
from agentrl_jax.sharding import Rules, tree_shardings


STOP_IDS = 8  # default stop token ids per slot that the lane step checks on the device (the host checks them all)
STOP_SEQUENCES = (2, 8)  # default stop sequences per slot the lane step checks, and their most tokens


@struct.dataclass
class DecodeState:
    """S decode slots on the mesh.

    Attributes:
      cache: KV pages, L k and v pools ``[N, KV, P, K]`` (pages split over the data axes
        like the slots; page ids in `page_table` are local to a slot's shard).
      page_table: [S, Tp] int32 each slot's pages (the trash page where it has none).
      lengths: [S] int32 valid cache entries = position of `last_tokens`.
      last_tokens: [S] int32 the sampled token that the next step feeds.
      generated: [S] int32 tokens the request has sampled so far (rng fold-in index).
      keys: [S, 2] uint32 the request's PRNG key.
      sampling: per-slot temperature / top_k / top_p, each [S].
      active: [S] bool slot holds a live request.
      stop_ids: [S, I] int32 token ids that end the slot's turn on the device (-1: none; I:
        `Engine(device_stop_ids=)`, default `STOP_IDS`);
        read by the lane step only (the host checks every stop id and string itself).
      stop_seqs: [S, Q, L] int32 token sequences that end the slot's turn on the device when
        its newest tokens are one of them: a stop string's tokens (`StopMatcher.sequences`),
        right-aligned, -1 before them; a row of -1: none (Q, L: `Engine(device_stop_sequences=)`,
        default `STOP_SEQUENCES`); read by the lane step only.
      recent: [S, L] int32 the turn's last L tokens, the newest last (-1 before its first);
        kept by the lane step only.
      limits: [S] int32 the length at which the slot stops advancing (its turn's last token is
        sampled at length limits - 1); read by the lane step only.
      order: [S] int32 admission order: ready slots take free lanes first come, first served.
      lane_slot: [B] int32 the slot each decode lane computes (-1: none); B == S: unused.
    """

    cache: LayerCache
    page_table: jax.Array
    lengths: jax.Array
    last_tokens: jax.Array
    generated: jax.Array
    keys: jax.Array
    sampling: SlotSampling
    active: jax.Array
    stop_ids: jax.Array
    stop_seqs: jax.Array
    recent: jax.Array
    limits: jax.Array
    order: jax.Array
    lane_slot: jax.Array

    @property
    def num_lanes(self) -> int:
        return self.lane_slot.shape[0]

    @property
    def page_size(self) -> int:
        return self.cache.k[0].shape[2]


@struct.dataclass
class Prefix:
    """A prefilled prompt and its G first sampled tokens.

    Attributes:
      cache: KV entries of the prompt, L k and v rows ``[1, KV, C, K]``.
      length: [] int32 valid entries (the prompt length, including any earlier turns).
      first_tokens: [G] int32 tokens sampled from the prompt's last position.
      log_prob: [G] float32 their full-distribution logprobs (see `sampling`).
      truncated_log_prob: [G] float32 their logprobs under the truncated sampler.
      keys: [G, 2] uint32 per-sample PRNG keys.
      generated: [G] int32 tokens sampled so far by each sample (>= 1).
      sampling: per-sample sampling params, each [G].
      truncating: [] bool, whether they sample with top-k / top-p (`SamplingParams.truncates`);
        `insert` hands it to the slot table, which decides whether a decode dispatch compiles
        the sorted sampling path. A leaf, not static metadata, so every prefix has the tree
        structure of `DensePrefixEngine.get_prefix_destination_sharding` (JetStream's
        transfers `device_put` prefixes onto it); `insert` reads it with the prefix's length, which it reads anyway.
    """

    cache: LayerCache
    length: jax.Array
    first_tokens: jax.Array
    log_prob: jax.Array
    truncated_log_prob: jax.Array
    keys: jax.Array
    generated: jax.Array
    sampling: SlotSampling
    truncating: jax.Array

    @property
    def num_samples(self) -> int:
        return self.first_tokens.shape[0]

    @property
    def capacity(self) -> int:
        return self.cache.max_len


def _slot_axes(config: DecoderConfig) -> DecodeState:
    """Logical axes of every DecodeState leaf (slots over the data axes, kv heads over tensor)."""
    per_slot = ("slots",)
    return DecodeState(
        cache=LayerCache.logical_axes(config),
        page_table=("slots", None),
        lengths=per_slot,
        last_tokens=per_slot,
        generated=per_slot,
        keys=("slots", None),
        sampling=SlotSampling(temperature=per_slot, top_k=per_slot, top_p=per_slot),
        active=per_slot,
        stop_ids=("slots", None),
        stop_seqs=("slots", None, None),
        recent=("slots", None),
        limits=per_slot,
        order=per_slot,
        lane_slot=per_slot,  # lanes split over the data axes like the slots they take
    )


def _prefix_axes(config: DecoderConfig) -> Prefix:
    per_sample = (None,)
    return Prefix(
        cache=LayerCache.logical_axes(config),
        length=(),
        first_tokens=per_sample,
        log_prob=per_sample,
        truncated_log_prob=per_sample,
        keys=(None, None),
        generated=per_sample,
        sampling=SlotSampling(temperature=per_sample, top_k=per_sample, top_p=per_sample),
        truncating=(),
    )


def decode_state_shapes(
    config: DecoderConfig, slots: int, num_pages: int, page_size: int, table_width: int, cache_dtype,
    lanes: int | None = None, stop_ids: int = STOP_IDS, stop_seqs: tuple[int, int] = STOP_SEQUENCES,
) -> DecodeState:
    """`jax.ShapeDtypeStruct` of every DecodeState leaf."""
    return jax.eval_shape(lambda: init_decode_state(config, slots, num_pages, page_size, table_width, cache_dtype,
                                                    lanes, stop_ids, stop_seqs))


def decode_state_shardings(
    config: DecoderConfig, slots: int, num_pages: int, page_size: int, table_width: int, cache_dtype,
    mesh: Mesh, rules: Rules, lanes: int | None = None, stop_ids: int = STOP_IDS,
    stop_seqs: tuple[int, int] = STOP_SEQUENCES,
) -> DecodeState:
    """NamedSharding of every DecodeState leaf (non-divisible dims replicated)."""
    shapes = decode_state_shapes(config, slots, num_pages, page_size, table_width, cache_dtype, lanes, stop_ids,
                                 stop_seqs)
    return tree_shardings(_slot_axes(config), mesh, rules, shapes=shapes)


def prefix_shardings(
    config: DecoderConfig, capacity: int, num_samples: int, cache_dtype, mesh: Mesh, rules: Rules
) -> Prefix:
    """NamedSharding of every Prefix leaf (the batch-1 cache row is replicated over slots)."""
    row = (jax.ShapeDtypeStruct(LayerCache.shape(config, 1, capacity), cache_dtype),) * config.num_layers
    g = num_samples
    shapes = Prefix(
        cache=LayerCache(k=row, v=row),
        length=jax.ShapeDtypeStruct((), jnp.int32),
        first_tokens=jax.ShapeDtypeStruct((g,), jnp.int32),
        log_prob=jax.ShapeDtypeStruct((g,), jnp.float32),
        truncated_log_prob=jax.ShapeDtypeStruct((g,), jnp.float32),
        keys=jax.ShapeDtypeStruct((g, 2), jnp.uint32),
        generated=jax.ShapeDtypeStruct((g,), jnp.int32),
        sampling=SlotSampling(*(jax.ShapeDtypeStruct((g,), d) for d in (jnp.float32, jnp.int32, jnp.float32))),
        truncating=jax.ShapeDtypeStruct((), jnp.bool_),
    )
    return tree_shardings(_prefix_axes(config), mesh, rules, shapes=shapes)


def init_decode_state(
    config: DecoderConfig, slots: int, num_pages: int, page_size: int, table_width: int, cache_dtype,
    lanes: int | None = None, stop_ids: int = STOP_IDS, stop_seqs: tuple[int, int] = STOP_SEQUENCES,
) -> DecodeState:
    """All slots free: zero pages, every table entry on the trash page, greedy sampling, inactive;
    ``lanes`` decode lanes (default: one per slot), all free; room for ``stop_ids`` device-side stop ids
    and ``stop_seqs`` = (Q, L): Q stop sequences of at most L tokens."""
    zeros = jnp.zeros((slots,), jnp.int32)
    lanes = slots if lanes is None else lanes
    return DecodeState(
        cache=LayerCache.init(config, num_pages, page_size, cache_dtype),  # [N, KV, P, K]: rows are pages
        page_table=jnp.zeros((slots, table_width), jnp.int32),
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
        stop_ids=jnp.full((slots, stop_ids), -1, jnp.int32),
        stop_seqs=jnp.full((slots, *stop_seqs), -1, jnp.int32),
        recent=jnp.full((slots, stop_seqs[1]), -1, jnp.int32),
        limits=zeros,
        order=zeros,
        lane_slot=jnp.full((lanes,), -1, jnp.int32),
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


def attend_bucket(length: int, maximum: int, granule: int = 256) -> int:
    """The attention window of a decode dispatch: ``length`` rounded up, at most ``maximum``.

    Steps are multiples of ``granule`` and at least a quarter of the largest power of two
    <= length: a window wastes at most max(granule, length / 4) entries, and the number
    of compiled windows grows by about four per doubling of the cache.
    """
    if length < 1:
        raise ValueError(f"attend_bucket: length must be >= 1, got {length}")
    step = max(granule, (1 << (length.bit_length() - 1)) // 4 // granule * granule)
    return min(maximum, -(-length // step) * step)
