"""Next-token logits from final hidden states, and their temperature scaling.

The rollout engine samples from softmax(z / tau) and reports log softmax(z / tau)[y]; the
trainer recomputes log softmax(z / tau)[y] for the same token. The invariant "engine
logprob == trainer logprob" holds only if both compute z and z / tau the same way, so
both call these two functions (`rollout.sampling` and `losses.logprobs`); neither layer
imports the other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

EMBEDDING_LAYOUTS = ("vd", "dv")


def output_logits(
    hidden: Float[Array, "N D"], output_embedding: Float[Array, "..."], layout: str
) -> Float[Array, "N V"]:
    """float32 logits ``hidden @ E^T`` (bf16 inputs accumulate in float32).

    The backward pass multiplies in the dtype the forward multiplied in: the float32
    cotangent of the logits is cast to the inputs' dtype before the two gradient matmuls
    (float32 accumulation), as autocast does in PyTorch. Left to autodiff, a bf16 matmul
    with float32 logits has a float32 cotangent, which promotes both gradient matmuls to
    float32 (TF32 on GPUs, half the bf16 rate; docs/benchmarks.md, "Where the update's time
    goes"). Float32 inputs: the same numbers
    as autodiff.

    Args:
      hidden: [N, D] final hidden states.
      output_embedding: the tied embedding [V, D] (layout "vd") or an lm_head [D, V] ("dv"),
        as `Decoder.output_embedding()` returns it.
    """
    if layout not in EMBEDDING_LAYOUTS:
        raise ValueError(f"output embedding layout must be 'vd' or 'dv', got {layout!r}")
    if hidden.ndim != 2 or output_embedding.ndim != 2:
        raise ValueError(f"output_logits takes hidden [N, D] and a 2-d embedding, got {hidden.shape}, "
                         f"{output_embedding.shape}")
    return _logits_matmul(hidden, output_embedding, layout)


def _matmul(hidden, output_embedding, layout):
    contraction = (((1,), (1,)), ((), ())) if layout == "vd" else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(hidden, output_embedding, contraction, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logits_matmul(hidden, output_embedding, layout):
    return _matmul(hidden, output_embedding, layout)


def _logits_matmul_fwd(hidden, output_embedding, layout):
    return _matmul(hidden, output_embedding, layout), (hidden, output_embedding)


def _logits_matmul_bwd(layout, residuals, cotangent):
    hidden, output_embedding = residuals
    dtype = jnp.result_type(hidden.dtype, output_embedding.dtype)  # what the forward multiplied in
    g, h, e = cotangent.astype(dtype), hidden.astype(dtype), output_embedding.astype(dtype)
    f32 = jnp.float32
    d_hidden = jnp.matmul(g, e if layout == "vd" else e.T, preferred_element_type=f32)
    d_embedding = jnp.matmul(g.T, h, preferred_element_type=f32) if layout == "vd" else jnp.matmul(
        h.T, g, preferred_element_type=f32)
    return d_hidden.astype(hidden.dtype), d_embedding.astype(output_embedding.dtype)


_logits_matmul.defvjp(_logits_matmul_fwd, _logits_matmul_bwd)


def temperature_scaled(
    logits: Float[Array, "N V"], temperature: float | Float[Array, "N"]
) -> Float[Array, "N V"]:
    """float32 ``logits / temperature``: one temperature for all rows, or one per row [N].

    A division, not a multiplication by 1 / temperature: the two round differently, and
    sampler and trainer must agree to the bit.
    """
    logits = logits.astype(jnp.float32)
    if jnp.ndim(temperature) == 0:
        return logits / jnp.float32(temperature)
    return logits / jnp.asarray(temperature, jnp.float32)[:, None]
