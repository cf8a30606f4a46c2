"""Name -> function registries for policy losses and advantage estimators.

The trainer never imports a loss by module path: the config names it (`loss="ppo"`,
`advantage="grpo"`) and the trainer calls `get_loss(name)` / `get_advantage(name)`.
A user adds an algorithm by decorating a pure function with the signature below; see
docs/custom_loss.md for a worked example.

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
    hparams     keyword hyper-parameters from the config (eps_low=..., ...); an unknown
                key must raise TypeError, so a typo in the config fails loudly

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

from typing import Any, Callable, Protocol, TypeVar

from jaxtyping import Array, Float, Int

_LOSSES: dict[str, Callable[..., Any]] = {}
_ADVANTAGES: dict[str, Callable[..., Any]] = {}

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


def register_loss(name: str) -> Callable[[F], F]:
    """Decorator: make a `PolicyLoss` selectable by `name` in the config."""
    return _register(_LOSSES, "loss", name)


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: make an `AdvantageEstimator` selectable by `name` in the config."""
    return _register(_ADVANTAGES, "advantage", name)


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


def known_losses() -> list[str]:
    _load_builtins()
    return sorted(_LOSSES)


def known_advantages() -> list[str]:
    _load_builtins()
    return sorted(_ADVANTAGES)
