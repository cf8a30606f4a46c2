"""agentrl_jax: a JAX-native trainer that teaches LLM agents to use tools with RL.

The layers, lowest first: config; sharding; models, data, rewards; rollout, losses; envs;
train (``lint-imports`` checks them: pyproject.toml [tool.importlinter]). config imports
nothing above it: the environment sections (envs/) and the losses registry's config check
(losses/registry.py) register with it. This root wires them in: the first time a Config
reads one of those registries, it imports the modules that register the built-in ones, so
a config built after importing only ``agentrl_jax.config`` knows every built-in environment
and loss. Nothing heavy is imported here (the answer-verifier workers import this package).
"""

from agentrl_jax.config.registries import add_registry_loader

__version__ = "0.1.0"


def _load_environments() -> None:
    import agentrl_jax.envs  # noqa: F401  (its modules register the built-in environment sections)


def _load_config_checks() -> None:
    import agentrl_jax.losses  # noqa: F401  (registers the loss and advantage checks)


add_registry_loader("environments", _load_environments)
add_registry_loader("config_checks", _load_config_checks)
