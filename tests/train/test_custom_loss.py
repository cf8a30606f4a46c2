"""A custom loss with its own hyper-parameter, defined and registered in a user's config
file, trains end to end without touching the library (docs/custom_loss.md).

The loss reports the values it received as metrics: `beta` comes from
`algorithm.loss_hparams` (a hyper-parameter the library has no field for), `clip` from the
config field the loss declared at registration (`algorithm.eps_high`).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from agentrl_jax.config import ConfigError, load_config
from agentrl_jax.losses import registry
from agentrl_jax.train.run import train

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "rollout.max_concurrent=4", "rollout.max_new_tokens_per_turn=6",
    "rollout.max_sequence_length=96", "data.prompts_per_step=2", "algorithm.group_size=2",
    "environment.num_train_tasks=16", "environment.num_eval_tasks=2", "eval.num_tasks=2",
    "eval.samples_per_task=1", "sft.steps=0", "checkpoint.resume=false", "logging.sample_trajectories=0",
    "total_steps=2",
]

USER_CONFIG = '''
"""A user's config: the demo, plus a loss of their own registered right here."""

import jax
import jax.numpy as jnp

from agentrl_jax.config import load_config
from agentrl_jax.losses import masked_mean, register_loss


@register_loss("beta_pg_test", hparams={"clip": "algorithm.eps_high"})
def beta_pg(logp, old_logp, advantages, loss_mask, *, sequence_ids=None, num_sequences=None,
            beta=1.0, clip=0.2):
    """Policy gradient with the log-ratio penalized by beta and clipped at +-clip."""
    del sequence_ids, num_sequences
    mask = loss_mask > 0
    log_ratio = jnp.clip(jnp.where(mask, logp - jax.lax.stop_gradient(old_logp), 0.0), -clip, clip)
    adv = jnp.where(mask, jax.lax.stop_gradient(advantages), 0.0)
    per_token = jnp.where(mask, -adv * logp + beta * log_ratio ** 2, 0.0)
    return per_token, {"beta": jnp.float32(beta), "clip": jnp.float32(clip),
                       "beta_pg_ratio": masked_mean(jnp.exp(log_ratio), mask)}


def get_config():
    return load_config("demo")
'''


@pytest.fixture
def user_config(tmp_path):
    path = tmp_path / "my_config.py"
    path.write_text(textwrap.dedent(USER_CONFIG))
    yield path
    registry._LOSSES.pop("beta_pg_test", None)
    registry._LOSS_HPARAMS.pop("beta_pg_test", None)


def test_custom_loss_with_its_own_hyperparameter_trains_end_to_end(user_config, tmp_path):
    out = tmp_path / "run"
    config = load_config(str(user_config), TINY + [
        f"output_dir={out}", "algorithm.loss=beta_pg_test", 'algorithm.loss_hparams=[["beta", 0.37]]',
        "algorithm.eps_high=0.3",
    ])
    train(config)
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["beta"] == pytest.approx(0.37)  # from algorithm.loss_hparams
        assert r["clip"] == pytest.approx(0.3)  # from the config field the loss declared
        assert "beta_pg_ratio" in r and r["skipped"] == 0


def test_custom_loss_hyperparameter_typo_fails_at_load(user_config):
    with pytest.raises(ConfigError, match=r"algorithm.loss_hparams: loss 'beta_pg_test' takes no \['btea'\]; "
                                          r"its keyword hyper-parameters: \['beta', 'clip'\]"):
        load_config(str(user_config), ["algorithm.loss=beta_pg_test", 'algorithm.loss_hparams=[["btea", 0.37]]'])
