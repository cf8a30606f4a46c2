"""Name -> function registries for policy losses and advantage estimators.

The trainer never imports a loss by module path: the config names it (`loss="ppo"`,
`advantage="grpo"`) and the trainer calls `get_loss(name)` / `get_advantage(name)`.
A user adds an algorithm by decorating a pure function with the signature below; see
docs/custom_loss.md for a worked example. Every Config is checked against these tables when
it is built (``check_registered_names``, registered with ``config.register_config_check``).

Policy loss signature (`PolicyLoss`)::

    loss_fn(logp, old_logp, advantages, loss_mask, *,
            sequence_ids=None, num_sequences=None, **hparams)
        -> (per_token_loss [B, T], metrics: dict[str, scalar])

    logp        [B, T] float  current policy logprob of each sampled token (differentiated)
    old_logp    [B, T] float  the policy that produced the batch, training side (constant)
    advantages  [B, T] float  per-token advantage (sequence estimators broadcast to tokens)
    loss_mask   [B, T] 0/1    1 exactly on tokens the policy sampled
    sequence_ids, num_sequences: packed-row layout, see `agentrl_jax.losses.sequences`;
                every loss must accept them (it may ignore them if it is token-local)
    hparams     keyword hyper-parameters (eps_low=..., ...); an unknown key must raise
                TypeError, so a typo fails loudly. Which config fields fill them is declared
                at registration (`register_loss(name, hparams={...})`); any keyword of the
                loss can also be set by `algorithm.loss_hparams`, checked at load

    per_token_loss is 0 wherever loss_mask is 0 and is NOT yet reduced: the caller
    aggregates it with `agentrl_jax.losses.aggregate` and a global normalizer so that
    micro-batch accumulation is exact. metrics are masked scalars.

Advantage estimator signature (`AdvantageEstimator`)::

    estimator(rewards [B], group_ids [B] int, loss_mask [B, T], *, num_groups, **hparams)
        -> advantages [B, T] (0 where loss_mask is 0)

    num_groups is a static int > max(group_ids); group ids may be unsorted. Estimators
    that need more (GAE: `values`, `token_rewards`) take them as keyword arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Protocol, TypeVar

from jaxtyping import Array, Float, Int

from agentrl_jax.config import Config, ConfigError, register_config_check, require

_LOSSES: dict[str, Callable[..., Any]] = {}
_ADVANTAGES: dict[str, Callable[..., Any]] = {}
# name -> {keyword: source}: where the trainer reads each declared hyper-parameter.
_LOSS_HPARAMS: dict[str, dict[str, "HparamSource"]] = {}
# name -> (min_group_size, note): what the config checks before the trainer calls it.
_ADVANTAGE_INFO: dict[str, tuple[int, str]] = {}
# Estimators whose baseline is a learned value model: the trainer builds a critic for them and
# passes its values (and the critic section's GAE settings) as keywords.
_CRITIC_ESTIMATORS: set[str] = set()
CRITIC_KEYWORDS = ("values", "gamma", "lam", "turn_level")

HparamSource = str | Callable[[Any], Any]
"""A config path ("algorithm.eps_low") or a function of the whole config (derived values)."""

F = TypeVar("F", bound=Callable[..., Any])


class PolicyLoss(Protocol):
    """A per-token policy loss; see the module docstring for the contract."""

    def __call__(
        self,
        logp: Float[Array, "B T"],
        old_logp: Float[Array, "B T"],
        advantages: Float[Array, "B T"],
        loss_mask: Float[Array, "B T"],
        *,
        sequence_ids: Int[Array, "B T"] | None = None,
        num_sequences: int | None = None,
        **hparams: Any,
    ) -> tuple[Float[Array, "B T"], dict[str, Array]]: ...


class AdvantageEstimator(Protocol):
    """An advantage estimator; see the module docstring for the contract."""

    def __call__(
        self,
        rewards: Float[Array, "B"],
        group_ids: Int[Array, "B"],
        loss_mask: Float[Array, "B T"],
        *,
        num_groups: int,
        **hparams: Any,
    ) -> Float[Array, "B T"]: ...


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__module__})")
        table[name] = fn
        return fn

    return decorator


def _keywords(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """The parameter names ``fn`` accepts by keyword, and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no inspectable signature: accept anything
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def register_loss(name: str, *, hparams: Mapping[str, HparamSource] | None = None) -> Callable[[F], F]:
    """Decorator: make a `PolicyLoss` selectable by `name` in the config.

    Args:
      name: the value of `algorithm.loss` that selects it.
      hparams: the hyper-parameters the loss takes from the config, keyword -> source: a
        dotted config path (``{"eps_low": "algorithm.eps_low"}``) or a function of the
        config for a derived value (``{"eps_max": lambda c: 1 + c.algorithm.eps_high}``).
        Keywords not declared keep the loss's defaults unless `algorithm.loss_hparams`
        sets them, so a loss with a hyper-parameter of its own needs no config field.
    """
    declared = dict(hparams or {})
    register = _register(_LOSSES, "loss", name)

    def decorator(fn: F) -> F:
        accepted, var_keyword = _keywords(fn)
        unknown = sorted(set(declared) - accepted) if not var_keyword else []
        if unknown:
            raise ValueError(f"loss {name!r} declares hparams {unknown} that {fn.__name__} does not accept")
        for key, source in declared.items():
            if not (callable(source) or (isinstance(source, str) and source)):
                raise ValueError(f"loss {name!r}: hparam {key!r} source must be a config path or a function, "
                                 f"got {source!r}")
        fn = register(fn)
        _LOSS_HPARAMS[name] = declared
        return fn

    return decorator


