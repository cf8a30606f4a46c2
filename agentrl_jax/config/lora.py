"""The model.lora section: low-rank adapters instead of full fine-tuning (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentrl_jax.config.core import SECTION_PATHS, _f, _require, _Section


@dataclass(frozen=True)
class LoraConfig(_Section):
    """Low-rank adapters on the policy (LoRA: Low-Rank Adaptation of Large Language Models,
    arXiv:2106.09685): W + (alpha / rank) A B on the targeted projections, the base frozen."""

    rank: int = _f(0, "Adapter rank r; 0: off (full fine-tuning).")
    alpha: float = _f(32.0, "Scale numerator: the update is (alpha / rank) A B.")
    targets: tuple[Literal["q", "k", "v", "o", "gate", "up", "down"], ...] = _f(
        ("q", "k", "v", "o", "gate", "up", "down"),
        "Projections that get adapters: attention q/k/v/o, MLP gate/up/down (HF q_proj ... down_proj).")
    impl: Literal["in_layer", "merged"] = _f(
        "in_layer", "How the update applies the adapters: in_layer computes x W + (alpha / rank) (x A) B in each "
                    "projection; merged forms W + (alpha / rank) A B (a merged copy and its gradient per weight).")

    def validate(self) -> None:
        _require(self.rank >= 0, self._path("rank"), f"must be >= 0 (0: off), got {self.rank}")
        _require(self.alpha > 0, self._path("alpha"), f"must be > 0, got {self.alpha}")
        _require(not self.rank or bool(self.targets), self._path("targets"), "must name at least one projection")
        _require(len(set(self.targets)) == len(self.targets), self._path("targets"),
                 f"names a projection twice: {list(self.targets)}")


SECTION_PATHS["LoraConfig"] = "model.lora"
