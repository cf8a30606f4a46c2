"""Several trainable policies in one run (docs/multi_policy.md): ``multi_policy.policies``.

Each policy is today's single-policy config with its own overrides: ``PolicyConfig.overrides``
are ``section.field=value`` strings (as ``--set`` takes) over the run's sections ``model``,
``optimizer``, ``algorithm``, ``rollout``, ``critic``, ``sft``, ``mesh`` and ``async_rl`` (its
staleness bound); the result
(``policy_config``) is validated exactly as a single-policy Config is, and each error names
the policy. What every policy shares stays the run's: the tasks (``data``,
``environment``), ``total_steps``, ``seed``, ``eval``. With no policies (the default) the
run is the single-policy run, unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from agentrl_jax.config.core import SECTION_PATHS, ConfigError, _f, _require, _Section
from agentrl_jax.config.registries import register_config_check

if TYPE_CHECKING:
    from agentrl_jax.config.sections import Config

#: The sections a policy may set on its own; the rest is the run's, shared by every policy.
POLICY_SECTIONS = ("model", "optimizer", "algorithm", "rollout", "critic", "sft", "mesh", "async_rl")


@dataclass(frozen=True)
class PolicyConfig(_Section):
    name: str = _f("policy", "The policy's name (its output folder, metrics prefix and checkpoint).")
    actors: tuple[str, ...] = _f((), "The episode's actors this policy plays (several: shared weights, roles by "
                                     "prompt).")
    overrides: tuple[str, ...] = _f((), "section.field=value over the run's model, optimizer, algorithm, rollout, "
                                        "critic, sft, mesh and async_rl sections (e.g. 'model.path=/ckpt').")
    devices: tuple[int, ...] = _f((), "Indices into jax.devices() of the policy's engine and trainer (its "
                                      "sub-mesh); empty: its share, else all devices (time-shared).")
    share: float = _f(0.0, "With no devices: this fraction of the devices, a block after the blocks of the "
                           "policies before it; 0: all devices.")
    checkpoint_dir: str = _f("", "The policy's checkpoints; empty: output_dir/policies/<name>/checkpoints.")

    def validate(self) -> None:
        _require(bool(self.name) and "/" not in self.name, "multi_policy.policies.name",
                 f"{self.name!r} must be a non-empty name without '/'")
        _require(bool(self.actors), f"multi_policy.policies[{self.name}].actors", "must name at least one actor")
        _require(len(set(self.devices)) == len(self.devices) and min(self.devices, default=0) >= 0,
                 f"multi_policy.policies[{self.name}].devices", f"{self.devices} must be distinct indices >= 0")
        _require(0 <= self.share <= 1 and not (self.share and self.devices), f"multi_policy.policies[{self.name}].share",
                 f"{self.share} must be in [0, 1], and not given with devices")
        for item in self.overrides:
            section = item.split("=", 1)[0].split(".", 1)[0].strip()
            _require("=" in item and section in POLICY_SECTIONS, f"multi_policy.policies[{self.name}].overrides",
                     f"{item!r}: a policy sets only {', '.join(POLICY_SECTIONS)} (section.field=value); the "
                     "rest is the run's, shared by every policy")


@dataclass(frozen=True)
class MultiPolicyConfig(_Section):
    policies: tuple[PolicyConfig, ...] = _f((), "The trained policies; empty: one policy (the run's own sections).")
    episode: Literal["solver_checker"] = _f("solver_checker", "The multi-actor episode (envs/solver_checker.py).")
    shared_view: bool = _f(False, "All actors write one transcript (else each has its own view of the others).")
    critique_retries: int = _f(1, "solver_checker: solver tries after a rejection.")
    role_reward: float = _f(1.0, "solver_checker: the checker's reward for a right accept / reject, added to "
                                 "the team reward.")
    checker_reward: Literal["balanced", "accuracy"] = _f(
        "balanced", "solver_checker: how a right verdict's role reward is weighted. 'balanced': by 1 / (classes x "
                    "the share of its class, right or wrong first answers) among the step's episodes, so the mean "
                    "is role_reward x balanced accuracy and a constant verdict earns half of it; 'accuracy': 1 each "
                    "(then rejecting every answer pays while fewer than a third of first answers are right).")
    checker_team_reward: bool = _f(
        True, "solver_checker: the checker's reward includes the team reward (false: its role reward alone; with "
              "it a rejection is a free second try, which pays rejecting everything once second tries are as "
              "often right as first answers).")
    solver_second_tries: float = _f(
        0.0, "solver_checker SFT: fraction of the solver's demonstrations with a wrong answer that go on with the "
             "episode's rejection note and a second try calling the interpreter (environment.name='arithmetic').")
    checker_tool_calls: int = _f(
        0, "solver_checker: programs the checker may run in the solver's sandbox before its verdict (its cold "
           "start, environment.name='arithmetic', then prints the task's result first); 0: it only reads.")
    checker_miscopied: float = _f(
        0.0, "solver_checker SFT: fraction of the checker's demonstrations whose transcript's final boxed answer "
             "has one digit changed (wrong, as a solver that miscopies its program's output): with "
             "checker_cold_start='labeled' only comparing numbers tells them from right answers.")
    checker_cold_start: Literal["format", "labeled"] = _f(
        "format", "solver_checker SFT: the checker's verdicts on the solver's demonstrations. 'format': ACCEPT or "
                  "REJECT by a coin, independent of the answer (the format only; RL has to teach the judgment); "
                  "'labeled': the right verdict (it starts RL judging the scripted solver's mistakes).")
    frozen: tuple[str, ...] = _f(
        (), "Names of policies that act but RL never updates (their SFT cold start still runs): a fixed partner, "
            "e.g. a checker trained against a solver that does not change.")
    alternate_every: int = _f(
        0, "Train the policies in turns of this many steps each, in their order (the others act, frozen, "
           "meanwhile), so each learns against partners that hold still; 0: every policy every step. A "
           "policy's optimizer (and its learning-rate schedule) advances only on the steps it trains.")
    schedule: Literal["auto", "concurrent", "time_shared"] = _f(
        "auto", "How the policies train: 'concurrent' (each on its own devices, at once), 'time_shared' (one "
                "after the other); 'auto': concurrent when the policies' devices are disjoint.")

    def validate(self) -> None:
        names = [p.name for p in self.policies]
        _require(len(set(names)) == len(names), "multi_policy.policies", f"names must be distinct, got {names}")
        actors = [a for p in self.policies for a in p.actors]
        _require(len(set(actors)) == len(actors), "multi_policy.policies",
                 f"each actor is played by one policy; {sorted({a for a in actors if actors.count(a) > 1})} by several")
        _require(set(self.frozen) <= set(names), "multi_policy.frozen",
                 f"{list(self.frozen)} names policies that are not among {names}")
        _require(not names or not set(names) <= set(self.frozen), "multi_policy.frozen",
                 f"{list(self.frozen)} freezes every policy; at least one must train")
        _require(self.alternate_every >= 0, "multi_policy.alternate_every", f"{self.alternate_every} must be >= 0")
        _require(self.critique_retries >= 0, "multi_policy.critique_retries", "must be >= 0")
        _require(0 <= self.checker_miscopied <= 1, "multi_policy.checker_miscopied",
                 f"{self.checker_miscopied} must be in [0, 1]")
        _require(self.checker_tool_calls >= 0, "multi_policy.checker_tool_calls", f"{self.checker_tool_calls} must "
                 "be >= 0")
        _require(0 <= self.solver_second_tries <= 1, "multi_policy.solver_second_tries",
                 f"{self.solver_second_tries} must be in [0, 1]")
        _require(not self.solver_second_tries or self.critique_retries >= 1, "multi_policy.solver_second_tries",
                 f"({self.solver_second_tries}) teaches second tries, which need multi_policy.critique_retries >= 1")

        _require(sum(p.share for p in self.policies) <= 1 + 1e-9, "multi_policy.policies",
                 f"the shares add up to {sum(p.share for p in self.policies)}, more than all devices")

    @property
    def enabled(self) -> bool:
        return bool(self.policies)

    def frozen_at(self, step: int) -> set[str]:
        """The policies not trained at ``step`` (0-based): ``frozen``, and with ``alternate_every``
        every trainable policy but the one whose turn it is."""
        trainable = [p.name for p in self.policies if p.name not in self.frozen]
        if not self.alternate_every or not trainable:
            return set(self.frozen)
        turn = trainable[(step // self.alternate_every) % len(trainable)]
        return {p.name for p in self.policies} - {turn}

    def placement(self, num_devices: int) -> list[tuple[int, ...]]:
        """Each policy's device indices out of ``num_devices``: its ``devices``, its ``share`` (a
        block after the shares before it, at least one device), or all."""
        placed, first = [], 0
        for p in self.policies:
            if p.devices:
                placed.append(p.devices)
            elif p.share:
                count = max(1, round(p.share * num_devices))
                if first + count > num_devices:
                    raise ConfigError(f"multi_policy.policies[{p.name}].share: no device left for it ({num_devices} "
                                      "devices; every share takes at least one)")
                placed.append(tuple(range(first, first + count)))
                first += count
            else:
                placed.append(tuple(range(num_devices)))
        return placed

    def concurrent(self, num_devices: int) -> bool:
        """Whether the policies train at once (``schedule``; 'auto': when there are several and no two
        share a device)."""
        used = [set(d) for d in self.placement(num_devices)]
        disjoint = len(used) > 1 and sum(map(len, used)) == len(set().union(*used))  # one policy: nothing at once
        if self.schedule == "concurrent" and not disjoint:
            raise ConfigError("multi_policy.schedule: 'concurrent' needs every policy on devices of its own; "
                              f"the placement on {num_devices} devices is {self.placement(num_devices)}")
        return self.schedule == "concurrent" or (self.schedule == "auto" and disjoint)


def policy_config(config: Config, policy: PolicyConfig) -> Config:
    """The single-policy Config of ``policy``: the run's with the policy's overrides, its own
    output folder, validated as any Config (an error names the policy)."""
    from agentrl_jax.config.overrides import apply_overrides

    base = dataclasses.replace(config, multi_policy=MultiPolicyConfig(),
                               output_dir=f"{config.output_dir}/policies/{policy.name}")
    try:
        return apply_overrides(base, policy.overrides)
    except ConfigError as e:
        raise ConfigError(f"multi_policy.policies[{policy.name}]: {e}") from None


@register_config_check
def check_policies(config: Config) -> None:
    """Every policy's own Config is valid, and the run asks for nothing the multi-policy run
    does not do (a config check: ``Config.validate`` runs it)."""
    if not config.multi_policy.enabled:
        return
    unsupported = {"hybrid.mode": config.hybrid.mode != "none", "hybrid.judge": config.hybrid.judge != "none",
                   "data.sft_path": bool(config.data.sft_path)}
    for key, asked in unsupported.items():
        _require(not asked, key, "is not supported with multi_policy.policies yet (no teacher or judge, SFT from "
                                 "the episode's own demonstrations); leave it at its default")
    _require(not config.multi_policy.solver_second_tries or config.environment.name == "arithmetic",
             "multi_policy.solver_second_tries", f"({config.multi_policy.solver_second_tries}) writes second tries "
             f"for environment.name='arithmetic' only, not {config.environment.name!r}; set it to 0")
    for policy in config.multi_policy.policies:
        own = policy_config(config, policy)
        if own.async_rl.enabled:  # the multi-policy pipeline: the next step's episodes while this one trains
            where = f"multi_policy.policies[{policy.name}].async_rl"
            _require(own.async_rl.mode == "step" and own.async_rl.placement == "colocated", where,
                     f"mode={own.async_rl.mode!r}, placement={own.async_rl.placement!r}: several policies run "
                     "async_rl.mode='step' with placement='colocated' only (each policy's devices decode and train)")
            _require(own.async_rl.max_staleness <= 1, f"{where}.max_staleness",
                     f"({own.async_rl.max_staleness}) the multi-policy pipeline collects one step ahead: set 0 or 1")
        _require(not (own.sft.steps and config.multi_policy.checker_tool_calls and "checker" in policy.actors)
                 or config.environment.name == "arithmetic", "multi_policy.checker_tool_calls",
                 f"({config.multi_policy.checker_tool_calls}) with the checker's SFT (policy {policy.name!r}) writes "
                 f"its programs for environment.name='arithmetic' only, not {config.environment.name!r}; set its "
                 "sft.steps=0 or checker_tool_calls=0")
        if own.sft.steps:  # a resumed run rebuilds no post-SFT frozen copy; the views must be the demos' layout
            _require(not config.multi_policy.shared_view and own.algorithm.kl_coef == 0 and not own.model.lora.rank,
                     f"multi_policy.policies[{policy.name}].sft.steps", "SFT of a policy is supported with its own "
                     "view (multi_policy.shared_view=false), no KL reference (algorithm.kl_coef=0) and no LoRA")


SECTION_PATHS.update({"MultiPolicyConfig": "multi_policy", "PolicyConfig": "multi_policy.policies"})
