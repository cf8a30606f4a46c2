"""What the RL loop works with, built once before the first step (``train/build.py``).

``Roles`` holds the models of a run by role. Only the policy trains: its params and
optimizer state are the ``TrainState`` that the loop passes from stage to stage; the
reference and the teacher are frozen params, the judge is a callable. ``RL`` holds
everything else a step uses (driver, agent loop, data, jitted functions, writers); it is
frozen, and what changes from step to step (the train state, the params version) is
passed explicitly through the stage functions (``stages.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.losses.registry import loss_hparams
from agentrl_jax.train.guidance.hindsight import Judge
from agentrl_jax.train.guidance.old_policy import OldPolicy
from agentrl_jax.train.guidance.teacher import Teacher
from agentrl_jax.train.multihost import put_global
from agentrl_jax.train.packing import MAX_SEGMENTS, gather_rows, packed_logprobs
from agentrl_jax.train.step import (
    LossSettings,
    TrainState,
    forward_logprobs,
    update_step,
)


class Frozen(NamedTuple):
    """A model that does not train: its graph definition and params."""

    graphdef: Any
    params: Any


@dataclasses.dataclass(frozen=True)
class Roles:
    """The models of a run.

    Attributes:
      policy: the policy's graph definition (its params and optimizer state: ``TrainState``).
      reference: the frozen reference of the KL term (the policy's architecture), or None.
      teacher: the teacher of OPD / hybrid (``guidance.teacher.Teacher``: frozen, the
        current policy, or a lagged copy), or None.
      judge: the PRM judge (``guidance.hindsight.Judge``), or None.
    """

    policy: Any
    reference: Any = None
    teacher: Teacher | None = None
    judge: Judge | None = None

    def check(self, config: Config) -> None:
        """Every model the config asks for is here: nothing is silently skipped, nothing fails mid-run."""
        c = config
        missing = [(key, role) for key, role, needed, present in (
            ("algorithm.kl_coef", "reference", c.algorithm.kl_coef > 0, self.reference is not None),
            ("hybrid.mode", "teacher", c.hybrid.mode != "none", self.teacher is not None),
            ("hybrid.judge", "judge", c.hybrid.judge != "none", self.judge is not None),
        ) if needed and not present]
        if missing:
            raise ConfigError("; ".join(f"{key} needs Roles.{role}, which is not set" for key, role in missing)
                              + " (train/build.py builds them from the config; hand-built roles must too)")


def loss_settings(config: Config) -> LossSettings:
    """The static objective of the update, from the algorithm config.

    The loss's hyper-parameters are the ones it declared at registration, read from the
    config, plus ``algorithm.loss_hparams`` (``losses.registry.loss_hparams``).
    """
    a = config.algorithm
    correction_hparams: dict[str, Any] = {}
    if a.correction in ("tis", "mis"):
        correction_hparams = {"cap": a.correction_cap, "level": a.correction_level}
    elif a.correction == "icepop":
        correction_hparams = {"low": a.correction_floor, "high": a.correction_cap, "level": a.correction_level}
    return LossSettings(
        loss=a.loss,
        hparams=tuple(sorted(loss_hparams(a.loss, config).items())),
        aggregation=a.aggregation,
        temperature=config.rollout.temperature,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        correction=a.correction,
        correction_hparams=tuple(sorted(correction_hparams.items())),
        packed=a.pack_rows,
        max_segments=MAX_SEGMENTS if a.pack_rows else 0,
        chunk_size=a.logprob_chunk_tokens,
    )


def update_on_rows(state: TrainState, arrays: dict[str, jax.Array], rows: jax.Array, normalizer: jax.Array,
                   **kwargs) -> tuple[TrainState, dict[str, jax.Array]]:
    """``update_step`` on the minibatch ``rows`` of the step's batch, gathered on device."""
    minibatch = jax.tree.map(lambda x: x[rows], arrays)
    return update_step(state, minibatch, normalizer, **kwargs)


def update_on_packed_rows(state: TrainState, arrays: dict[str, jax.Array], gather: jax.Array,
                          segment_ids: jax.Array, normalizer: jax.Array, *, pad_token_id: int,
                          **kwargs) -> tuple[TrainState, dict[str, jax.Array]]:
    """``update_step`` on a minibatch packed on device from the step's padded arrays
    (``train.packing``: ``gather`` and ``segment_ids`` are the plan's ``[R, S]`` layout)."""
    minibatch = gather_rows(arrays, gather, segment_ids, pad_token_id=pad_token_id)
    return update_step(state, minibatch, normalizer, **kwargs)


@dataclasses.dataclass(frozen=True)
class RL:
    """Everything a step uses that does not change from step to step.

    Attributes:
      config: the experiment.
      roles: the models by role.
      tokenizer, driver, agent_loop, env_factory: rollouts (the driver holds the engine's
        copy of the policy, tagged with its params version).
      data: the checkpointable prompt iterator (this host's share).
      eval_tasks: held-out tasks.
      writer, checkpointer: metrics and checkpoints (``checkpointer`` may be None).
      mesh: the training mesh (None: default device placement).
      engine_params: policy params -> the engine's layout (multi-host: this host's replica).
      settings, optimizer, schedule: the objective and the optimizer.
      old_policy: where the PPO ratio's "old" logprobs come from (``guidance.old_policy``).
    """

    config: Config
    roles: Roles
    tokenizer: Any
    driver: Any
    agent_loop: AgentLoop
    env_factory: Callable[[], Any]
    data: Any
    eval_tasks: list[dict]
    writer: Any
    checkpointer: Any
    mesh: Any
    engine_params: Callable[[Any], Any]
    settings: LossSettings
    optimizer: optax.GradientTransformation
    schedule: Callable[[int], Any]
    old_policy: OldPolicy
    _compiled: dict = dataclasses.field(default_factory=dict, repr=False)

    def put(self, value: Any) -> jax.Array:
        """A host value (identical on every host) onto the training mesh, replicated; device arrays stay."""
        if isinstance(value, jax.Array):
            return value
        value = np.asarray(value)
        return jnp.asarray(value) if self.mesh is None else put_global(value, self.mesh)

    def logprobs(self, model: Frozen, inputs: dict[str, np.ndarray], micro_rows: int) -> jax.Array:
        """Tempered logprobs [R, T] of ``inputs['targets']`` under ``model``, in micro-batches, on device.

        With ``algorithm.pack_rows`` the rows are packed (``train.packing``; micro-batches of
        ``algorithm.micro_batch_tokens``) and the result is unpacked to the padded rows.
        """
        if "logprobs" not in self._compiled:
            self._compiled["logprobs"] = jax.jit(
                functools.partial(forward_logprobs, temperature=self.config.rollout.temperature,
                                  packed=self.settings.packed, chunk_size=self.settings.chunk_size),
                static_argnums=(0,), static_argnames=("max_segments",))
        fn = self._compiled["logprobs"]
        a = self.config.algorithm
        if a.pack_rows:
            forward = lambda params, part, segments: fn(model.graphdef, params, part, max_segments=segments)  # noqa: E731
            return packed_logprobs(forward, model.params, inputs, row_tokens=a.pack_row_tokens,
                                   micro_batch_tokens=a.micro_batch_tokens, pad_token_id=self.tokenizer.pad_token_id,
                                   put=self.put)
        rows = inputs["input_ids"].shape[0]
        parts = [fn(model.graphdef, model.params, {k: self.put(v[start: start + micro_rows])
                                                   for k, v in inputs.items()})
                 for start in range(0, rows, micro_rows)]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)

    def update_fn(self, state: TrainState, rows: int, micro: int, *, old_from_update: bool = False,
                  num_sequences: int | None = None, max_segments: int | None = None):
        """The jitted update of ``rows``-row minibatches in ``micro`` micro-batches.

        Padded rows: ``fn(state, arrays, rows, normalizer)``. Packed rows (``algorithm.pack_rows``;
        ``num_sequences``: the padded rows of the step): ``fn(state, arrays, gather,
        segment_ids, normalizer)``. ``old_from_update``: the old logprobs are ``sg(logp)`` of
        the update's own forward (``LossSettings.old_from_current``). ``max_segments``: the
        packed plan's segment bound (``PackPlan.segment_bound``; None: ``settings.max_segments``).

        Explicit shardings: the state keeps its own (params and optimizer state as laid
        out on the mesh), the batch and the metrics are replicated; the state is donated.
        """
        packed = self.config.algorithm.pack_rows
        segments = (self.settings.max_segments if max_segments is None else max_segments) if packed else 0
        key = ("update", rows, micro, old_from_update, num_sequences if packed else None, segments)
        if key not in self._compiled:
            shardings = {}
            if self.mesh is not None:
                state_sharding = jax.tree.map(lambda x: x.sharding, state)
                replicated = NamedSharding(self.mesh, PartitionSpec())
                shardings = {"in_shardings": (state_sharding,) + (replicated,) * (4 if packed else 3),
                             "out_shardings": (state_sharding, replicated)}
            settings = dataclasses.replace(self.settings, old_from_current=old_from_update, max_segments=segments)
            common = dict(graphdef=self.roles.policy, optimizer=self.optimizer, settings=settings,
                          num_micro_batches=micro)
            body = (functools.partial(update_on_packed_rows, pad_token_id=self.tokenizer.pad_token_id,
                                      num_sequences=num_sequences, **common) if packed
                    else functools.partial(update_on_rows, num_sequences=None, **common))
            self._compiled[key] = jax.jit(body, donate_argnums=(0,), **shardings)
        return self._compiled[key]
