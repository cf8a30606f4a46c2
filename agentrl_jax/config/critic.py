"""The critic section: the value model of PPO with GAE (``algorithm.advantage='gae'``).

A section of its own rather than fields under ``algorithm``: the critic is a second trained
model, with its own initialization, learning rate, schedule and warm-up, next to the
estimator's settings (gamma, lambda, turn level, whitening) that only a critic uses. The
cross-section checks (a critic setting without a critic estimator, combinations the critic
does not support) run with the advantage registry's (``losses/registry.py``), which knows
which estimators need a critic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl_jax.config.core import _f, _require, _Section


@dataclass(frozen=True)
class CriticConfig(_Section):
    """The value model: the policy's architecture with a scalar head instead of the LM head."""

    path: str = _f("", "HF checkpoint to initialize the critic's trunk from (same architecture as the policy); "
                       "empty: the policy RL starts from (the loaded checkpoint, or the post-SFT policy).")
    learning_rate: float = _f(0.0, "Peak learning rate of the critic's AdamW (0: optimizer.learning_rate). The "
                                   "other AdamW settings (betas, eps, weight decay, grad_clip) are the optimizer "
                                   "section's.")
    schedule: Literal["constant", "cosine"] = _f("constant", "Decay of the critic's learning rate after its warmup.")
    lr_warmup_steps: int = _f(0, "Linear warmup of the critic's learning rate, in critic updates.")
    warmup_steps: int = _f(0, "RL steps at the start that train only the critic: the policy does not move until "
                              "its baseline has fit the returns of the starting policy.")
    gamma: float = _f(1.0, "GAE discount per step (agent token, or turn with turn_level).")
    lam: float = _f(1.0, "GAE lambda: 1 is the Monte-Carlo return minus the critic's baseline (unbiased); "
                         "smaller trades bias from the critic for variance.")
    turn_level: bool = _f(False, "One step per turn (valued at its last agent token) instead of per agent "
                                 "token; the value loss then trains only those positions.")
    value_clip: float = _f(0.2, "Clip the critic's change to +-value_clip around its values before the update "
                                "(PPO's value clipping); 0: off.")
    whiten_advantages: bool = _f(True, "Normalize the advantages to mean 0, std 1 over the batch's agent tokens.")

    def validate(self) -> None:
        _require(self.learning_rate >= 0, self._path("learning_rate"), "must be >= 0 (0: optimizer.learning_rate)")
        _require(self.lr_warmup_steps >= 0, self._path("lr_warmup_steps"), "must be >= 0")
        _require(self.warmup_steps >= 0, self._path("warmup_steps"), "must be >= 0")
        _require(0 <= self.gamma <= 1, self._path("gamma"), f"must be in [0, 1], got {self.gamma}")
        _require(0 <= self.lam <= 1, self._path("lam"), f"must be in [0, 1], got {self.lam}")
        _require(self.value_clip >= 0, self._path("value_clip"), "must be >= 0 (0: off)")
