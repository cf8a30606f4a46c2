"""Per-token log-probabilities and entropy from final hidden states, in chunks.

A [B, T, V] float32 logits tensor for a 32k-token row at a 152k vocabulary is 20 GB, so
nothing here builds it. The sequence is cut into spans of S positions, S = chunk_size // B, and
one `lax.map` step takes the same span of every row: its logits [B * S, V] (at most
`chunk_size` tokens, or B when B > chunk_size: S is at least 1) live only inside that step. The
step is wrapped in `jax.checkpoint`, so the backward pass recomputes a chunk's logits instead
of saving them: peak memory is O(max(chunk_size, B) * V) whatever T is.

Chunks take every row, not consecutive flattened tokens, so that a batch split over devices
stays split inside the loop: each device computes its own rows' logits. (A loop over chunks of
the flattened tokens has its sharded dimension as the loop's, which the partitioner does not
split: it split the model width instead and all-reduced every chunk's [C, V] logits.)
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from agentrl_jax.models.logits import output_logits, temperature_scaled

EmbeddingLayout = Literal["vd", "dv"]


def _chunk_stats(
    hidden_chunk: Float[Array, "C D"],
    target_chunk: Int[Array, "C"],
    output_embedding: Float[Array, "..."],
    *,
    temperature: float,
    embedding_layout: EmbeddingLayout,
    with_entropy: bool,
) -> tuple[Float[Array, "C"], Float[Array, "C"] | None]:
    """logp of the targets (and entropy) for one chunk; float32 logits scaled by 1/temperature."""
    logits = temperature_scaled(output_logits(hidden_chunk, output_embedding, embedding_layout), temperature)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, target_chunk[:, None], axis=-1)[:, 0]
    logp = target_logit - log_z
    if not with_entropy:
        return logp, None
    probs = jnp.exp(logits - log_z[:, None])
    entropy = log_z - jnp.sum(probs * logits, axis=-1)
    return logp, entropy


def token_logprobs(
    hidden: Float[Array, "B T D"],
    output_embedding: Float[Array, "V D"] | Float[Array, "D V"],
    targets: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    embedding_layout: EmbeddingLayout = "vd",
) -> Float[Array, "B T"] | tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """Log-probability of `targets` (and the entropy) under softmax(hidden @ E^T / temperature).

    Equations, with z = h E^T / tau computed in float32 one chunk of tokens at a time:
        logp_t    = z_t[y_t] - logsumexp(z_t)
        entropy_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v
    Dividing by the temperature before the softmax matches what the rollout engine does when
    it samples, so the trainer's logp equals the engine's reported logprob for the same token.

    Args:
      hidden: [B, T, D] final hidden states (after the final norm), any float dtype.
      output_embedding: the tied embedding table [V, D] (`embedding_layout="vd"`) or an
        lm_head kernel [D, V] (`embedding_layout="dv"`).
      targets: [B, T] int token ids whose logprob is wanted (usually inputs shifted by one).
      temperature: sampling temperature, > 0.
      chunk_size: tokens per chunk, S = chunk_size // B positions of every row (at least one);
        the largest live logits buffer is [B * S, V] float32.
      return_entropy: also return the entropy of the full distribution per token.
      embedding_layout: "vd" or "dv", see `output_embedding`.

    Returns:
      logp [B, T] float32, and entropy [B, T] float32 when `return_entropy`.
      Gradients flow to `hidden` and `output_embedding` through both.
    """
    chex.assert_rank(hidden, 3)
    chex.assert_rank(targets, 2)
    chex.assert_rank(output_embedding, 2)
    if embedding_layout not in ("vd", "dv"):
        raise ValueError(f"embedding_layout must be 'vd' or 'dv', got {embedding_layout!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, seq_len, width = hidden.shape
    if targets.shape != (batch, seq_len):
        raise ValueError(f"targets must have shape {(batch, seq_len)}, got {targets.shape}")
    embed_width = output_embedding.shape[1] if embedding_layout == "vd" else output_embedding.shape[0]
    if embed_width != width:
        raise ValueError(
            f"output_embedding {output_embedding.shape} with layout {embedding_layout!r} has width "
            f"{embed_width}, hidden has {width}; pass embedding_layout='dv' for an lm_head kernel"
        )

    span = max(1, min(seq_len, chunk_size // batch))  # positions of every row per chunk
    num_chunks = -(-seq_len // span)
    pad = num_chunks * span - seq_len
    # [chunks, B, S, ...]: the loop runs over the first axis; B keeps its sharding
    chunked_hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(batch, num_chunks, span, width)
    chunked_targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad))).reshape(batch, num_chunks, span)

    @jax.checkpoint
    def one_chunk(xs):
        hidden_chunk, target_chunk = xs
        logp, entropy = _chunk_stats(
            hidden_chunk.reshape(batch * span, width),
            target_chunk.reshape(batch * span),
            output_embedding,
            temperature=temperature,
            embedding_layout=embedding_layout,
            with_entropy=return_entropy,
        )
        return logp.reshape(batch, span), None if entropy is None else entropy.reshape(batch, span)

    logp, entropy = jax.lax.map(one_chunk, (chunked_hidden.swapaxes(0, 1), chunked_targets.swapaxes(0, 1)))

    def unchunk(x: jax.Array) -> jax.Array:  # [chunks, B, S] -> [B, T]
        return x.swapaxes(0, 1).reshape(batch, num_chunks * span)[:, :seq_len]

    if not return_entropy:
        return unchunk(logp)
    return unchunk(logp), unchunk(entropy)
