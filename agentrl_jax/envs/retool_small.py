"""The retool_small environment's config section: generated problems that need a program,
in the ReTool environment (``envs/retool.py``), with scripted-solver SFT demonstrations
(``envs/program_tasks.py``, ``envs/program_demos.py``; configs/retool_small.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from agentrl_jax.config import Config, EnvironmentConfig, config_field, register_environment, require
from agentrl_jax.envs.program_demos import STYLES, demonstrations, run_blocking
from agentrl_jax.envs.program_tasks import FAMILIES, make_tasks
from agentrl_jax.envs.retool import ReToolConfig, ReToolEnv, code_env_factory
from agentrl_jax.envs.sandbox import make_sandbox


@register_environment("retool_small")
@dataclasses.dataclass(frozen=True)
class ReToolSmallEnvConfig(EnvironmentConfig):
    """Generated problems that need a program, in the ReTool environment, with scripted-solver SFT
    demonstrations (envs/program_tasks.py, envs/program_demos.py; configs/retool_small.py)."""

    name: str = config_field("retool_small", "Which environment runs the episodes.")
    families: tuple[str, ...] = config_field(
        ("bignum", "seqsum", "gcdlcm", "primes", "digits", "lineq", "binom", "modpow"),
        "retool_small: problem families (envs/program_tasks.py FAMILIES).")
    num_train_tasks: int = config_field(20000, "retool_small: generated training tasks (when data.train_path is "
                                               "empty).")
    num_eval_tasks: int = config_field(160, "retool_small: generated held-out tasks (when data.eval_path is empty).")
    combo_fraction: float = config_field(0.5, "retool_small: fraction of held-out tasks that are held-out "
                                              "combinations (the rest: training variants with held-out parameter "
                                              "ranges).")
    num_demonstrations: int = config_field(4000, "retool_small SFT: demonstrations written by the scripted solver, "
                                                 "one per training task from the first.")
    demo_styles: tuple[float, float, float, float] = config_field(
        (0.45, 0.25, 0.2, 0.1), "retool_small SFT: weights of the demonstration styles tool, memory, fix (a buggy "
                                "program, its traceback, the fix), give_up (a buggy program, then a guess).")

    generates_tasks: ClassVar[bool] = True

    def validate(self) -> None:
        super().validate()
        unknown = sorted(set(self.families) - set(FAMILIES))
        require(bool(self.families) and not unknown, self._path("families"),
                f"unknown families {unknown or 'none given'}; known: {', '.join(FAMILIES)}")
        for key in ("num_train_tasks", "num_eval_tasks", "num_demonstrations"):
            require(getattr(self, key) >= 1, self._path(key), "must be >= 1")
        require(0 <= self.combo_fraction <= 1, self._path("combo_fraction"), "must be in [0, 1]")
        require(min(self.demo_styles) >= 0 and sum(self.demo_styles) > 0, self._path("demo_styles"),
                f"must be non-negative weights with a positive sum, got {self.demo_styles}")

    def make_tasks(self, config: Config, split: Literal["train", "eval"]) -> list[dict[str, Any]]:
        train, held_out = make_tasks(self.num_train_tasks, self.num_eval_tasks, seed=config.seed,
                                     families=self.families, combo_fraction=self.combo_fraction)
        return train if split == "train" else held_out

    def make_demonstrations(self, config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
        async def write():
            async with make_sandbox(config) as pool:
                return await demonstrations(tasks[:self.num_demonstrations], pool, ReToolConfig.from_config(config),
                                            fractions=dict(zip(STYLES, self.demo_styles)), seed=config.seed)
        return run_blocking(write())

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        return code_env_factory(self, ReToolEnv, ReToolConfig.from_config(config), pool, verifier, count_tokens)