def register_advantage(name: str, *, min_group_size: int = 1, note: str = "",
                       needs_critic: bool = False) -> Callable[[F], F]:
    """Decorator: make an `AdvantageEstimator` selectable by `name` in the config.

    Args:
      name: the value of `algorithm.advantage` that selects it.
      min_group_size: the smallest `algorithm.group_size` it is defined for (2 for a group
        baseline: a group of one has no baseline).
      note: why the RL trainer cannot call it, when its signature needs more than the
        trainer passes (shown instead of the generic message).
      needs_critic: the estimator takes a critic's ``values`` [B, T]; the RL trainer then trains
        a value model (``train/critic.py``) and passes ``values``, ``gamma``, ``lam`` and
        ``turn_level`` (the ``critic`` section) as keywords.
    """
    register = _register(_ADVANTAGES, "advantage", name)

    def decorator(fn: F) -> F:
        fn = register(fn)
        _ADVANTAGE_INFO[name] = (min_group_size, note)
        if needs_critic:
            _CRITIC_ESTIMATORS.add(name)
        return fn

    return decorator


def _load_builtins() -> None:
    # The built-ins register themselves on import; importing here makes get_* work even
    # when the caller imported only this module.
    from agentrl_jax.losses import advantages, policy  # noqa: F401


def get_loss(name: str) -> PolicyLoss:
    """The policy loss registered under `name`; ValueError listing the known names otherwise."""
    _load_builtins()
    if name not in _LOSSES:
        raise ValueError(f"unknown loss {name!r}; known losses: {sorted(_LOSSES)}")
    return _LOSSES[name]


def get_advantage(name: str) -> AdvantageEstimator:
    """The advantage estimator registered under `name`; ValueError listing the known names."""
    _load_builtins()
    if name not in _ADVANTAGES:
        raise ValueError(f"unknown advantage {name!r}; known advantages: {sorted(_ADVANTAGES)}")
    return _ADVANTAGES[name]


def _config_value(config: Any, path: str) -> Any:
    value = config
    for part in path.split("."):
        if not hasattr(value, part):
            raise ValueError(f"{path!r} is not a config field")
        value = getattr(value, part)
    return value


def loss_hparams(name: str, config: Any) -> dict[str, Any]:
    """The keyword hyper-parameters the trainer passes to loss `name` under `config`.

    The ones the loss declared at registration, read from the config, then every
    `config.algorithm.loss_hparams` pair (which overrides a declared one).
    """
    get_loss(name)
    out = {}
    for key, source in _LOSS_HPARAMS.get(name, {}).items():
        try:
            out[key] = source(config) if callable(source) else _config_value(config, source)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"loss {name!r} declares hparam {key!r} from {source!r}: {e}") from None
    out.update(dict(config.algorithm.loss_hparams))
    return out


def loss_hparam_errors(name: str, config: Any) -> list[str]:
    """Why the trainer could not call loss `name` with `loss_hparams(name, config)`: a
    declared source that is not a config field, or an `algorithm.loss_hparams` key the loss
    does not accept (a typo would otherwise fail only at the first update)."""
    fn = get_loss(name)
    try:
        loss_hparams(name, config)
    except ValueError as e:
        return [str(e)]
    accepted, var_keyword = _keywords(fn)
    unknown = sorted(set(dict(config.algorithm.loss_hparams)) - accepted)
    if not unknown or var_keyword:
        return []
    arrays = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:4]
    options = sorted(accepted - set(arrays) - {"sequence_ids", "num_sequences"})
    return [f"loss {name!r} takes no {unknown}; its keyword hyper-parameters: {options}"]


