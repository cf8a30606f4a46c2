"""Decoupled PPO of "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning" (arXiv:2505.24298, sec. 5.2) is the trainer's ``old_logprobs=recompute`` with
``algorithm.correction=mis`` at token level: checked against an independent numpy implementation
of AReaL's objective through the trainer's own loss composition (``loss_from_logprobs``).

AReaL's objective, per token t of the minibatch (N loss tokens):

    u_t = pi_theta / pi_prox,   w_t = pi_prox / mu   (the behavior weight)
    J   = 1/N sum_t 1[w_t <= cap] w_t max(-A_t u_t, -A_t clip(u_t, 1 - eps_low, 1 + eps_high))

(tokens whose behavior weight exceeds ``behav_imp_weight_cap`` contribute 0 but stay in N).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from agentrl_jax.config import Config, apply_overrides
from agentrl_jax.train.build import loss_settings
from agentrl_jax.train.step import loss_from_logprobs

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 1.5


def areal_decoupled_ppo(logp, prox, behav, adv, mask, cap=CAP):
    """AReaL's decoupled PPO loss and its gradient in logp (numpy, float64)."""
    u = np.exp(logp - prox)
    w = np.exp(prox - behav)
    keep = mask & (w <= cap)
    unclipped, clipped = -adv * u, -adv * np.clip(u, 1 - EPS_LOW, 1 + EPS_HIGH)
    n = mask.sum()
    loss = np.where(keep, w * np.maximum(unclipped, clipped), 0.0).sum() / n
    # d/dlogp of max(-A u, -A clip(u)): -A u where the unclipped branch is the max (ties: both slopes agree
    # unless u sits exactly on a clip bound, which random inputs never do), else 0
    slope = np.where(unclipped >= clipped, -adv * u, 0.0)
    return loss, np.where(keep, w * slope, 0.0) / n


def _inputs(seed=0, shape=(6, 12)):
    rng = np.random.default_rng(seed)
    prox = -rng.uniform(0.1, 3.0, shape)
    logp = prox + rng.normal(0, 0.3, shape)  # the policy moved from pi_prox by a few minibatches
    behav = prox + rng.normal(0, 0.6, shape)  # stale samples: pi_prox / mu spreads past the cap
    adv = rng.normal(0, 1, shape)
    mask = rng.uniform(size=shape) < 0.8
    return logp, prox, behav, adv, mask


def _trainer_loss(correction, logp, prox, behav, adv, mask):
    config = apply_overrides(Config(), [
        f"algorithm.correction={correction}", "algorithm.correction_level=token", f"algorithm.correction_cap={CAP}",
        f"algorithm.eps_low={EPS_LOW}", f"algorithm.eps_high={EPS_HIGH}", "algorithm.entropy_coef=0",
        "algorithm.kl_coef=0", "algorithm.aggregation=token-mean", "algorithm.loss=ppo"])
    settings = loss_settings(config)

    def f32(x):
        return jnp.asarray(x, jnp.float32)

    micro = {"loss_mask": f32(mask), "advantages": f32(adv), "old_logprobs": f32(prox),
             "rollout_logprobs": f32(behav)}
    normalizer = f32(mask.sum())

    def loss(lp):
        return loss_from_logprobs(lp, jnp.zeros_like(lp), micro, normalizer, settings, None)[0]

    value, grad = jax.value_and_grad(loss)(f32(logp))
    return float(value), np.asarray(grad, np.float64)


def test_recompute_with_token_level_mis_is_areal_decoupled_ppo():
    logp, prox, behav, adv, mask = _inputs()
    assert (mask & (np.exp(prox - behav) > CAP)).any() and (mask & (np.exp(prox - behav) <= CAP)).any()
    expected, expected_grad = areal_decoupled_ppo(logp, prox, behav, adv, mask)
    value, grad = _trainer_loss("mis", logp, prox, behav, adv, mask)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-7)


def test_recompute_with_tis_differs_from_decoupled_ppo_only_where_the_behavior_weight_passes_the_cap():
    """TIS keeps those tokens at weight cap instead of dropping them; everywhere else the gradient is AReaL's."""
    logp, prox, behav, adv, mask = _inputs(seed=1)
    _, areal_grad = areal_decoupled_ppo(logp, prox, behav, adv, mask)
    _, grad = _trainer_loss("tis", logp, prox, behav, adv, mask)
    over = mask & (np.exp(prox - behav) > CAP)
    np.testing.assert_allclose(grad[~over], areal_grad[~over], rtol=1e-4, atol=1e-7)
    # on the tokens past the cap: AReaL's unclipped slope at weight CAP (0 where PPO's clip holds it)
    _, capped_grad = areal_decoupled_ppo(logp, prox, prox - np.log(CAP), adv, mask, cap=np.inf)
    np.testing.assert_allclose(grad[over], capped_grad[over], rtol=1e-4, atol=1e-7)
    assert np.abs(grad[over]).max() > 0 and np.abs(areal_grad[over]).max() == 0
