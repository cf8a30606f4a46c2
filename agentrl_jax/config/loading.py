"""A Config from outside: a Python config file (``get_config()``) or a saved nested dict."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl_jax.config.core import ConfigError, _fields, _has_variants
from agentrl_jax.config.overrides import apply_overrides

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config


def from_dict(data: dict[str, Any], cls: type | None = None, prefix: str = "") -> Any:
    """Build a config from a nested dict (e.g. a checkpoint's saved config), strictly.

    A section with variants (``environment``) is built as the class its ``name`` selects.
    """
    if cls is None:
        from agentrl_jax.config.sections import Config

        cls = Config
    if _has_variants(cls) and "name" in data:
        cls = cls.variant(data["name"])
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{path}: unknown key; known keys: {', '.join(sorted(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a section (dict), got {type(value).__name__}")
            value = from_dict(value, tp, prefix=f"{path}.")
        elif isinstance(value, (list, tuple)):
            item = (typing.get_args(tp) or (None,))[0]  # a tuple of sections (multi_policy.policies)
            value = tuple(from_dict(v, item, prefix=f"{path}[{i}].") if dataclasses.is_dataclass(item)
                          and isinstance(v, dict) else v for i, v in enumerate(value))
        kwargs[key] = value
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """The config as a JSON-serializable nested dict."""
    return dataclasses.asdict(config)


_CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parents[2] / "configs")


def resolve_config_path(name: str) -> Path:
    """Find a config file: a path as given, or a bare name (``retool`` / ``retool.py``) in configs/."""
    path = Path(name)
    if path.is_file():
        return path
    candidates = [name] if name.endswith(".py") else [name, name + ".py"]
    for d in _CONFIG_DIRS:
        for c in candidates:
            p = d / Path(c).name
            if p.is_file():
                return p
    known = sorted({p.stem for d in _CONFIG_DIRS if d.is_dir() for p in d.glob("*.py")})
    raise ConfigError(f"config file {name!r} not found; known configs: {', '.join(known) or '(none)'}")


def load_config(name: str, overrides: Sequence[str] = ()) -> Config:
    """Load ``get_config()`` from a Python config file, apply overrides, validate.

    Names from the registries (``environment.name``, ``algorithm.loss``,
    ``algorithm.advantage``) are checked when the Config is built, after the file's imports
    ran, so a config file may import (or define) a module that registers a custom one.
    """
    path = resolve_config_path(name)
    spec = importlib.util.spec_from_file_location(f"agentrl_jax_config_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path}: defines no get_config() function")
    config = module.get_config()
    from agentrl_jax.config.sections import Config

    if not isinstance(config, Config):
        raise ConfigError(f"config file {path}: get_config() returned {type(config).__name__}, not Config")
    config = apply_overrides(config, overrides)
    check_required_paths(config)
    return config


def check_required_paths(config: Config) -> None:
    """Paths a run needs but a config file may leave to the command line.

    Checked after overrides (a config file cannot know where the data lives); which paths
    an environment needs is its section's ``check_paths``.
    """
    config.environment.check_paths(config)
