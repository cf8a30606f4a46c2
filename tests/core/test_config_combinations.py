"""Every config combination the trainer cannot run fails at load.

Each case is refused twice: through ``--set`` overrides (``apply_overrides``), and for a
``Config`` built in Python (``from_dict`` constructs the sections with ``Config(...)``), so
a notebook user gets the same error as the command line. The error names the field.
"""

from __future__ import annotations

import re

import pytest

from agentrl_jax.config import Config, ConfigError, apply_overrides, from_dict, load_config
from agentrl_jax.losses import check_registered_names

INVALID = [
    # combinations once accepted that failed (or silently degraded) mid-run
    (["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.judge=oracle"], "hybrid.judge"),
    (["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.mode=hybrid", "hybrid.judge=oracle",
      "hybrid.prm_weight=0.5"], "hybrid.judge"),
    (["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.judge=policy"], "hybrid.judge"),
    (["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.mode=opd", "hybrid.judge=teacher"], "hybrid.judge"),
    (["algorithm.advantage=opd"], "algorithm.advantage"),
    (["algorithm.advantage=opd", "hybrid.mode=opd"], "algorithm.advantage"),
    (["algorithm.advantage=hybrid", "hybrid.mode=hybrid"], "algorithm.advantage"),
    (["algorithm.advantage=gae", "hybrid.mode=opd"], "algorithm.advantage"),
    (["algorithm.advantage=gae", "algorithm.dynamic_sampling=true"], "algorithm.dynamic_sampling"),
    (["critic.path=/ckpt/critic"], "critic.path"),  # silently unused without a critic estimator
    # shaping the environment ignores or cannot compute (was: an env error on every episode,
    # a ValueError after the model loaded, or silently no effect)
    (["environment.overlong_buffer=4000"], "environment.overlong_buffer"),
    (["environment.overlong_buffer=-1"], "environment.overlong_buffer"),
    (["environment.name=search", "environment.overlong_buffer=64"], "environment.overlong_buffer"),
    (["environment.name=search", "environment.tool_weight=0.1"], "environment.tool_weight"),
    (["environment.tool_weight=7"], "environment.tool_weight"),
    (["environment.outcome_scheme=binary", "environment.tool_weight=4"], "environment.tool_weight"),
    (["environment.format_weight=-0.5"], "environment.format_weight"),
    # cross-section checks that were already there
    (["hybrid.judge=teacher"], "hybrid.judge"),
    (["hybrid.judge=oracle", "environment.name=retool"], "hybrid.judge"),
    (["hybrid.prm_weight=0.5"], "hybrid.prm_weight"),
    (["hybrid.mode=hybrid", "hybrid.teacher=checkpoint"], "hybrid.teacher_path"),
    (["async_rl.enabled=true", "async_rl.max_staleness=2"], "algorithm.correction"),
    (["async_rl.placement=disaggregated"], "async_rl.placement"),
    (["async_rl.enabled=true", "async_rl.offload_optimizer=true", "async_rl.old_logprobs=snapshot"],
     "async_rl.offload_optimizer"),
    (["environment.verifier.workers=0"], "environment.verifier.workers"),
    (["environment.verifier.timeout_s=0"], "environment.verifier.timeout_s"),
    (["algorithm.group_size=1"], "algorithm.group_size"),
    (["algorithm.minibatches=3"], "algorithm.minibatches"),
    (["algorithm.micro_batch_size=3"], "algorithm.micro_batch_size"),
    (["algorithm.pack_row_tokens=0"], "algorithm.pack_row_tokens"),
    (["algorithm.micro_batch_tokens=-1"], "algorithm.micro_batch_tokens"),
    (["rollout.max_prompt_length=4096"], "rollout.max_prompt_length"),
    (["model.attention_impl=cudnn", "model.compute_dtype=float32"], "model.attention_impl"),
    (["algorithm.truncated_episodes=drop"], "algorithm.truncated_episodes"),
    (["model.reference_path=/ckpt/ref"], "model.reference_path"),  # silently unused without the KL term
]


def _nested(overrides: list[str]) -> dict:
    """``section.field=value`` overrides as the nested dict ``from_dict`` takes (ints, floats,
    booleans and strings parsed from the text)."""
    out: dict = {}
    for item in overrides:
        key, text = item.split("=", 1)
        *sections, name = key.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[name] = int(text) if re.fullmatch(r"-?\d+", text) else (
            float(text) if re.fullmatch(r"-?\d+\.\d*", text) else {"true": True, "false": False}.get(text, text))
    return out


@pytest.mark.parametrize("overrides, field", INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_an_impossible_combination_fails_at_load_naming_the_field(overrides, field):
    pattern = re.escape(field) + r"[:/ (]"
    with pytest.raises(ConfigError) as cli:
        apply_overrides(Config(), overrides)
    assert re.match(pattern, str(cli.value)), str(cli.value)
    with pytest.raises(ConfigError) as python:
        from_dict(_nested(overrides))
    assert re.match(pattern, str(python.value)), str(python.value)


def test_the_async_judge_refusal_says_why():
    with pytest.raises(ConfigError, match=r"async pipeline does not run a judge.*without verdicts.*docs/async\.md"):
        apply_overrides(Config(), ["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.judge=oracle"])


def test_valid_neighbours_still_load():
    """The refusals are not too broad: the nearest runnable combinations load."""
    # async + hybrid without a judge: OPD on every trajectory, as documented
    for overrides in (["async_rl.enabled=true", "async_rl.max_staleness=0", "hybrid.mode=hybrid"],
                      ["hybrid.mode=opd"], ["hybrid.mode=hybrid", "hybrid.judge=oracle", "hybrid.prm_weight=0.5"],
                      ["environment.overlong_buffer=64"], ["environment.tool_weight=3"],
                      ["algorithm.truncated_episodes=penalize"],
                      ["model.reference_path=/ckpt/ref", "algorithm.kl_coef=0.01"]):
        load_config("demo", overrides)


def test_registered_estimators_and_losses_must_be_callable_by_the_trainer():
    """A custom advantage or loss whose required arguments the trainer never passes fails at
    load (and when the RL loop is built from a Python Config), not at the first update."""
    from agentrl_jax.losses import registry

    if "needs_values_test" not in registry.known_advantages():
        @registry.register_advantage("needs_values_test")
        def needs_values(rewards, group_ids, loss_mask, *, num_groups, values, sequence_ids=None):
            raise AssertionError("never called")

        @registry.register_loss("needs_beta_test")
        def needs_beta(logp, old, adv, mask, *, beta, sequence_ids=None, num_sequences=None):
            raise AssertionError("never called")

    with pytest.raises(ConfigError, match=r"algorithm\.advantage: 'needs_values_test' requires \['values'\]"):
        load_config("demo", ["algorithm.advantage=needs_values_test"])
    with pytest.raises(ConfigError, match=r"algorithm\.loss_hparams: loss 'needs_beta_test' requires \['beta'\]"):
        check_registered_names(apply_overrides(Config(), ["algorithm.loss=needs_beta_test"]))
    check_registered_names(apply_overrides(Config(), ["algorithm.loss=needs_beta_test",
                                                      'algorithm.loss_hparams=[["beta", 0.1]]']))
