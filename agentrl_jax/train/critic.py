"""The critic of PPO with GAE (``algorithm.advantage='gae'``): a value model trained beside the policy.

Per RL step (``train/rl/loop.py``), on the padded batch of finished trajectories:

    critic_targets   values V of the batch (the critic as it is now, before this step's
                     updates), GAE advantages and returns over the agent tokens, whitening
    (policy update)  with the advantages, unless the step is a critic warm-up step
    critic update    ppo_epochs x minibatches updates of the clipped value loss on the
                     returns, in the same micro-batches / packed rows as the policy's

Stale trajectories of an async run are valued by the current critic, at update time (the
simple, standard choice: the critic has no rollout copy to lag behind). The critic's params
and optimizer state are a ``TrainState`` of their own, with their own optimizer and
learning-rate schedule, checkpointed beside the policy's (``checkpoint_trees``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.losses import aggregate, clipped_value_loss, explained_variance, value_positions, whiten_advantages
from agentrl_jax.models.value_head import value_model_from_policy
from agentrl_jax.train.episodes import compute_advantages
from agentrl_jax.train.multihost import to_host
from agentrl_jax.train.step import LossSettings, init_train_state, make_logprob_fn, make_optimizer, make_update_fn

CHECKPOINT_TREE = "critic"


def forward_values(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], *, packed: bool = False,
                   max_segments: int = 0) -> jax.Array:
    """The critic's values [B, T] float32 of ``batch`` (``input_ids``, ``positions``,
    ``segment_ids``), in the layouts of ``train.step.forward_logprobs``."""
    model = nnx.merge(graphdef, params)
    if packed:
        return model(batch["input_ids"], batch["positions"], segment_ids=batch["segment_ids"],
                     max_segments=max_segments or None)
    lengths = jnp.sum(batch["segment_ids"] > 0, axis=1).astype(jnp.int32)
    return model(batch["input_ids"], batch["positions"], lengths=lengths)


def critic_loss(params: Any, graphdef: nnx.GraphDef, micro: dict[str, jax.Array], normalizer: jax.Array,
                settings: LossSettings, num_sequences: int | None, *, value_clip: float):
    """The clipped value loss of one micro-batch, divided by the minibatch's number of valued
    tokens (``normalizer``), so micro-batches sum to the minibatch's token mean exactly.

    ``micro``: ``old_values``, ``returns``, ``value_mask`` [B, T] beside the forward inputs.
    """
    del num_sequences
    values = forward_values(graphdef, params, micro, packed=settings.packed, max_segments=settings.max_segments)
    per_token, metrics = clipped_value_loss(values, micro["old_values"], micro["returns"], micro["value_mask"],
                                            clip=value_clip)
    loss = aggregate(per_token, micro["value_mask"], "token-mean", normalizer)
    return loss, {**metrics, "loss": loss}


class Critic:
    """The value model, its train state and its jitted forward and update.

    Attributes:
      graphdef: the ``ValueModel``'s graph definition.
      state: its ``TrainState`` (params, optimizer state, update counter, rng); replaced
        by every update (``loop.update`` donates it).
      schedule: its learning-rate schedule (update -> rate).
      values: ``(graphdef, params, inputs, micro_rows) -> [N, T]`` on device, like
        ``StepFunctions.logprobs``.
      update: the jitted minibatch update, with ``StepFunctions.update``'s signature.
    """

    def __init__(self, config: Config, graphdef: nnx.GraphDef, params: Any, settings: LossSettings, *, mesh=None,
                 pad_token_id: int = 0, put=jnp.asarray):
        critic = config.critic
        optimizer_config = dataclasses.replace(
            config.optimizer, learning_rate=critic.learning_rate or config.optimizer.learning_rate,
            schedule=critic.schedule, warmup_steps=critic.lr_warmup_steps)
        optimizer, self.schedule = make_optimizer(optimizer_config, config.total_steps)
        self.graphdef = graphdef
        self.state = init_train_state(params, optimizer, config.seed)
        algorithm = config.algorithm
        self.values = make_logprob_fn(settings, put=put, pad_token_id=pad_token_id,
                                      row_tokens=algorithm.pack_row_tokens,
                                      micro_batch_tokens=algorithm.micro_batch_tokens, forward=forward_values,
                                      mesh=mesh)
        self.update = make_update_fn(
            graphdef, optimizer, settings, mesh=mesh, pad_token_id=pad_token_id,
            state_sharding=None if mesh is None else jax.tree.map(lambda x: x.sharding, self.state),
            loss_fn=functools.partial(critic_loss, value_clip=critic.value_clip))

    def checkpoint_trees(self) -> dict[str, Any]:
        """The critic's train state, saved beside the policy's (``Checkpointer.save(trees=...)``)."""
        return {CHECKPOINT_TREE: self.state}

    def restore(self, checkpointer: Any, step: int) -> None:
        """The critic's train state from the checkpoint of ``step`` (into its current shardings)."""
        restored = checkpointer.restore_tree(step, CHECKPOINT_TREE, self.state)
        if restored is None:
            raise ConfigError(f"checkpoint.resume: the checkpoint of step {step} holds no critic (it was written by a "
                              "run without algorithm.advantage='gae'); resume with that run's advantage, or start over "
                              "with checkpoint.resume=false")
        self.state = restored


