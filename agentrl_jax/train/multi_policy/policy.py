"""One trained policy of a multi-policy run: its devices, model, engine, train state, roles,
step functions and checkpoints, built as the single-policy run builds them (``train/run.py``,
``train/build.py``) from the policy's own Config (``config.policies.policy_config``)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.config.policies import PolicyConfig, policy_config
from agentrl_jax.models import split_params
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models.lora import with_base, without_base
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.engine_config import EngineConfig
from agentrl_jax.sharding import DEFAULT_RULES, make_mesh
from agentrl_jax.train import lora, setup
from agentrl_jax.train.build import DTYPES, attention_implementation, build_rl, build_roles
from agentrl_jax.train.checkpoint import Checkpointer
from agentrl_jax.train.metrics import MetricsWriter
from agentrl_jax.train.rl.roles import RL
from agentrl_jax.train.step import TrainState, init_train_state, make_optimizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Policy:
    """A policy while the run trains it: what is built once, and its state and params version.

    Attributes:
      spec: its ``multi_policy.policies`` entry; ``config``: its own single-policy Config.
      mesh: its devices (engine and trainer colocated on them).
      driver: its rollout engine's driver (holds ``version``).
      rl: what its training step uses (``train/rl/loop.py train_step``).
      state, version: its train state and the params version its engine decodes with.
      checkpointer: its checkpoints (``spec.checkpoint_dir``).
      initial: (graphdef, params) it starts from, until ``finish_build`` makes the frozen models.
    """

    spec: PolicyConfig
    config: Config
    mesh: Mesh
    model_config: Any
    driver: Driver
    rl: RL | None
    state: TrainState
    version: int
    checkpointer: Checkpointer
    initial: tuple[Any, Any] | None = None

    @property
    def name(self) -> str:
        return self.spec.name


def policy_devices(placement: tuple[int, ...], name: str) -> list[Any]:
    """The devices of a policy's placement; an index past the last is one error line."""
    devices = jax.devices()
    missing = [i for i in placement if i >= len(devices)]
    if missing or not placement:
        raise ConfigError(f"multi_policy.policies[{name}].devices: {list(missing) or 'none'} past the {len(devices)} "
                          "devices this process sees")
    return [devices[i] for i in placement]


def model_assets(config: Config, spec: PolicyConfig, corpus: list[str]) -> tuple[Config, str, str]:
    """(the policy's Config, model dir, tokenizer dir): its checkpoint, or a scratch model."""
    own = policy_config(config, spec)
    model_dir, tokenizer_dir = setup.prepare_model_assets(own, corpus)
    return own, model_dir, tokenizer_dir


def checkpoint_dir(spec: PolicyConfig, out: Path) -> Path:
    return Path(spec.checkpoint_dir) if spec.checkpoint_dir else out / "policies" / spec.name / "checkpoints"


def build_policy(own: Config, spec: PolicyConfig, placement: tuple[int, ...], model_dir: str, tokenizer, *,
                 out: Path) -> Policy:
    """The policy's model on its sub-mesh (``placement``: device indices), its engine and driver
    (not started), its train state (restored later by ``restore``), with the run's ``tokenizer``."""
    mesh = make_mesh(own.mesh.shape(), devices=policy_devices(placement, spec.name))
    m = own.model
    model = load_hf_checkpoint(model_dir, dtype=DTYPES[m.param_dtype], compute_dtype=DTYPES[m.compute_dtype],
                               mesh=mesh, rules=DEFAULT_RULES,
                               attention_impl=attention_implementation(m.attention_impl, m.compute_dtype),
                               remat=m.remat, lm_head_dtype=m.lm_head_dtype)
    graphdef, params = split_params(model)
    r = own.rollout
    engine = Engine(model, EngineConfig.from_rollout(r), mesh=mesh)
    driver = Driver(engine, params, eos_token_ids=tokenizer.eos_token_ids,
                    detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tokenize=tokenizer.encode,
                    steps_per_dispatch=r.steps_per_dispatch, seed=own.seed,
                    prefill_token_budget=r.prefill_token_budget or None, prefix_cache=r.prefix_cache)
    optimizer, _ = make_optimizer(own.optimizer, own.total_steps)
    state = init_train_state(lora.policy_params(own, params, model.config, mesh), optimizer, own.seed)
    checkpointer = Checkpointer(checkpoint_dir(spec, out), max_to_keep=own.checkpoint.max_to_keep,
                                async_save=own.checkpoint.async_save)
    return Policy(spec, own, mesh, model.config, driver, None, state, 0, checkpointer, initial=(graphdef, params))


def finish_build(policy: Policy, tokenizer, *, start_step: int, train_tasks, eval_tasks, writer) -> None:
    """The policy's roles (reference, ...) from its starting params, and its step functions."""
    graphdef, params = policy.initial
    policy.initial = None  # the trained policy is the state from here on
    roles = build_roles(policy.config, graphdef, params, policy.mesh, tokenizer=tokenizer, driver=policy.driver,
                        start_step=start_step, policy_params=policy.state.params)
    policy.rl = build_rl(policy.config, roles=roles, state=policy.state, tokenizer=tokenizer, driver=policy.driver,
                         env_factory=None, train_tasks=train_tasks, eval_tasks=eval_tasks, writer=writer,
                         checkpointer=policy.checkpointer, mesh=policy.mesh)
    if start_step and roles.critic is not None:  # GAE: the critic's params and optimizer state
        roles.critic.restore(policy.checkpointer, start_step)
    policy.rl.old_policy.on_version(policy.version, policy.state.params)


async def cold_start(policy: Policy, tokenizer, conversations: list[list[dict[str, str]]], out: Path) -> None:
    """SFT of the policy on ``conversations`` (its actors' demonstrations, ``sft.*`` of its Config);
    its train state, frozen models and engine (version 0) start from the result."""
    from agentrl_jax.train.run import _sft  # the single-policy run's SFT stage (that module imports this package)

    if not conversations:
        raise ConfigError(f"multi_policy.policies[{policy.name}].sft.steps: no demonstrations for its actors "
                          f"{list(policy.spec.actors)}")
    graphdef, params = policy.initial
    c = policy.config
    with MetricsWriter(out / "policies" / policy.name / "sft_metrics", total_steps=c.sft.steps) as writer:
        params = _sft(c, graphdef, params, tokenizer, conversations, writer, policy.mesh)
    policy.initial = (graphdef, params)
    optimizer, _ = make_optimizer(c.optimizer, c.total_steps)
    policy.state = init_train_state(lora.policy_params(c, params, policy.model_config, policy.mesh), optimizer, c.seed)
    await policy.driver.update_params(policy.state.params, 0)


async def restore(policy: Policy, step: int):
    """Restores the policy's checkpoint at ``step`` into its state, pushes the params to its
    engine; returns the checkpoint (data position, extra)."""
    base, target = without_base(policy.state)
    restored = policy.checkpointer.restore(step, target)
    policy.state = restored.state if base is None else with_base(restored.state, base)
    policy.version = int((restored.extra or {}).get("version", step))
    await policy.driver.update_params(policy.state.params, policy.version)
    logger.info("policy %s: resumed from step %d (params version %d)", policy.name, step, policy.version)
    return restored
