"""The train state: params, optimizer state, step counter and rng; the optimizer; a fresh state.

The jitted steps that change it are in ``train/step.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from agentrl_jax.config import OptimizerConfig
from agentrl_jax.models.lora import trainable


@struct.dataclass
class TrainState:
    """Everything the update changes: params, optimizer state, step counter, rng."""

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array


def make_optimizer(cfg: OptimizerConfig, total_steps: int, learning_rate: float | None = None):
    """AdamW with optional global-norm clipping and warmup + constant/cosine schedule."""
    peak = cfg.learning_rate if learning_rate is None else learning_rate
    warmup = max(cfg.warmup_steps, 0)
    if cfg.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else peak,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1),
            end_value=peak * cfg.min_lr_ratio,
        )
    elif warmup:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
        )
    else:
        schedule = optax.constant_schedule(peak)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    )
    return optax.chain(*parts), schedule


def init_train_state(params: Any, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh state; the optimizer state follows the params' shardings.

    Leaves without a mesh sharding (the step counter, the rng, optimizer counters) are
    replicated on the params' mesh rather than left on device 0, so a state restored from
    a checkpoint (whose leaves are committed to their target shardings) has the same
    placement as a fresh one.
    """
    # On device: chex's check fetches every array to the host, which a multi-host array refuses.
    finite = jax.jit(lambda t: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(t)])))(params)
    if not bool(finite):
        raise ValueError("init_train_state: the params hold NaN or inf")
    state = TrainState(
        params=params,
        opt_state=optimizer.init(trainable(params)),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(seed)),
    )
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return state
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    return jax.tree.map(
        lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding) else jax.device_put(x, replicated),
        state,
    )
