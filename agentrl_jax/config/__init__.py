"""Typed, frozen, validated experiment configuration.

A config file is Python: ``configs/retool.py`` defines ``get_config() -> Config``. The
command line overrides any field with ``--set section.field=value``. Unknown keys, wrong
types and impossible combinations fail at load time with a :class:`ConfigError` that
names the field and what is allowed.

- ``config/core.py``: the section base (field helpers, type checks, describe).
- ``config/overrides.py`` (``--set`` overrides) and ``config/loading.py`` (config files,
  saved dicts): a Config from outside.
- ``config/registries.py``: the hooks the layers above fill (environments, config checks).
- ``config/sections.py``: the training sections and ``Config``; the two largest sections in
  ``config/rollout.py`` and ``config/hybrid.py``; the critic's in ``config/critic.py``.
- ``config/environments.py``: the base of the environment section; each environment
  registers its own subclass with :func:`register_environment` (the built-in ones in envs/),
  selected by ``environment.name``.

config imports nothing else from the package: the layers above it register what a Config
is checked against (environment sections, the losses registry's check through
:func:`register_config_check`); ``agentrl_jax/__init__.py`` loads the built-in ones the
first time a registry is read.
"""

from agentrl_jax.config.core import _f as config_field
from agentrl_jax.config.core import _require as require
from agentrl_jax.config.core import ConfigError, DType, describe
from agentrl_jax.config.critic import CriticConfig
from agentrl_jax.config.environments import (
    TOOL_REWARD_CAP,
    EnvironmentConfig,
    SandboxConfig,
    VerifierConfig,
    environment_names,
    overlong_max_tokens,
    register_environment,
)
from agentrl_jax.config.hybrid import JUDGE_FIELDS
from agentrl_jax.config.loading import check_required_paths, from_dict, load_config, resolve_config_path, to_dict
from agentrl_jax.config.lora import LoraConfig
from agentrl_jax.config.overrides import apply_overrides
from agentrl_jax.config.registries import register_config_check
from agentrl_jax.config.sections import (
    AlgorithmConfig,
    AsyncConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    HybridConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    ScratchModelConfig,
    SFTConfig,
)

__all__ = [
    "JUDGE_FIELDS", "TOOL_REWARD_CAP",
    "AlgorithmConfig", "AsyncConfig", "CheckpointConfig", "Config", "ConfigError", "CriticConfig", "DType", "DataConfig",
    "EnvironmentConfig", "EvalConfig", "HybridConfig", "LoggingConfig", "LoraConfig", "MeshConfig", "ModelConfig",
    "OptimizerConfig", "RolloutConfig", "SFTConfig", "SandboxConfig", "ScratchModelConfig", "VerifierConfig",
    "apply_overrides", "check_required_paths", "config_field", "describe", "environment_names", "from_dict",
    "load_config", "overlong_max_tokens", "register_config_check", "register_environment", "require",
    "resolve_config_path", "to_dict",
]
