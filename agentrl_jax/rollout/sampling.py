"""Token sampling with exact logprobs: greedy, temperature, top-k, top-p, per-request seeds.

Every sampled token comes with two logprobs, both float32:

- ``log_prob``: log softmax(z / tau)[y] over the FULL vocabulary, where z are the float32
  logits and tau the request's temperature. This is exactly what the trainer computes for
  the same token (`agentrl_jax.losses.logprobs.token_logprobs(..., temperature=tau)`), so the
  train/infer mismatch metric compares like with like.
- ``truncated_log_prob``: the log-probability under the distribution that was actually
  sampled, i.e. softmax(z / tau) restricted to the top-k / top-p set and renormalized. It
  equals ``log_prob`` when no truncation is active. Off-policy corrections that want the
  true behaviour policy use this one.

Greedy (temperature == 0) picks argmax z. Its ``log_prob`` is log softmax(z)[y] (the
temperature-1 distribution: a temperature of 0 has no density), and its
``truncated_log_prob`` is 0 (the point mass that was actually "sampled").

Sampling parameters are per-row ARRAYS (`SlotSampling`), so a change of temperature, top-k
or top-p never recompiles. The sorted (truncating) path is compiled in only when the caller
says some row needs it (``sample(truncation=)``, a static flag the engine decides on the
host from the requests' `SamplingParams.truncates`), so plain temperature sampling never
pays for a vocabulary sort, and no device value picks the path. On GPU, a conditional that
XLA leaves outside its CUDA graphs runs on the host: the predicate is copied back and the
launching thread waits for the device to reach it. The cond this module used to pick the
path, once per decode step inside the dispatch's loop, did that: launching a dispatch took
as long as the device work queued before it, so the driver's host work no longer overlapped
the device (docs/benchmarks.md, "No host round trip in a dispatch"). A small cond on its own is captured in a
graph and does not wait (`bench/dispatch_probe.py`), so the rule here is simply: none.

Randomness: each request owns a key derived from its seed; the key for its i-th generated
token is `fold_in(key, i)`. A request's samples therefore depend only on its seed and
its own history, not on which slot it sits in or who shares the batch.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from agentrl_jax.models.logits import output_logits, temperature_scaled


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling parameters of one request.

    Attributes:
      temperature: tau > 0 for sampling; 0 means greedy (argmax).
      top_k: keep the k most likely tokens; 0 disables.
      top_p: nucleus sampling, keep the smallest set with probability mass >= top_p
        (after top-k); 1.0 disables.
      seed: the request's random seed; None lets the driver pick one.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether it samples a top-k / top-p truncated distribution (greedy never does)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


GREEDY = SamplingParams(temperature=0.0)


@struct.dataclass
class SlotSampling:
    """Per-row sampling parameters as device arrays (shape [B] each)."""

    temperature: Float[Array, "B"]
    top_k: Int[Array, "B"]
    top_p: Float[Array, "B"]

    @classmethod
    def from_params(cls, params: SamplingParams, rows: int = 1) -> SlotSampling:
        return cls(
            temperature=jnp.full((rows,), params.temperature, jnp.float32),
            top_k=jnp.full((rows,), params.top_k, jnp.int32),
            top_p=jnp.full((rows,), params.top_p, jnp.float32),
        )


def request_key(seed: int, sample_index: int | Int[Array, ""] = 0) -> jax.Array:
    """The raw uint32[2] key of sample `sample_index` of a request with `seed`."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), sample_index)


_request_keys = jax.jit(jax.vmap(request_key, in_axes=(None, 0)))


def request_keys(seed: int, num_samples: int) -> np.ndarray:
    """``[request_key(seed, g) for g < num_samples]`` as a host uint32 [G, 2] array, in one jitted call.

    The driver derives keys on the host for every request; done op by op (seed, fold_in,
    device-to-host copy per sample) that cost milliseconds of host time per request and a
    sync with the accelerator. This runs on the CPU backend when there is one, so it never
    waits for the accelerator's queue.
    """
    inputs = (np.int64(seed), np.arange(num_samples, dtype=np.int32))
    cpu = _cpu_device()
    if cpu is not None:
        inputs = jax.device_put(inputs, cpu)
    return np.asarray(_request_keys(*inputs))


@functools.cache
def _cpu_device():
    try:
        # This process's own CPU device: under jax.distributed, jax.devices("cpu")[0] may be
        # another host's, whose values this process cannot read.
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        return None


def _gumbel_noise(keys: Int[Array, "B 2"], vocab: int) -> Float[Array, "B V"]:
    """Gumbel(0, 1) noise per row, indexed by token id (one key per row).

    argmax(logits + noise) samples softmax(logits) (Gumbel-max trick). The noise is drawn
    in token-id order on both paths, so a row that does not truncate gets the same token
    whether or not another row in the batch forces the sorted path.
    """
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)