def advantage_info(name: str) -> tuple[int, str]:
    """(min_group_size, note) of the registered estimator `name` (see register_advantage)."""
    get_advantage(name)
    return _ADVANTAGE_INFO.get(name, (1, ""))


def needs_critic(name: str) -> bool:
    """Whether the registered estimator `name` takes a critic's values (see register_advantage)."""
    get_advantage(name)
    return name in _CRITIC_ESTIMATORS


def known_losses() -> list[str]:
    _load_builtins()
    return sorted(_LOSSES)


def known_advantages() -> list[str]:
    _load_builtins()
    return sorted(_ADVANTAGES)


def check_registered_names(config: Config) -> None:
    """Check the loss and advantage against this registry (``Config.validate`` runs it: it is
    registered with ``register_config_check`` below).

    Unknown names fail with the registered ones; so do an estimator or a loss the trainer
    could not call with what it passes (rewards, group_ids, loss_mask, num_groups; the
    arrays, the packed layout and the hyper-parameters from ``loss_hparams``), an
    ``algorithm.loss_hparams`` key the loss does not take, and a group size the estimator
    is not defined for.
    """
    for key, value, known in (
        ("algorithm.loss", config.algorithm.loss, known_losses()),
        ("algorithm.advantage", config.algorithm.advantage, known_advantages()),
    ):
        if value not in known:
            raise ConfigError(f"{key}: unknown name {value!r}; registered: {', '.join(sorted(known))}")
    # The trainer calls the estimator and the loss with these arguments only
    # (train/episodes.py compute_advantages, train/step.py); one that needs more (a critic's
    # values, teacher logprobs, a hyper-parameter without default) would fail at the first update.
    algorithm = config.algorithm
    min_group_size, note = advantage_info(algorithm.advantage)
    critic_keywords = set(CRITIC_KEYWORDS) if needs_critic(algorithm.advantage) else set()
    needs = _required_parameters(get_advantage(algorithm.advantage), positional=3,
                                 keywords={"num_groups", "sequence_ids", *critic_keywords})
    require(not needs, "algorithm.advantage", f"{algorithm.advantage!r} {note}" if note else
            f"{algorithm.advantage!r} requires {sorted(needs)}, which the RL trainer does not pass (it passes rewards, "
            "group_ids, loss_mask, num_groups); use a sequence estimator (grpo, drgrpo, rloo, reinforce_pp)")
    require(algorithm.group_size >= min_group_size, "algorithm.group_size",
            f"must be >= {min_group_size} for the group estimator {algorithm.advantage!r} (got {algorithm.group_size})")
    _check_critic(config)
    errors = loss_hparam_errors(algorithm.loss, config)
    require(not errors, "algorithm.loss_hparams", "; ".join(errors))
    needs = _required_parameters(get_loss(algorithm.loss), positional=4,
                                 keywords={"sequence_ids", "num_sequences", *loss_hparams(algorithm.loss, config)})
    require(not needs, "algorithm.loss_hparams",
            f"loss {algorithm.loss!r} requires {sorted(needs)}, which have no defaults; set them with "
            "--set 'algorithm.loss_hparams=[[\"name\", value]]'")


def _check_critic(config: Config) -> None:
    """The critic section against the estimator: settings nothing would use, and what the
    critic path does not support."""
    a, critic = config.algorithm, config.critic
    if not needs_critic(a.advantage):
        require(not critic.path, "critic.path", f"is loaded only for a critic estimator (algorithm.advantage='gae'); "
                f"{a.advantage!r} trains no critic")
        return
    require(config.hybrid.mode == "none", "algorithm.advantage",
            f"{a.advantage!r} with hybrid.mode={config.hybrid.mode!r}: the teacher's signal mixes into a group "
            "estimator's advantages, not a critic's; use grpo, drgrpo, rloo or reinforce_pp with hybrid.mode")
    require(not a.dynamic_sampling, "algorithm.dynamic_sampling",
            f"drops groups whose rewards are all equal, which a critic baseline ({a.advantage!r}) still learns from "
            "(with group_size=1 it would drop every group); turn it off")


def _required_parameters(fn: Any, *, positional: int, keywords: set[str]) -> set[str]:
    """Parameters of ``fn`` without a default that a call with ``positional`` positional
    arguments and the ``keywords`` does not fill."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no inspectable signature: nothing to check
        return set()
    filled = 0
    needs = set()
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and filled < positional:
            filled += 1
            continue
        if p.default is inspect.Parameter.empty and p.name not in keywords:
            needs.add(p.name)
    return needs


register_config_check(check_registered_names)
