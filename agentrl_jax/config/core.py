"""The config machinery: typed sections, type checks, overrides, loading, describe.

The sections themselves live in ``config/sections.py`` (training; with ``rollout.py`` and
``hybrid.py``) and
``config/environments.py`` (the environment section's base; each environment's own
section lives with it in envs/). A config file is Python:
``configs/retool.py`` defines ``get_config() -> Config``. The command line overrides
any field with ``--set section.field=value``; the value is converted to the field's
declared type. Unknown keys, wrong types and impossible
combinations fail at load time with a :class:`ConfigError` that names the field and
what is allowed.

Every field carries its documentation in ``metadata["doc"]``; ``describe(Config)``
prints them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config


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



# --------------------------------------------------------------------------- overrides


def _parse_value(text: str, tp: Any, path: str) -> Any:
    """Convert a command-line string to the field's type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _parse_value(text, a, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: cannot parse {text!r} as {tp}")
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ConfigError(f"{path}: got {text!r}; allowed values are {', '.join(map(repr, args))}")
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected a bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{path}: expected an int, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{path}: expected a float, got {text!r}") from None
    if tp is str:
        return text
    if origin in (tuple, dict):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}: expected JSON for a {origin.__name__}, got {text!r}") from None
    raise ConfigError(f"{path}: cannot be set from the command line (type {tp})")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def apply_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """Return ``config`` with ``section.field=value`` overrides applied (and validated).

    Keys are checked against the section each override lands in: the current value's
    class, or for a section with variants (``environment``) the class that a ``name``
    override among ``overrides`` selects, so ``environment.name=search
    environment.top_k=5`` checks ``top_k`` against the search environment's section.

    Raises:
      ConfigError: naming the key for an unknown key, a malformed item or a bad value.
    """
    items = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. optimizer.learning_rate=1e-6")
        key, text = item.split("=", 1)
        items.append((key.strip(), text.strip()))
    names = {key[: -len(".name")]: text for key, text in items if key.endswith(".name")}
    raw: dict[str, Any] = {}
    for key, text in items:
        parts = key.split(".")
        value: Any = config  # the current section, None below a section whose class a name override changes
        cls: type = type(config)
        for i, part in enumerate(parts):
            fields = _fields(cls)
            if part not in fields:
                where = ".".join(parts[:i]) or "the top level"
                owners = [n for n, c in cls.variants().items() if part in _fields(c)] if _has_variants(cls) else []
                hint = (f" ({part!r} is a field of {where}.name={' / '.join(map(repr, owners))}; this one is "
                        f"{getattr(value, 'name', names.get(where))!r})") if owners else ""
                raise ConfigError(f"override {key!r}: unknown key {part!r} in {where}{hint}; known keys: "
                                  f"{', '.join(sorted(fields))}")
            tp = typing.get_type_hints(cls)[part]
            if i < len(parts) - 1:
                if not dataclasses.is_dataclass(tp):
                    raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section")
                value = getattr(value, part, None)
                cls = type(value) if value is not None else tp
                path = ".".join(parts[: i + 1])
                if _has_variants(tp) and path in names and tp.variant(names[path]) is not cls:
                    cls, value = tp.variant(names[path]), None
            else:
                if dataclasses.is_dataclass(tp):
                    raise ConfigError(f"override {key!r}: is a section; set one of its fields")
                raw[key] = _parse_value(text, tp, key)
    return _replace_nested(config, raw)


def _switch_variant(obj: Any, cls: type, updates: dict[str, Any]) -> Any:
    """``obj`` as a ``cls`` section: the fields both have keep ``obj``'s values."""
    common = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init and f.name in _fields(cls)}
    return cls(**{**common, **updates})


def _replace_nested(obj: Any, updates: dict[str, Any]) -> Any:
    direct = {k: v for k, v in updates.items() if "." not in k}
    nested: dict[str, dict[str, Any]] = {}
    for k, v in updates.items():
        if "." in k:
            head, rest = k.split(".", 1)
            nested.setdefault(head, {})[rest] = v
    if "name" in direct and _has_variants(type(obj)) and type(obj).variant(direct["name"]) is not type(obj):
        obj = _switch_variant(obj, type(obj).variant(direct["name"]), direct)  # then its nested sections
    for head, sub in nested.items():
        direct[head] = _replace_nested(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct) if direct else obj


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
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """The config as a JSON-serializable nested dict."""
    return dataclasses.asdict(config)


# --------------------------------------------------------------------------- loading


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


# --------------------------------------------------------------------------- registries
#
# The layers above config own registries a Config is checked against (environments in
# envs/, losses and estimators in losses/). config imports none of them: they register
# here, and the package root (agentrl_jax/__init__.py) adds the loaders that import the
# built-in ones the first time a registry is read.

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
