"""Next-token logits from final hidden states, and their temperature scaling.

The rollout engine samples from softmax(z / tau) and reports log softmax(z / tau)[y]; the
trainer recomputes log softmax(z / tau)[y] for the same token. The invariant "engine
logprob == trainer logprob" holds only if both compute z and z / tau the same way, so
both call these two functions (`rollout.sampling` and `losses.logprobs`); neither layer
imports the other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

EMBEDDING_LAYOUTS = ("vd", "dv")


def output_logits(
    hidden: Float[Array, "N D"], output_embedding: Float[Array, "..."], layout: str
) -> Float[Array, "N V"]:
    """float32 logits ``hidden @ E^T`` (bf16 inputs accumulate in float32).

    Args:
      hidden: [N, D] final hidden states.
      output_embedding: the tied embedding [V, D] (layout "vd") or an lm_head [D, V] ("dv"),
        as `Decoder.output_embedding()` returns it.
    """
    if layout not in EMBEDDING_LAYOUTS:
        raise ValueError(f"output embedding layout must be 'vd' or 'dv', got {layout!r}")
    contraction = (((1,), (1,)), ((), ())) if layout == "vd" else (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(hidden, output_embedding, contraction, preferred_element_type=jnp.float32)


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
