"""The base of every config section: field helpers, type checks, ``describe``.

The sections themselves live in ``config/sections.py`` (training; with ``rollout.py`` and
``hybrid.py``) and ``config/environments.py`` (the environment section's base; each
environment's own section lives with it in envs/). How a Config is built from outside is in
``config/overrides.py`` (``--set section.field=value``, converted to the field's declared
type) and ``config/loading.py`` (config files, saved dicts); the hooks through which the
layers above register what a Config is checked against are in ``config/registries.py``.
Unknown keys, wrong types and impossible combinations fail at load time with a
:class:`ConfigError` that names the field and what is allowed.

Every field carries its documentation in ``metadata["doc"]``; ``describe(Config)``
prints them.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration error; the message names the field and the allowed values."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or a default_factory for mutable defaults")
    return field(default=default, metadata={"doc": doc, **kw})


def _section(default_factory: Any, doc: str) -> Any:
    return field(default_factory=default_factory, metadata={"doc": doc})


DType = Literal["float32", "bfloat16"]


class _Section:
    """Base of every config section: type checks every field after construction."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            coerced = _check_type(value, hints[f.name], self._path(f.name))
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """Section-level checks; subclasses raise ConfigError naming the field."""

    def _path(self, name: str) -> str:
        for cls in type(self).__mro__:  # a registered environment's section is "environment" too
            if cls.__name__ in SECTION_PATHS:
                return f"{SECTION_PATHS[cls.__name__]}.{name}"
        return f"{type(self).__name__}.{name}"

    @classmethod
    def variant(cls, name: str) -> type:
        """The section class a ``name`` field selects (only sections with variants override this)."""
        del name
        return cls


#: Dotted path of each section class in Config (for error messages), by class name.
SECTION_PATHS: dict[str, str] = {}


def _has_variants(cls: type) -> bool:
    return isinstance(cls, type) and cls.variant.__func__ is not _Section.variant.__func__


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_type(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: got {value!r}; allowed values are {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for a in args:
            if a is type(None):
                if value is None:
                    return value
                continue
            try:
                return _check_type(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {value!r} matches none of {' | '.join(_type_name(a) for a in args)}")
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"{path}: expected a tuple, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_check_type(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a dict, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an int, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected a bool (true/false), got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected a {tp.__name__} section, got {type(value).__name__}")
        return value
    return value


def _require(cond: bool, path: str, msg: str) -> None:
    if not cond:
        sep = " " if msg.startswith("(") else ": "
        raise ConfigError(f"{path}{sep}{msg}")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def describe(cls: type | None = None, prefix: str = "") -> str:
    """Every field with its type, default and documentation (for --help).

    A section with variants (``environment``) lists its common fields, then each
    registered variant's own fields under the ``name`` that selects it.
    """
    if cls is None:
        from agentrl_jax.config.sections import Config

        cls = Config
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(describe(tp, prefix=f"{prefix}{f.name}."))
            if _has_variants(tp):
                lines.append(_describe_variants(tp, prefix=f"{prefix}{f.name}."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            lines.append(f"{prefix}{f.name} = {default!r}  # {f.metadata.get('doc', '')}")
    return "\n".join(line for line in lines if line)


def _describe_variants(base: type, prefix: str) -> str:
    lines = []
    common = set(_fields(base))
    for name, cls in base.variants().items():
        hints = typing.get_type_hints(cls)
        own = [f for f in dataclasses.fields(cls) if f.name not in common]
        if own:
            lines.append(f"# {prefix}name={name!r} ({cls.__name__}):")
        for f in own:
            if dataclasses.is_dataclass(hints[f.name]):
                lines.append(describe(hints[f.name], prefix=f"{prefix}{f.name}."))
            else:
                default = f.default if f.default is not dataclasses.MISSING else "(required)"
                lines.append(f"{prefix}{f.name} = {default!r}  # {f.metadata.get('doc', '')}")
    return "\n".join(lines)