def _truncated_sample(
    noise: Float[Array, "B V"],
    scaled: Float[Array, "B V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> tuple[Int[Array, "B"], Float[Array, "B"]]:
    """Top-k then top-p (over the renormalized top-k mass) sampling, with the truncated logprob.

    The kept set, in descending-logit order, is rank < k (k = 0 means all) and then the
    smallest prefix whose renormalized mass reaches p (the first token is always kept).
    """
    vocab = scaled.shape[-1]
    neg_sorted, order = jax.lax.sort_key_val(-scaled, jnp.broadcast_to(jnp.arange(vocab), scaled.shape))
    sorted_logits = -neg_sorted
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep = rank < k
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(masked, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (mass_before < top_p[:, None])
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jnp.argmax(masked + jnp.take_along_axis(noise, order, axis=-1), axis=-1)
    tokens = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    truncated = jax.nn.log_softmax(masked, axis=-1)
    truncated_log_prob = jnp.take_along_axis(truncated, choice[:, None], axis=-1)[:, 0]
    return tokens, truncated_log_prob


def sample(
    logits: Float[Array, "B V"],
    keys: Int[Array, "B 2"],
    sampling: SlotSampling,
    *,
    truncation: bool = True,
) -> tuple[Int[Array, "B"], Float[Array, "B"], Float[Array, "B"]]:
    """Sample one token per row and report its full and truncated logprobs.

    Args:
      logits: [B, V] float32 logits of the next token (no temperature applied).
      keys: [B, 2] uint32 raw PRNG keys, one per row (already folded with the step index).
      sampling: per-row temperature / top_k / top_p arrays of shape [B].
      truncation: compile the top-k / top-p path (a sort over the vocabulary). False is only
        right when no row truncates (`SamplingParams.truncates`); rows with top-k / top-p
        then sample the full distribution. Either way a row that does not truncate draws
        the same token (the same noise, the same argmax), whoever shares the batch.

    Returns:
      tokens [B] int32; log_prob [B] = log softmax(z / tau)[token] (tau := 1 for greedy
      rows); truncated_log_prob [B] = log-prob under the truncated distribution that was
      sampled (0 for greedy rows).
    """
    chex.assert_rank(logits, 2)
    chex.assert_shape(keys, (logits.shape[0], 2))
    logits = logits.astype(jnp.float32)
    greedy = sampling.temperature <= 0
    tau = jnp.where(greedy, 1.0, sampling.temperature).astype(jnp.float32)
    scaled = temperature_scaled(logits, tau)
    # log softmax(scaled) at the chosen tokens only: [B, V] log-probs are never written out
    top = jax.lax.stop_gradient(jnp.max(scaled, axis=-1))
    log_normalizer = jnp.log(jnp.sum(jnp.exp(scaled - top[:, None]), axis=-1))
    noise = _gumbel_noise(keys, logits.shape[-1])
    # without truncation XLA fuses the noise into the argmax instead of writing [B, V] floats out
    tokens = jnp.argmax(scaled + jnp.where(greedy[:, None], 0.0, noise), axis=-1).astype(jnp.int32)  # greedy: argmax z
    truncating = (~greedy) & ((sampling.top_k > 0) | (sampling.top_p < 1.0))
    if truncation:
        kept, kept_lp = _truncated_sample(noise, scaled, sampling.top_k, sampling.top_p)
        tokens = jnp.where(truncating, kept, tokens)
    log_prob = (jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - top) - log_normalizer
    truncated_log_prob = jnp.where(truncating, kept_lp, log_prob) if truncation else log_prob
    return tokens, log_prob, jnp.where(greedy, 0.0, truncated_log_prob)


def step_keys(base_keys: Int[Array, "B 2"], generated: Int[Array, "B"]) -> Int[Array, "B 2"]:
    """The key of each row's next token: fold_in(request key, index of the token)."""
    return jax.vmap(jax.random.fold_in)(base_keys, generated)


def next_token_logits(
    hidden_last: Float[Array, "B D"], output_embedding: Float[Array, "..."], layout: str
) -> Float[Array, "B V"]:
    """float32 logits from last-position hidden states, as the trainer computes them."""
    return output_logits(hidden_last, output_embedding, layout)


def sample_next_token(
    params,
    hidden_last: Float[Array, "R D"],
    keys: Int[Array, "B 2"],
    generated: Int[Array, "B"],
    sampling: SlotSampling,
    *,
    truncation: bool,
) -> tuple[Int[Array, "B"], Float[Array, "B"], Float[Array, "B"]]:
    """The engine's one sampling call: the next token of every row from its last hidden state.

    Every token the engine emits (a decode step, a lane step, a paged or a dense prefill)
    comes from here: logits as the trainer computes them (`next_token_logits` with the
    params' output embedding), the row's key for its token number ``generated``
    (`step_keys`), then `sample`.

    Args:
      params: `DecodeParams` (its output embedding).
      hidden_last: [R, D] hidden states; R == B, or R == 1 for B samples of one prompt (the
        logits are computed once and shared, each sample drawing with its own key).
      keys: [B, 2] the rows' request keys; generated: [B] tokens each row sampled before.
      sampling, truncation: as `sample`.

    Returns:
      `sample`'s ``(tokens, log_prob, truncated_log_prob)``, each [B].
    """
    logits = next_token_logits(hidden_last, *params.output_embedding())
    logits = jnp.broadcast_to(logits, (keys.shape[0], logits.shape[-1]))
    return sample(logits, step_keys(keys, generated), sampling, truncation=truncation)
