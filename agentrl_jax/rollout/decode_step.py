"""The traced body of `Engine.generate` (one decode step for every slot, or N of them in a loop),
and the choice of its attention (and of the paged prefill's).

Each step feeds every slot's last token at its length, writes its k/v through the slot's
page table, samples the next token with the slot's key and sampling parameters (exact
logprobs, `rollout.sampling`), and advances the slots that are active and below the
longest sequence. N steps run in one `lax.fori_loop` and stack their results as [N, S].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from agentrl_jax.models import Decoder
from agentrl_jax.models.decode import forward
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import next_token_logits, sample, step_keys
from agentrl_jax.rollout.state import DecodeState

DECODE_ATTENTION = ("xla", "pallas")


def decode_step(params, state: DecodeState, *, config, attend_len, dtype, attention, cache_spec, mesh, max_length):
    """One token for every slot: ``(new state, (tokens, valid, generated, log_prob, truncated))``, each [S]."""
    hidden, cache = forward(
        params, state.last_tokens[:, None], state.lengths[:, None], state.cache, state.lengths,
        config=config, attend_len=attend_len, dtype=dtype, attention=attention,
        cache_spec=cache_spec, mesh=mesh, page_table=state.page_table,
    )
    logits = next_token_logits(hidden[:, -1], *params.output_embedding())
    tokens, log_prob, truncated = sample(logits, step_keys(state.keys, state.generated), state.sampling)
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


def generate_steps(params, state: DecodeState, *, num_steps: int | None, **step_kw) -> tuple[DecodeState, ResultTokens]:
    """`decode_step` once ([S] results) or ``num_steps`` times in a `fori_loop` ([N, S] results)."""
    if num_steps is None:
        state, out = decode_step(params, state, **step_kw)
        return state, ResultTokens.pack(*out)
    slots = state.lengths.shape[0]
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
    """The paged prefill's attention: ``requested``, or by default "pallas" (the kernel of
    `models.prefill_attention`) where the decode default is "pallas" (GPU, a 16-bit compute
    dtype, a power-of-two head dim), else "xla" (see `Engine`'s ``prefill_attention``)."""
    if requested is None:
        requested = choose_decode_attention(None, model, mesh, page_size)
    if requested not in DECODE_ATTENTION:
        raise ValueError(f"Engine: prefill_attention must be one of {DECODE_ATTENTION}, got {requested!r}")
    return requested


def choose_decode_attention(requested: str | None, model: Decoder, mesh: Mesh, page_size: int) -> str:
    """The decode attention: ``requested``, or by default "pallas" where the GPU kernel fits
    (see `Engine`'s ``decode_attention``)."""
    kernel_pages = page_size >= 16 and page_size & (page_size - 1) == 0
    if requested is None:
        on_gpu = all(d.platform == "gpu" for d in mesh.devices.flat)
        head_dim = model.config.head_dim
        kernel_fits = head_dim >= 16 and head_dim & (head_dim - 1) == 0  # Triton blocks: powers of two
        fits = on_gpu and jnp.dtype(model.dtype).itemsize == 2 and kernel_fits and kernel_pages
        requested = "pallas" if fits else "xla"
    if requested not in DECODE_ATTENTION:
        raise ValueError(f"Engine: decode_attention must be one of {DECODE_ATTENTION}, got {requested!r}")
    if requested == "pallas" and not kernel_pages:
        raise ValueError(
            f"Engine: page_size={page_size} does not suit the pallas decode attention (it reads pages in "
            "blocks of a power of two >= 16); use such a page size or decode_attention='xla'"
        )
    return requested
