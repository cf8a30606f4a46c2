"""The traced body of `Engine.generate` (one decode step for every slot, or N of them in a loop),
and the choice of its attention (and of the paged prefill's).

Each step feeds every slot's last token at its length, writes its k/v through the slot's
page table, samples the next token with the slot's key and sampling parameters (exact
logprobs, `rollout.sampling`), and advances the slots that are active and below the
longest sequence. N steps run in one `lax.fori_loop` and stack their results as [N, S].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from agentrl_jax.models import Decoder
from agentrl_jax.models.decode import PREFILL_ATTENTION_IMPLS as PREFILL_ATTENTION
from agentrl_jax.models.decode import forward
from agentrl_jax.models.tpu_decode_attention import tpu_kernel_fits
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import next_token_logits, sample, step_keys
from agentrl_jax.rollout.state import DecodeState

DECODE_ATTENTION = ("xla", "pallas", "pallas_tpu")
KERNEL_ATTENTION = ("pallas", "pallas_tpu")  # the kernels read each slot up to its own length: no window


def decode_step(params, state: DecodeState, *, config, attend_len, dtype, attention, cache_spec, mesh, max_length,
                truncation=True):
    """One token for every slot: ``(new state, (tokens, valid, generated, log_prob, truncated))``, each [S];
    ``truncation``: compile the top-k / top-p sampling path (`sampling.sample`)."""
    hidden, cache = forward(
        params, state.last_tokens[:, None], state.lengths[:, None], state.cache, state.lengths,
        config=config, attend_len=attend_len, dtype=dtype, attention=attention,
        cache_spec=cache_spec, mesh=mesh, page_table=state.page_table,
    )
    logits = next_token_logits(hidden[:, -1], *params.output_embedding())
    tokens, log_prob, truncated = sample(logits, step_keys(state.keys, state.generated), state.sampling,
                                         truncation=truncation)
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
