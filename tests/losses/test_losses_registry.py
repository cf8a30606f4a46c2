"""Registry: built-in names, unknown-name errors, and the docs/custom_loss.md example runs."""

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.config import AlgorithmConfig, Config, ConfigError, apply_overrides
from agentrl_jax.losses import (
    get_advantage,
    get_loss,
    known_advantages,
    known_losses,
    loss_hparams,
    register_loss,
)
from agentrl_jax.losses import global_normalizer, registry
from agentrl_jax.train.step import LossSettings, loss_from_logprobs

DOC = Path(__file__).resolve().parents[2] / "docs" / "custom_loss.md"


def test_builtins_are_registered():
    assert {"ppo", "gspo", "gspo_token", "cispo", "reinforce"} <= set(known_losses())
    assert {"grpo", "drgrpo", "rloo", "reinforce_pp", "gae", "opd", "hybrid"} <= set(known_advantages())


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown loss 'ppo2'; known losses: \[.*'ppo'.*\]"):
        get_loss("ppo2")
    with pytest.raises(ValueError, match="known advantages"):
        get_advantage("nope")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_loss("ppo")(lambda *a, **k: None)


def test_doc_example_executes_and_registers(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    example = [b for b in blocks if "@register_loss" in b]
    assert len(example) == 1
    namespace: dict = {}
    try:
        exec(compile(example[0], str(DOC), "exec"), namespace)
        assert "soft_clip_ppo" in known_losses()
        out = capsys.readouterr().out
        assert "saturated_frac" in out
        # Independent check of the printed value: tanh surrogate at r = exp(0.05), token mean.
        r = np.exp(0.05)
        adv = np.array([1.0, 1.0, 1.0, -0.5, -0.5])
        want = np.mean(-adv * (1 + 0.2 * np.tanh((r - 1) / 0.2)))
        mask = namespace["loss_mask"]
        micro = dict(loss_mask=mask, old_logprobs=namespace["old_logp"], rollout_logprobs=namespace["old_logp"],
                     advantages=namespace["advantages"])
        loss, _ = loss_from_logprobs(  # the trainer's composition, hyper-parameters from the config
            namespace["logp"], jnp.zeros_like(mask), micro, global_normalizer(mask, "token-mean"),
            LossSettings(loss="soft_clip_ppo", hparams=tuple(loss_hparams("soft_clip_ppo", Config(
                algorithm=AlgorithmConfig(loss="soft_clip_ppo"))).items())), None,
        )
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        np.testing.assert_allclose(float(out.split()[0]), want, rtol=1e-5)
        with pytest.raises(TypeError, match="tua"):
            get_loss("soft_clip_ppo")(*(jnp.zeros((1, 1)),) * 4, tua=0.1)
    finally:
        registry._LOSSES.pop("soft_clip_ppo", None)


def test_builtin_losses_take_their_hyperparameters_from_the_config():
    c = apply_overrides(Config(), ["algorithm.eps_low=0.1", "algorithm.eps_high=0.3"])
    assert loss_hparams("ppo", c) == {"eps_low": 0.1, "eps_high": 0.3, "dual_clip": None}
    c = apply_overrides(c, ["algorithm.dual_clip=3.0"])
    assert loss_hparams("ppo", c)["dual_clip"] == 3.0
    assert loss_hparams("gspo", c) == {"eps_low": 0.1, "eps_high": 0.3}
    assert loss_hparams("cispo", c) == {"eps_max": pytest.approx(1.3)}
    assert loss_hparams("reinforce", c) == {}
    c = apply_overrides(c, ["algorithm.loss=cispo", 'algorithm.loss_hparams=[["eps_max", 4.0], ["eps_min", 0.5]]'])
    assert loss_hparams("cispo", c) == {"eps_max": 4.0, "eps_min": 0.5}


def test_declared_hyperparameters_are_checked():
    with pytest.raises(ValueError, match=r"declares hparams \['bta'\] that beta_loss does not accept"):
        @register_loss("bad_decl_test", hparams={"bta": "algorithm.eps_low"})
        def beta_loss(logp, old, adv, mask, *, sequence_ids=None, num_sequences=None, beta=0.1):
            raise AssertionError("never called")
    assert "bad_decl_test" not in known_losses()
    try:
        @register_loss("bad_path_test", hparams={"beta": "algorithm.bta"})
        def beta_loss2(logp, old, adv, mask, *, sequence_ids=None, num_sequences=None, beta=0.1):
            raise AssertionError("never called")

        with pytest.raises(ConfigError, match=r"algorithm.loss_hparams: loss 'bad_path_test' declares hparam "
                                              r"'beta' from 'algorithm.bta': 'algorithm.bta' is not a config field"):
            Config(algorithm=AlgorithmConfig(loss="bad_path_test"))
    finally:
        registry._LOSSES.pop("bad_path_test", None)


def test_unknown_loss_hparams_key_fails_when_the_config_is_built():
    """A Config built in Python is checked against the registries like a loaded one."""
    with pytest.raises(ConfigError, match=r"algorithm.loss_hparams: loss 'ppo' takes no \['eps_hihg'\]; "
                                          r"its keyword hyper-parameters: \['dual_clip', 'eps_high', 'eps_low'\]"):
        Config(algorithm=AlgorithmConfig(loss_hparams=(("eps_hihg", 0.3),)))
    with pytest.raises(ConfigError, match=r"algorithm.loss: unknown name 'ppo2'"):
        Config(algorithm=AlgorithmConfig(loss="ppo2"))
    with pytest.raises(ConfigError, match=r"algorithm.advantage: unknown name 'grpo2'"):
        Config(algorithm=AlgorithmConfig(advantage="grpo2"))
    with pytest.raises(ConfigError, match=r"algorithm.group_size: must be >= 2 for the group estimator 'rloo'"):
        Config(algorithm=AlgorithmConfig(advantage="rloo", group_size=1))
    Config(algorithm=AlgorithmConfig(advantage="reinforce_pp", group_size=1))
