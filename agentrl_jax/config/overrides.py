"""Command-line overrides: ``section.field=value`` strings applied to a Config.

The value is converted to the field's declared type; the key is checked against the section
it lands in (for a section with variants, the class a ``name`` override selects).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentrl_jax.config.core import ConfigError, _fields, _has_variants

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config


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



def apply_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """Return ``config`` with ``section.field=value`` overrides applied (and validated).

    Keys are checked against the section each override lands in: the current value's
    class, or for a section with variants (``environment``) the class that a ``name``
    override among ``overrides`` selects, so ``environment.name=search
    environment.top_k=5`` checks ``top_k`` against the search environment's section.

    Raises:
      ConfigError: naming the key for an unknown key, a malformed item or a bad value.
    """
    items, per_policy = [], []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. optimizer.learning_rate=1e-6")
        key, text = item.split("=", 1)
        (per_policy if key.strip().startswith(POLICY_PREFIX) else items).append((key.strip(), text.strip()))
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
    if per_policy:  # replaced with the run's items, so that the Config is validated once, with all of them
        raw["multi_policy.policies"] = _override_policies(config.multi_policy.policies, per_policy)
    return _replace_nested(config, raw)


#: ``multi_policy.policies.<name>.<key>=value`` sets one policy's own setting (docs/multi_policy.md).
POLICY_PREFIX = "multi_policy.policies."


def _override_policies(policies: Sequence[Any], items: Sequence[tuple[str, str]]) -> tuple[Any, ...]:
    """``policies`` with ``multi_policy.policies.<name>.<key>=value`` items applied, in order.

    ``<key>`` is either ``section.field`` over a section a policy may set (``optimizer``,
    ``algorithm``, ...), appended to that policy's ``overrides`` (so it wins over the config
    file's; it is checked when the policy's Config is built), or one of the policy's own fields
    (``actors``, ``devices``, ``share``, ``checkpoint_dir``).
    """
    from agentrl_jax.config.policies import POLICY_SECTIONS, PolicyConfig

    own = [f for f in _fields(PolicyConfig) if f not in ("name", "overrides")]
    policies = tuple(policies)
    for key, text in items:
        name, _, rest = key[len(POLICY_PREFIX):].partition(".")
        names = [p.name for p in policies]
        if name not in names:
            raise ConfigError(f"override {key!r}: no policy named {name!r}; the run's policies are "
                              f"{', '.join(names) if names else '(none: multi_policy.policies is empty)'}")
        policy = policies[names.index(name)]
        if rest.split(".", 1)[0] in POLICY_SECTIONS and "." in rest:
            policy = dataclasses.replace(policy, overrides=(*policy.overrides, f"{rest}={text}"))
        elif rest in own:
            policy = dataclasses.replace(policy, **{rest: _parse_value(text, typing.get_type_hints(PolicyConfig)[rest], key)})
        else:
            raise ConfigError(f"override {key!r}: after the policy's name expected section.field over "
                              f"{', '.join(POLICY_SECTIONS)}, or one of {', '.join(own)}; got {rest!r}")
        policies = tuple(policy if p.name == name else p for p in policies)
    return policies


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
