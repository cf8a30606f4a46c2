"""Registry: built-in names, unknown-name errors, and the docs/custom_loss.md example runs."""

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.losses import (
    compute_policy_loss,
    get_advantage,
    get_loss,
    known_advantages,
    known_losses,
    register_loss,
)
from agentrl_jax.losses import registry

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
        loss, _ = compute_policy_loss(
            "soft_clip_ppo", namespace["logp"], namespace["old_logp"], namespace["advantages"],
            namespace["loss_mask"], tau=0.2,
        )
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        np.testing.assert_allclose(float(out.split()[0]), want, rtol=1e-5)
        with pytest.raises(TypeError, match="tua"):
            get_loss("soft_clip_ppo")(*(jnp.zeros((1, 1)),) * 4, tua=0.1)
    finally:
        registry._LOSSES.pop("soft_clip_ppo", None)
