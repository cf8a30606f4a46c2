"""The registries a Config is checked against, as hooks the layers above config fill.

The layers above config own registries a Config is checked against (environments in
envs/, losses and estimators in losses/). config imports none of them: they register
here, and the package root (agentrl_jax/__init__.py) adds the loaders that import the
built-in ones the first time a registry is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config


#: Checks ``Config.validate`` runs on every Config, registered by the layers that own a registry.
_CONFIG_CHECKS: list[Callable[[Config], None]] = []
#: registry name -> loaders not yet called.
_LOADERS: dict[str, list[Callable[[], None]]] = {"environments": [], "config_checks": []}


def add_registry_loader(registry: str, load: Callable[[], None]) -> None:
    """Call ``load`` (which imports modules that register into ``registry``) once, before the
    registry is first read: ``"environments"`` (``register_environment``) or ``"config_checks"``
    (``register_config_check``)."""
    if registry not in _LOADERS:
        raise ValueError(f"add_registry_loader: unknown registry {registry!r}; known: {', '.join(_LOADERS)}")
    _LOADERS[registry].append(load)


def load_registry(registry: str) -> None:
    """Run the pending loaders of ``registry`` (each once; a loader's own registrations do not
    re-enter it)."""
    pending = _LOADERS[registry]
    while pending:
        pending.pop(0)()


def register_config_check(check: Callable[[Config], None]) -> Callable[[Config], None]:
    """Run ``check(config)`` in every ``Config.validate``, before the cross-section checks.

    How a layer above config checks names against a registry it owns (losses/registry.py:
    ``algorithm.loss`` and ``algorithm.advantage``); ``check`` raises ConfigError naming the
    field. Registering the same function twice runs it once.
    """
    load_registry("config_checks")
    if check not in _CONFIG_CHECKS:
        _CONFIG_CHECKS.append(check)
    return check


def run_config_checks(config: Config) -> None:
    """The registered checks on ``config`` (``Config.validate`` runs them)."""
    load_registry("config_checks")
    for check in _CONFIG_CHECKS:
        check(config)
