"""Off-policy corrections: TIS/MIS/icepop, decoupled loss, PPO-EWMA, log-linear proxy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from agentrl_jax.losses import (
    decoupled_loss,
    ewma_update,
    get_loss,
    icepop,
    loglinear_old_logp,
    masked_is,
    should_reset_ewma,
    truncated_is,
)


def test_token_level_hand_computed():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]]))
    mu = jnp.log(jnp.array([[0.5, 0.1, 0.4, 0.9]]))  # ratios 1, 5, 1.25, 0.555..
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    tis = truncated_is(old, mu, mask, cap=2.0)
    np.testing.assert_allclose(tis.weights, [[1.0, 2.0, 1.25, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(tis.metrics["tis_truncated_frac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(tis.loss_mask, mask)
    mis = masked_is(old, mu, mask, cap=2.0)
    np.testing.assert_allclose(mis.weights, [[1.0, 0.0, 1.25, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(mis.loss_mask, [[1.0, 0.0, 1.0, 0.0]])
    np.testing.assert_allclose(mis.metrics["mis_masked_frac"], 1 / 3, rtol=1e-6)
    ice = icepop(old, mu, mask, low=1.1, high=2.0, reweight=False)
    np.testing.assert_allclose(ice.weights, [[0.0, 0.0, 1.0, 0.0]])
    np.testing.assert_allclose(ice.metrics["icepop_masked_frac"], 2 / 3, rtol=1e-6)


def test_sequence_level_numpy_reference_float64():
    rng = np.random.default_rng(0)
    old = -rng.random((4, 6))
    mu = old + rng.normal(size=(4, 6)) * 0.3
    mask = (rng.random((4, 6)) < 0.7).astype(np.float64)
    seq_ratio = np.exp(((old - mu) * mask).sum(1, keepdims=True))
    with enable_x64(True):
        args = tuple(map(jnp.asarray, (old, mu, mask)))
        tis = jax.jit(lambda *a: truncated_is(*a, cap=1.2, level="sequence"))(*args)
        mis = jax.jit(lambda *a: masked_is(*a, cap=1.2, level="sequence"))(*args)
        ice = jax.jit(lambda *a: icepop(*a, low=0.8, high=1.2, level="sequence"))(*args)
    np.testing.assert_allclose(tis.weights, np.minimum(seq_ratio, 1.2) * mask, rtol=1e-6)
    keep = (seq_ratio <= 1.2) * mask
    np.testing.assert_allclose(mis.weights, seq_ratio * keep, rtol=1e-6)
    np.testing.assert_allclose(mis.loss_mask, keep)
    band = ((seq_ratio >= 0.8) & (seq_ratio <= 1.2)) * mask
    np.testing.assert_allclose(ice.weights, seq_ratio * band, rtol=1e-6)
    np.testing.assert_allclose(
        ice.metrics["icepop_masked_frac"], (mask * (1 - band)).sum() / mask.sum(), rtol=1e-6
    )
    token_ratio = np.exp(old - mu)
    np.testing.assert_allclose(tis.metrics["mismatch_ratio_max"], token_ratio[mask > 0].max(), rtol=1e-6)


def test_huge_discrepancy_is_finite():
    old = jnp.array([[0.0, 0.0]])
    mu = jnp.array([[-1e4, -1e4]])
    mask = jnp.ones((1, 2))
    for corr in (truncated_is(old, mu, mask, level="sequence"), masked_is(old, mu, mask)):
        assert np.all(np.isfinite(np.asarray(corr.weights)))


def test_decoupled_loss_equals_total_ratio_gradient_when_uncorrected():
    """With a cap that never binds and an unclipped PPO, grad of the decoupled loss equals
    the gradient of -(pi/mu) * A, i.e. (old/mu) * (pi/old) composes exactly."""
    rng = np.random.default_rng(1)
    logp = jnp.asarray(-rng.random((2, 5)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(size=(2, 5)) * 0.05, jnp.float32)
    mu = old + jnp.asarray(rng.normal(size=(2, 5)) * 0.05, jnp.float32)
    adv = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
    mask = jnp.ones((2, 5))

    def decoupled(lp):
        per_token, metrics, _ = decoupled_loss(
            get_loss("ppo"), lp, old, mu, adv, mask, correction="tis",
            correction_hparams=dict(cap=100.0), eps_low=0.99, eps_high=100.0,
        )
        return per_token.sum()

    total = lambda lp: jnp.sum(-jnp.exp(lp - mu) * adv)  # noqa: E731
    np.testing.assert_allclose(decoupled(logp), total(logp), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(decoupled)(logp), jax.grad(total)(logp), rtol=1e-5)


def test_decoupled_loss_masks_and_reports():
    logp = jnp.zeros((1, 3))
    old = jnp.zeros((1, 3))
    mu = jnp.array([[0.0, -5.0, 0.0]])  # old/mu = e^5 on token 1
    _, metrics, mask = decoupled_loss(
        get_loss("ppo"), logp, old, mu, jnp.ones((1, 3)), jnp.ones((1, 3)), correction="mis",
        correction_hparams=dict(cap=2.0),
    )
    np.testing.assert_allclose(mask, [[1.0, 0.0, 1.0]])
    np.testing.assert_allclose(metrics["mis_masked_frac"], 1 / 3, rtol=1e-6)
    assert "clip_frac_high" in metrics
    with pytest.raises(ValueError, match="known corrections"):
        decoupled_loss(get_loss("ppo"), logp, old, mu, logp, logp + 1, correction="is")


def test_ewma_update_decay_and_reset():
    ewma = {"w": jnp.array([0.0, 2.0]), "b": jnp.array(1.0, jnp.bfloat16)}
    params = {"w": jnp.array([1.0, 0.0]), "b": jnp.array(3.0, jnp.bfloat16)}
    step_fn = jax.jit(ewma_update, static_argnames=("reset_every",))
    out = step_fn(ewma, params, 0.75, 3, reset_every=4)
    np.testing.assert_allclose(out["w"], [0.25, 1.5])
    assert out["b"].dtype == jnp.bfloat16 and float(out["b"]) == 1.5
    out = step_fn(ewma, params, 0.75, 8, reset_every=4)  # periodic reset
    np.testing.assert_allclose(out["w"], [1.0, 0.0])
    out = step_fn(ewma, params, 0.75, 3, reset_every=0, reset=should_reset_ewma(0.4, 0.5))
    np.testing.assert_allclose(out["w"], [1.0, 0.0])  # automatic reset
    out = step_fn(ewma, params, 0.75, 3, reset_every=0, reset=should_reset_ewma(0.9, 0.5))
    np.testing.assert_allclose(out["w"], [0.25, 1.5])
    with pytest.raises(ValueError, match="decay"):
        ewma_update(ewma, params, 1.0, 0)


def test_ewma_numpy_reference_over_steps():
    rng = np.random.default_rng(2)
    thetas = rng.normal(size=(10, 3))
    ewma_np = thetas[0].copy()
    ewma = jnp.asarray(thetas[0], jnp.float32)
    for step in range(1, 10):
        ewma = ewma_update(ewma, jnp.asarray(thetas[step], jnp.float32), 0.9, step, reset_every=5)
        ewma_np = thetas[step] if step % 5 == 0 else 0.9 * ewma_np + 0.1 * thetas[step]
        np.testing.assert_allclose(ewma, ewma_np, rtol=1e-5)


def test_loglinear_old_logp_hand_and_reference():
    mu = jnp.array([[-1.0, -1.0, -1.0, -1.0]])
    logp = jnp.array([[-2.0, -2.0, -2.0, -2.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    versions = jnp.array([[9, 8, 6, 6]])  # current 10: gaps 1, 2, 4
    got = jax.jit(loglinear_old_logp)(mu, logp, mask, versions, 10)
    # alpha = 0, 1/2, 3/4
    np.testing.assert_allclose(got, [[-1.0, -1.5, -1.75, 0.0]], rtol=1e-6)
    fresh = loglinear_old_logp(mu, logp, mask, jnp.array([10]), 10)
    np.testing.assert_allclose(fresh, [[-1.0, -1.0, -1.0, 0.0]])
    g = jax.grad(lambda lp: loglinear_old_logp(mu, lp, mask, versions, 10).sum())(logp)
    assert np.all(np.asarray(g) == 0.0)
    rng = np.random.default_rng(3)
    mu_r, lp_r = -rng.random((3, 5)), -rng.random((3, 5))
    v = rng.integers(0, 7, (3, 5))
    with enable_x64(True):
        got = loglinear_old_logp(jnp.asarray(mu_r), jnp.asarray(lp_r), jnp.ones((3, 5)), jnp.asarray(v), 7)
    gap = 7 - v
    alpha = np.clip((gap - 1) / gap, 0, 1)
    np.testing.assert_allclose(got, mu_r + alpha * (lp_r - mu_r), rtol=1e-6)
