"""What the RL loop works with, built once before the first step (``train/build.py``).

``Roles`` holds the models of a run by role. Only the policy trains: its params and
optimizer state are the ``TrainState`` that the loop passes from stage to stage; the
reference and the teacher are frozen params, the judge is a callable. ``StepFunctions``
are the jitted functions of the step (``train/step.py``). ``RL`` holds everything else
the loop uses (driver, agent loop, data, writers); it is frozen, and what changes from
step to step (the train state, the params version) is passed explicitly to the stage
functions (``stages.py``, ``collect.py``), which take what they use as arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.losses import needs_critic
from agentrl_jax.train.critic import Critic
from agentrl_jax.train.guidance.hindsight import Judge
from agentrl_jax.train.guidance.old_policy import OldPolicy
from agentrl_jax.train.guidance.teacher import Teacher
from agentrl_jax.train.step import TrainState


class StepFunctions(NamedTuple):
    """The jitted functions of the RL step, built once before the first step (``train/build.py``).

    Attributes:
      logprobs: ``(graphdef, params, inputs, micro_rows) -> [N, T]`` tempered logprobs on
        device, for every model of the step (``train.step.make_logprob_fn``).
      update: the jitted minibatch update, padded or packed rows (``train.step.make_update_fn``).
      put: a host value (identical on every host) onto the training mesh, replicated; device
        arrays stay (``train.multihost.put_replicated``).
    """

    logprobs: Callable[..., jax.Array]
    update: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
    put: Callable[[Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Roles:
    """The models of a run.

    Attributes:
      policy: the policy's graph definition (its params and optimizer state: ``TrainState``).
      reference: the frozen reference of the KL term (the policy's architecture), or None.
      teacher: the teacher of OPD / hybrid (``guidance.teacher.Teacher``: frozen, the
        current policy, or a lagged copy), or None.
      judge: the PRM judge (``guidance.hindsight.Judge``), or None.
      critic: the value model of a critic estimator (``train.critic.Critic``: trained, with
        its own train state), or None.
    """

    policy: Any
    reference: Any = None
    teacher: Teacher | None = None
    judge: Judge | None = None
    critic: Critic | None = None

    def checkpoint_trees(self) -> dict[str, Any]:
        """What a checkpoint holds beside the policy's train state: a lagged teacher's params,
        the critic's train state."""
        trees = self.teacher.checkpoint_trees() if self.teacher is not None else {}
        return trees | (self.critic.checkpoint_trees() if self.critic is not None else {})

    def check(self, config: Config) -> None:
        """Every model the config asks for is here: nothing is silently skipped, nothing fails mid-run."""
        c = config
        missing = [(key, role) for key, role, needed, present in (
            ("algorithm.kl_coef", "reference", c.algorithm.kl_coef > 0, self.reference is not None),
            ("hybrid.mode", "teacher", c.hybrid.mode != "none", self.teacher is not None),
            ("hybrid.judge", "judge", c.hybrid.judge != "none", self.judge is not None),
            ("algorithm.advantage", "critic", needs_critic(c.algorithm.advantage), self.critic is not None),
        ) if needed and not present]
        if missing:
            raise ConfigError("; ".join(f"{key} needs Roles.{role}, which is not set" for key, role in missing)
                              + " (train/build.py builds them from the config; hand-built roles must too)")


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
      engine_params: policy params -> the engine's layout (multi-host: this host's replica).
      schedule: the learning-rate schedule (step -> rate).
      old_policy: where the PPO ratio's "old" logprobs come from (``guidance.old_policy``).
      steps: the jitted step functions.
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
    engine_params: Callable[[Any], Any]
    schedule: Callable[[int], Any]
    old_policy: OldPolicy
    steps: StepFunctions