def build_critic(config: Config, policy_graphdef: nnx.GraphDef, start_params: Any, settings: LossSettings, *,
                 mesh=None, pad_token_id: int = 0, put=jnp.asarray, load_trunk=None) -> Critic:
    """The critic whose trunk starts at ``start_params`` (the policy RL starts from), or at the
    checkpoint ``critic.path`` (``load_trunk(path) -> params`` of the policy's architecture)."""
    params = start_params
    if config.critic.path:
        params = load_trunk(config.critic.path)
        if jax.tree.structure(params) != jax.tree.structure(start_params):
            raise ConfigError(f"critic.path: {config.critic.path!r} has a different architecture than the policy")
    graphdef, critic_params = value_model_from_policy(policy_graphdef, params, seed=config.seed)
    return Critic(config, graphdef, critic_params, settings, mesh=mesh, pad_token_id=pad_token_id, put=put)


def critic_targets(config: Config, critic: Critic, batch, inputs: dict[str, np.ndarray], rewards: np.ndarray,
                   group_ids: np.ndarray, trained: np.ndarray, micro_rows: int
                   ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, float]]:
    """Advantages [R, T], the value loss's arrays and metrics of a padded batch.

    Args:
      batch: the step's ``TrainBatch`` (one trajectory per row, masked rows' loss_mask 0).
      inputs: its forward inputs (host arrays).
      rewards, group_ids, trained: per trajectory (the first rows of the batch).
    Returns:
      (advantages, whitened if ``critic.whiten_advantages``; ``{old_values, returns,
      value_mask}`` [R, T] float32; metrics ``critic/...`` of the values before the update).
    """
    c = config.critic
    values = np.asarray(to_host(critic.values(critic.graphdef, critic.state.params, inputs, micro_rows)), np.float32)
    raw = compute_advantages(config, batch, rewards, group_ids, trained, values=values)
    value_mask = np.asarray(value_positions(jnp.asarray(batch.loss_mask), turn_level=c.turn_level), np.float32)
    returns = (raw + values) * value_mask
    advantages = raw
    if c.whiten_advantages:
        advantages = np.asarray(whiten_advantages(jnp.asarray(raw), jnp.asarray(batch.loss_mask)), np.float32)
    valued, agent = value_mask > 0, batch.loss_mask > 0
    metrics = {}
    if valued.any():
        metrics = {
            "critic/value_mean": float(values[valued].mean()), "critic/value_std": float(values[valued].std()),
            "critic/return_mean": float(returns[valued].mean()),
            "critic/explained_variance": float(explained_variance(jnp.asarray(values[valued]),
                                                                  jnp.asarray(returns[valued]))),
            "critic/advantage_mean": float(raw[agent].mean()), "critic/advantage_std": float(raw[agent].std()),
        }
    arrays = {"old_values": values * value_mask, "returns": returns, "value_mask": value_mask}
    return advantages, arrays, metrics
