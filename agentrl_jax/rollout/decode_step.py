"""The traced body of `Engine.generate` (one decode step for every slot, or N of them in a loop),
and the choice of its attention (and of the paged prefill's).

Each step feeds every slot's last token at its length, writes its k/v through the slot's
page table, samples the next token with the slot's key and sampling parameters (exact
logprobs, `rollout.sampling`), and advances the slots that are active and below the
longest sequence. N steps run in one `lax.fori_loop` and stack their results as [N, S].

With fewer decode lanes than slots (`DecodeState.lane_slot`, `Engine(decode_batch=)`), a
step computes the B lanes instead (`lane_decode_step`): each lane keeps its slot until the
slot stops (a stop id, a stop string's tokens, its length limit, or a deactivation by the
host), then takes the ready slot admitted first (`assign_lanes`); the lanes' inputs are
gathered from their slots and their results scattered back, so results stay [N, S] per slot
(valid = 0 where a slot did not run). A slot's tokens depend only on its own key and history,
never on its lane.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from agentrl_jax.models import Decoder
from agentrl_jax.models.decode import PREFILL_ATTENTION_IMPLS as PREFILL_ATTENTION
from agentrl_jax.models.decode import AttentionPlan, forward
from agentrl_jax.models.tpu_decode_attention import tpu_kernel_fits
from agentrl_jax.rollout.pages import TRASH_PAGE
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import sample_next_token
from agentrl_jax.rollout.state import DecodeState

DECODE_ATTENTION = ("xla", "pallas", "pallas_tpu")
KERNEL_ATTENTION = ("pallas", "pallas_tpu")  # the kernels read each slot up to its own length: no window


def decode_step(params, state: DecodeState, *, plan: AttentionPlan, attend_len, max_length, truncation=True,
                shards=1):
    """One token for every slot: ``(new state, (tokens, valid, generated, log_prob, truncated))``, each [S];
    ``plan``: the decode attention (`models.decode.forward`); ``truncation``: compile the top-k / top-p
    sampling path (`sampling.sample`). With fewer lanes than slots, `lane_decode_step` (``shards``: the
    data shards the slots and lanes are split over)."""
    if state.num_lanes < state.lengths.shape[0]:
        return lane_decode_step(params, state, plan=plan, attend_len=attend_len, max_length=max_length,
                                truncation=truncation, shards=shards)
    hidden, cache = forward(params, state.last_tokens[:, None], state.lengths[:, None], state.cache, state.lengths,
                            plan, attend_len=attend_len, page_table=state.page_table)
    tokens, log_prob, truncated = sample_next_token(params, hidden[:, -1], state.keys, state.generated,
                                                    state.sampling, truncation=truncation)
    valid = state.active & (state.lengths < max_length)
    step = valid.astype(jnp.int32)
    new_state = state.replace(
        cache=cache,
        lengths=state.lengths + step,
        last_tokens=jnp.where(valid, tokens, state.last_tokens),
        generated=state.generated + step,
        active=valid,
    )
    return new_state, (tokens, valid, new_state.generated, log_prob, truncated)


def assign_lanes(lane_slot: jax.Array, active: jax.Array, order: jax.Array, *, shards: int) -> jax.Array:
    """The slot each lane computes this step: ``[B]`` global slot ids, -1 for an idle lane.

    A lane keeps its slot while the slot is active; a lane whose slot stopped or was
    deactivated (and an idle lane) takes the ready slot (active, held by no lane) with the
    smallest admission ``order``, among the slots of its own data shard (a slot's pages
    live there). Lanes and slots are split over ``shards`` blocks alike.
    """
    S, B = active.shape[0], lane_slot.shape[0]
    slots, lanes = S // shards, B // shards
    unready = jnp.iinfo(jnp.int32).max

    def one_shard(held, act, admitted, base):  # held [lanes] global ids; act, admitted [slots]
        local = held - base
        keep = (held >= 0) & act[jnp.clip(local, 0, slots - 1)]
        running = jnp.zeros((slots,), bool).at[jnp.where(keep, local, slots)].set(True, mode="drop")
        ready = act & ~running
        queue = jnp.argsort(jnp.where(ready, admitted, unready))[:lanes]  # ready slots, first admitted first
        rank = jnp.cumsum(~keep) - 1  # the free lanes take the queue in lane order
        take = ~keep & (rank < ready.sum())
        new = jnp.where(take, queue[jnp.clip(rank, 0, lanes - 1)], -1)
        return jnp.where(keep, held, jnp.where(take, new + base, -1))

    bases = jnp.arange(shards, dtype=jnp.int32) * slots
    return jax.vmap(one_shard)(lane_slot.reshape(shards, lanes), active.reshape(shards, slots),
                               order.reshape(shards, slots), bases).reshape(B)


def lane_decode_step(params, state: DecodeState, *, plan: AttentionPlan, attend_len, max_length, truncation=True,
                     shards=1):
    """One token for each of B < S lanes (see the module docstring); results per slot, each [S].

    A lane's slot is fed, written and sampled exactly as `decode_step` would (same key, same
    position, same pages), so tokens and logprobs do not depend on lanes. A slot advances while
    its length is below ``min(limits, max_length)``; when it samples one of its ``stop_ids``,
    completes one of its ``stop_seqs`` (its turn's newest tokens, kept in ``recent``) or reaches
    that length it is deactivated, and its lane takes a ready slot at the next step.
    """
    S = state.lengths.shape[0]
    lane_slot = assign_lanes(state.lane_slot, state.active, state.order, shards=shards)
    live = lane_slot >= 0
    slot = jnp.where(live, lane_slot, 0)

    def lanes(x):
        return x[slot]

    lengths = jnp.where(live, lanes(state.lengths), 0)
    table = jnp.where(live[:, None], lanes(state.page_table), TRASH_PAGE)  # an idle lane writes the trash page
    hidden, cache = forward(params, lanes(state.last_tokens)[:, None], lengths[:, None], state.cache, lengths, plan,
                            attend_len=attend_len, page_table=table)
    tokens, log_prob, truncated = sample_next_token(params, hidden[:, -1], lanes(state.keys), lanes(state.generated),
                                                    jax.tree.map(lanes, state.sampling), truncation=truncation)
    limit = jnp.minimum(lanes(state.limits), max_length)
    valid = live & (lengths < limit)
    recent = jnp.concatenate([lanes(state.recent)[:, 1:], tokens[:, None]], axis=1)  # [B, L], newest last
    stopped = ((tokens[:, None] == lanes(state.stop_ids)).any(axis=-1)
               | completes_sequence(recent, lanes(state.stop_seqs)) | (lengths + 1 >= limit))
    to = jnp.where(valid, slot, S)  # S: dropped (idle or stopped lanes)

    def put(field, values):
        return field.at[to].set(values, mode="drop")

    new_state = state.replace(
        cache=cache,
        lengths=state.lengths.at[to].add(1, mode="drop"),
        last_tokens=put(state.last_tokens, tokens),
        generated=state.generated.at[to].add(1, mode="drop"),
        recent=put(state.recent, recent),
        # a slot that stops, or that a lane took at its limit (a one-token turn), leaves its lane
        active=state.active.at[jnp.where(live & (stopped | ~valid), slot, S)].set(False, mode="drop"),
        lane_slot=lane_slot,
    )
    zeros = jnp.zeros((S,), jnp.float32)
    out_valid = jnp.zeros((S,), bool).at[to].set(True, mode="drop")
    return new_state, (put(jnp.zeros((S,), jnp.int32), tokens), out_valid, new_state.generated,
                       put(zeros, log_prob), put(zeros, truncated))


def completes_sequence(recent: jax.Array, sequences: jax.Array) -> jax.Array:
    """``[B]`` whether each row's newest tokens ``recent [B, L]`` (newest last, -1 before the turn's
    first) end with one of its ``sequences [B, Q, L]`` (right-aligned, -1 before them; a row of
    -1 is no sequence)."""
    used = sequences[:, :, -1] >= 0
    matches = ((sequences < 0) | (sequences == recent[:, None, :])).all(axis=-1)
    return (used & matches).any(axis=-1)


def generate_steps(params, state: DecodeState, *, num_steps: int | None, **step_kw) -> tuple[DecodeState, ResultTokens]:
    """`decode_step` once ([S] results) or ``num_steps`` times in a `fori_loop` ([N, S] results)."""
    if num_steps is None:
        state, out = decode_step(params, state, **step_kw)
        return state, ResultTokens.pack(*out)
    slots = state.lengths.shape[0]  # results per slot (lanes scatter theirs back)
    buffers = (
        jnp.zeros((num_steps, slots), jnp.int32),
        jnp.zeros((num_steps, slots), bool),
        jnp.zeros((num_steps, slots), jnp.int32),
        jnp.zeros((num_steps, slots), jnp.float32),
        jnp.zeros((num_steps, slots), jnp.float32),
    )

    def body(i, carry):
        state, buffers = carry
        state, out = decode_step(params, state, **step_kw)
        return state, tuple(b.at[i].set(o) for b, o in zip(buffers, out))

    state, buffers = jax.lax.fori_loop(0, num_steps, body, (state, buffers))
    return state, ResultTokens.pack(*buffers)


def choose_prefill_attention(requested: str | None, model: Decoder, mesh: Mesh, page_size: int) -> str:
    """The paged prefill's attention: ``requested``, or by default "pallas" (the GPU kernel of
    `models.prefill_attention`) where the GPU decode default is "pallas" (a GPU mesh, a 16-bit
    compute dtype, a power-of-two head dim), else "xla" (see `Engine`'s ``prefill_attention``).
    There is no TPU prefill kernel: TPU meshes take "xla" by default."""
    if requested is None:
        on_gpu = all(d.platform == "gpu" for d in mesh.devices.flat)
        requested = "pallas" if on_gpu and choose_decode_attention(None, model, mesh, page_size) == "pallas" else "xla"
    if requested not in PREFILL_ATTENTION:
        raise ValueError(f"Engine: prefill_attention must be one of {PREFILL_ATTENTION}, got {requested!r}")
    if requested == "pallas" and all(d.platform == "tpu" for d in mesh.devices.flat):
        raise ValueError("Engine: prefill_attention='pallas' is the GPU (Triton) kernel, which would run in Pallas's "
                         "interpreter on a TPU; use prefill_attention='xla' there")
    return requested


def choose_decode_attention(requested: str | None, model: Decoder, mesh: Mesh, page_size: int,
                            cache_dtype: Any = None) -> str:
    """`forward`'s decode attention from `Engine`'s ``decode_attention`` (see there).

    "pallas" is the backend's kernel: on a TPU mesh "pallas_tpu" (`models.tpu_decode_attention`),
    elsewhere the GPU kernel (interpreted off GPU). "pallas_tpu" may also be asked for by name
    (off TPU it runs in the TPU interpreter: tests). By default each backend takes its kernel
    where its shapes fit, else "xla"; an explicit kernel with shapes it cannot take is an error.
    """
    on_tpu = all(d.platform == "tpu" for d in mesh.devices.flat)
    cache_dtype = model.dtype if cache_dtype is None else cache_dtype
    tpu_fits = tpu_kernel_fits(model.config.head_dim, page_size, cache_dtype)
    kernel_pages = page_size >= 16 and page_size & (page_size - 1) == 0
    if requested is None:
        on_gpu = all(d.platform == "gpu" for d in mesh.devices.flat)
        head_dim = model.config.head_dim
        kernel_fits = head_dim >= 16 and head_dim & (head_dim - 1) == 0  # Triton blocks: powers of two
        fits = on_gpu and jnp.dtype(model.dtype).itemsize == 2 and kernel_fits and kernel_pages
        requested = "pallas" if fits or (on_tpu and tpu_fits) else "xla"
    if requested not in DECODE_ATTENTION:
        raise ValueError(f"Engine: decode_attention must be one of {DECODE_ATTENTION}, got {requested!r}")
    if requested == "pallas" and on_tpu:
        requested = "pallas_tpu"
    if requested == "pallas_tpu" and on_tpu and not tpu_fits:
        raise ValueError(
            f"Engine: head_dim={model.config.head_dim} and page_size={page_size} do not suit the TPU decode "
            f"attention kernel (head_dim a multiple of 128, page_size a multiple of "
            f"{32 // jnp.dtype(cache_dtype).itemsize} for a {jnp.dtype(cache_dtype).name} cache); "
            "use such shapes or decode_attention='xla'"
        )
    if requested == "pallas" and not kernel_pages:
        raise ValueError(
            f"Engine: page_size={page_size} does not suit the pallas decode attention (it reads pages in "
            "blocks of a power of two >= 16); use such a page size or decode_attention='xla'"
        )
    return requested
