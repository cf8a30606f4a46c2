"""The jitted steps: logprob forward and the policy-gradient update.

The update is a pure function ``(state, minibatch, normalizer) -> (state, metrics)``:
micro-batches are a ``lax.scan`` that sums gradients of losses which share one global
normalizer, so the accumulated gradient equals the full-minibatch gradient exactly
(``agentrl_jax.losses.aggregation``). A non-finite loss or gradient skips the update
(params and optimizer state unchanged) and reports ``skipped = 1``.

``make_logprob_fn`` and ``make_update_fn`` build the step's functions once (``train/build.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrl_jax.losses import (
    aggregate,
    decoupled_loss,
    entropy_bonus,
    get_loss,
    kl_loss,
    token_logprobs,
)
from agentrl_jax.models.lora import decoder_inputs, trainable, with_trainable
from agentrl_jax.sharding import under_mesh
from agentrl_jax.train.lora import jit_donating_state
from agentrl_jax.train.packing import gather_rows, packed_logprobs
from agentrl_jax.train.state import TrainState, init_train_state, make_optimizer  # noqa: F401 (importable here too)

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """Static (hashable) description of the objective, from the algorithm config.

    Attributes:
      loss: registered policy-loss name.
      hparams: the loss's keyword hyper-parameters as sorted (key, value) pairs.
      aggregation: how per-token terms are reduced.
      temperature: the sampling temperature (logprobs are tempered like the engine's).
      kl_coef, kl_kind: KL-to-reference loss term (0: off).
      entropy_coef: entropy bonus weight.
      correction: "none" or an off-policy correction of old/mu ("tis", "mis", "icepop").
      correction_hparams: its (key, value) pairs.
      chunk_size: tokens per logprob chunk (bounds the [chunk, V] float32 buffer).
      packed: rows hold several trajectories (pass sequence ids to the losses).
      max_segments: with ``packed``, the bound on trajectories per row (the trainer sets
        each plan's ``train.packing.PackPlan.segment_bound``); > 1 lets cuDNN run its packed
        flash-attention kernel, 1 runs mask-free padded-row attention, 0 a segment mask.
      old_from_current: the old logprobs are the current policy's, ``sg(logp)``, taken from
        the update's own forward (on-policy batch, one minibatch, one epoch: the params
        have not moved since the batch was sampled, so a separate old-logprob forward
        would compute the same numbers).
    """

    loss: str = "ppo"
    hparams: tuple[tuple[str, Any], ...] = ()
    aggregation: str = "token-mean"
    temperature: float = 1.0
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    correction: str = "none"
    correction_hparams: tuple[tuple[str, Any], ...] = ()
    chunk_size: int = 1024
    packed: bool = False
    max_segments: int = 0
    old_from_current: bool = False


def forward_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    batch: dict[str, jax.Array],
    *,
    temperature: float,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    packed: bool = False,
    max_segments: int = 0,
):
    """Tempered logprobs of ``batch['targets']`` (and entropy) from one forward pass.

    Args:
      batch: ``input_ids``, ``positions``, ``segment_ids``, ``targets`` of shape [B, T].
      packed: rows hold several segments (segment-id mask). Otherwise each row is one
        right-padded trajectory and attention runs mask-free with row lengths (the fused
        flash path on GPU).
      max_segments: with ``packed``, the static bound on segments per row (> 1: cuDNN's
        packed kernel when the model's attention is "cudnn"; 1: one segment per row, the
        mask-free padded-row path).
    Returns:
      logp [B, T] float32 (and entropy [B, T] when ``with_entropy``).
    """
    state, lora = decoder_inputs(params)  # LoRA: the adapters in the layers, or merged (models/lora.py)
    model = nnx.merge(graphdef, state)
    if packed:
        hidden = model(
            batch["input_ids"], batch["positions"], segment_ids=batch["segment_ids"],
            max_segments=max_segments or None, **lora,
        )
    else:
        lengths = jnp.sum(batch["segment_ids"] > 0, axis=1).astype(jnp.int32)
        hidden = model(batch["input_ids"], batch["positions"], lengths=lengths, **lora)
    table, layout = model.output_embedding()
    return token_logprobs(
        hidden,
        table,
        batch["targets"],
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=with_entropy,
        embedding_layout=layout,
    )


def policy_loss(
    params: Any,
    graphdef: nnx.GraphDef,
    micro: dict[str, jax.Array],
    normalizer: jax.Array,
    settings: LossSettings,
    num_sequences: int | None,
):
    """Scalar loss of one micro-batch (already divided by the global normalizer)."""
    logp, entropy = forward_logprobs(graphdef, params, micro, temperature=settings.temperature,
                                     chunk_size=settings.chunk_size, with_entropy=True, packed=settings.packed,
                                     max_segments=settings.max_segments)
    if settings.old_from_current:
        micro = {**micro, "old_logprobs": jax.lax.stop_gradient(logp)}
    return loss_from_logprobs(logp, entropy, micro, normalizer, settings, num_sequences)


def loss_from_logprobs(
    logp: jax.Array,
    entropy: jax.Array,
    micro: dict[str, jax.Array],
    normalizer: jax.Array,
    settings: LossSettings,
    num_sequences: int | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective from the policy's logprobs: the one loss composition of the library.

    loss = aggregate(policy_loss [off-policy corrected] + kl_coef * KL - entropy_coef * H)
    divided by the normalizer of the whole minibatch, so summing it over micro-batches
    gives the full-minibatch loss and gradient exactly (tests/losses/test_losses_aggregation.py).

    Args:
      logp, entropy: [B, T] tempered logprobs of the targets and the policy's entropy.
      micro: [B, T] loss_mask, advantages, old_logprobs, rollout_logprobs (+ sequence_ids
        when packed, ref_logprobs when kl_coef > 0).
      normalizer: `global_normalizer` of the whole minibatch.
      num_sequences: trajectories in the minibatch (static; packed layout only).
    Returns:
      (scalar loss, metrics: the loss's own, KL, entropy, logprob_gap_abs, loss).
    """
    mask = micro["loss_mask"]
    seq = dict(sequence_ids=micro["sequence_ids"], num_sequences=num_sequences) if settings.packed else {}
    loss_fn = get_loss(settings.loss)
    hparams = dict(settings.hparams)
    if settings.correction == "none":
        per_token, metrics = loss_fn(logp, micro["old_logprobs"], micro["advantages"], mask, **seq, **hparams)
        loss_mask = mask
    else:
        per_token, metrics, loss_mask = decoupled_loss(
            loss_fn, logp, micro["old_logprobs"], micro["rollout_logprobs"], micro["advantages"], mask,
            correction=settings.correction, correction_hparams=dict(settings.correction_hparams), **seq, **hparams)
    metrics = dict(metrics)
    total = per_token
    if settings.kl_coef > 0:
        kl_term, kl_metrics = kl_loss(
            logp, micro["ref_logprobs"], mask, coef=settings.kl_coef, kind=settings.kl_kind
        )
        total = total + kl_term
        metrics.update(kl_metrics)
    bonus, entropy_metrics = entropy_bonus(entropy, mask, coef=settings.entropy_coef)
    total = total + bonus
    metrics.update(entropy_metrics)
    loss = aggregate(total, loss_mask, settings.aggregation, normalizer, **seq)
    # train/infer mismatch: how far the trainer's logp for the sampled tokens is from the
    # engine's (both tempered). Exact numerics make this ~0 before the first update.
    sampled = mask > 0
    n = jnp.maximum(jnp.sum(sampled), 1)
    metrics["logprob_gap_abs"] = jnp.sum(jnp.where(sampled, jnp.abs(logp - micro["rollout_logprobs"]), 0)) / n
    metrics["loss"] = loss
    return loss, metrics


def _global_norm(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def update_step(
    state: TrainState,
    minibatch: dict[str, jax.Array],
    normalizer: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    settings: LossSettings,
    num_micro_batches: int,
    num_sequences: int | None,
    loss_fn: LossFn = policy_loss,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update over a minibatch, accumulated over micro-batches.

    Args:
      state: the train state (donated by the jitted caller).
      minibatch: [R, T] arrays: input_ids, positions, segment_ids, targets, loss_mask,
        advantages, old_logprobs, rollout_logprobs, sequence_ids (+ ref_logprobs if KL).
      normalizer: the aggregation denominator of the whole minibatch.
      num_micro_batches: R is split into this many equal micro-batches (static).
      loss_fn: ``(params, graphdef, micro, normalizer, settings, num_sequences) -> (loss,
        metrics)``, the micro-batch's loss over ``normalizer``: ``policy_loss`` or the critic's.
    Returns:
      (new state, metrics incl. grad_norm, param_norm, update_norm, skipped).
    """
    rows = minibatch["input_ids"].shape[0]
    if rows % num_micro_batches:
        raise ValueError(f"{rows} rows do not split into {num_micro_batches} micro-batches")
    # The gradient is taken for the trainable part only: the LoRA adapters, or all params.
    grad_fn = jax.value_and_grad(lambda p, *args: loss_fn(with_trainable(state.params, p), *args), has_aux=True)
    params = trainable(state.params)
    if num_micro_batches == 1:
        # No accumulator: zeros + one gradient would be two more passes over the float32 grads.
        (_, metrics), grads = grad_fn(params, graphdef, minibatch, normalizer, settings, num_sequences)
    else:
        micro = jax.tree.map(
            lambda x: x.reshape(num_micro_batches, rows // num_micro_batches, *x.shape[1:]), minibatch
        )

        def accumulate(grads, mb):
            (_, metrics), g = grad_fn(params, graphdef, mb, normalizer, settings, num_sequences)
            return jax.tree.map(jnp.add, grads, g), metrics

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(accumulate, zeros, micro)
        # The loss sums over micro-batches (shared normalizer); other metrics are averaged.
        metrics = {k: (jnp.sum(v) if k in ("loss", "policy_loss") else jnp.mean(v)) for k, v in metrics.items()}

    grad_norm = _global_norm(grads)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    new_state = TrainState(
        params=with_trainable(state.params, keep(new_params, params)),
        opt_state=keep(new_opt_state, state.opt_state),
        step=state.step + finite.astype(state.step.dtype),
        rng=state.rng,
    )
    metrics.update(
        grad_norm=grad_norm,
        param_norm=_global_norm(trainable(new_state.params)),
        update_norm=jnp.where(finite, _global_norm(updates), 0.0),
        skipped=1.0 - finite.astype(jnp.float32),
    )
    return new_state, metrics


def make_update_fn(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, settings: LossSettings, *,
                   state_sharding: Any = None, mesh: Mesh | None = None, pad_token_id: int = 0,
                   loss_fn: LossFn = policy_loss):
    """The jitted ``update_step`` of one minibatch, gathered on device from the step's [N, T] arrays.

    Padded rows: ``update(state, arrays, rows, normalizer, num_micro_batches, old_from_current)``,
    ``rows`` the minibatch's row indices. Packed rows (``settings.packed``): ``update(state,
    arrays, gather, segment_ids, normalizer, num_micro_batches, old_from_current, num_sequences,
    max_segments)`` with the plan's ``[R, S]`` layout (``train.packing``). The trailing
    arguments are static (positional: ``jax.jit`` takes no keywords with ``in_shardings``):
    ``old_from_current`` and ``max_segments`` as in ``LossSettings``, ``num_sequences`` the
    padded rows of the step.

    With a ``mesh`` the shardings are explicit: the state keeps ``state_sharding`` (params and
    optimizer state as laid out on the mesh), the batch and the metrics are replicated. The
    state is donated, a LoRA base excepted (``train/lora.py jit_donating_state``); ``loss_fn``: as in
    ``update_step``.
    """

    def update_on_rows(state, arrays, rows, normalizer, num_micro_batches, old_from_current):
        minibatch = jax.tree.map(lambda x: x[rows], arrays)
        return update_step(state, minibatch, normalizer, graphdef=graphdef, optimizer=optimizer,
                           settings=dataclasses.replace(settings, old_from_current=old_from_current, max_segments=0),
                           num_micro_batches=num_micro_batches, num_sequences=None, loss_fn=loss_fn)

    def update_on_packed_rows(state, arrays, gather, segment_ids, normalizer, num_micro_batches, old_from_current,
                              num_sequences, max_segments):
        minibatch = gather_rows(arrays, gather, segment_ids, pad_token_id=pad_token_id)
        return update_step(state, minibatch, normalizer, graphdef=graphdef, optimizer=optimizer,
                           settings=dataclasses.replace(settings, old_from_current=old_from_current,
                                                        max_segments=max_segments),
                           num_micro_batches=num_micro_batches, num_sequences=num_sequences, loss_fn=loss_fn)

    if settings.packed:  # arrays, gather, segment_ids, normalizer after the state; then the static ones
        body, inputs, static = update_on_packed_rows, 4, (5, 6, 7, 8)
    else:
        body, inputs, static = update_on_rows, 3, (4, 5)
    return jit_donating_state(body, static_argnums=static, num_inputs=inputs, state_sharding=state_sharding,
                              mesh=mesh)


def make_logprob_fn(settings: LossSettings, *, put: Callable[[Any], jax.Array], pad_token_id: int = 0,
                    row_tokens: int = 0, micro_batch_tokens: int = 0, forward: Callable[..., jax.Array] | None = None,
                    mesh: Mesh | None = None):
    """``logprobs(graphdef, params, inputs, micro_rows)``: tempered logprobs [N, T] of
    ``inputs['targets']`` under the model ``(graphdef, params)``, on device.

    One jitted forward serves every model of the step (policy, reference, teacher). Padded
    rows run in micro-batches of ``micro_rows``; with ``settings.packed`` the rows are packed
    (``train.packing.packed_logprobs``: ``row_tokens`` per row, micro-batches of
    ``micro_batch_tokens``) and the result is unpacked to the padded rows. ``put``: a host
    array onto the training ``mesh`` (traced under it). ``forward``: ``(graphdef, params, batch, *, packed, max_segments)
    -> [B, T]`` values in place of the logprobs (the critic's, ``train/critic.py``), same batching.
    """
    if forward is None:
        forward = functools.partial(forward_logprobs, temperature=settings.temperature, chunk_size=settings.chunk_size)
    # Rows computed where the mesh puts them, returned replicated as the update's inputs are.
    out = {} if mesh is None else {"out_shardings": NamedSharding(mesh, PartitionSpec())}
    forward = under_mesh(jax.jit(functools.partial(forward, packed=settings.packed), static_argnums=(0,),
                                 static_argnames=("max_segments",), **out), mesh)

    def logprobs(graphdef: nnx.GraphDef, params: Any, inputs: dict[str, Any], micro_rows: int) -> jax.Array:
        if settings.packed:
            return packed_logprobs(lambda p, part, segments: forward(graphdef, p, part, max_segments=segments),
                                   params, inputs, row_tokens=row_tokens, micro_batch_tokens=micro_batch_tokens,
                                   pad_token_id=pad_token_id, put=put)
        rows = inputs["input_ids"].shape[0]
        parts = [forward(graphdef, params, {k: put(v[start: start + micro_rows]) for k, v in inputs.items()})
                 for start in range(0, rows, micro_rows)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

    return logprobs
