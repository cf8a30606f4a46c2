"""Policy losses and KL: hand cases, NumPy references, masking invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from agentrl_jax.losses import (
    cispo_loss,
    entropy_bonus,
    get_loss,
    gspo_loss,
    gspo_token_loss,
    kl_estimate,
    kl_loss,
    kl_reward_penalty,
    ppo_clip_loss,
    reinforce_loss,
)

LOSSES = ["ppo", "gspo", "gspo_token", "cispo", "reinforce"]
# Wide clip ranges so random ratios leave gradients to check (GSPO's defaults are 3e-4).
WIDE = {"ppo": dict(eps_low=0.9, eps_high=10.0), "gspo": dict(eps_low=0.9, eps_high=10.0),
        "gspo_token": dict(eps_low=0.9, eps_high=10.0), "cispo": {}, "reinforce": {}}


def np_ppo(logp, old, adv, mask, eps_low, eps_high, dual_clip=None):
    r = np.exp(logp - old)
    loss = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual_clip * adv), loss)
    return loss * mask


def np_gspo(logp, old, adv, mask, eps_low, eps_high):
    n = mask.sum(1, keepdims=True)
    s = np.exp((mask * (logp - old)).sum(1, keepdims=True) / n)
    a = (mask * adv).sum(1, keepdims=True) / n
    loss = np.maximum(-a * s, -a * np.clip(s, 1 - eps_low, 1 + eps_high))
    return np.broadcast_to(loss, logp.shape) * mask


def np_cispo(logp, old, adv, mask, eps_max):
    return -np.minimum(np.exp(logp - old), eps_max) * adv * logp * mask


def _random_batch(rng, shape=(3, 6), scale=0.3):
    logp = -rng.random(shape) * 3
    old = logp + rng.normal(size=shape) * scale
    adv = rng.normal(size=shape)
    mask = (rng.random(shape) < 0.7).astype(np.float64)
    mask[:, 0] = 1.0
    return logp, old, adv, mask


def test_ppo_hand_computed():
    logp = jnp.log(jnp.array([[1.5, 0.5, 1.1, 4.0]]))
    old = jnp.zeros((1, 4))
    adv = jnp.array([[1.0, -1.0, 2.0, -1.0]])
    mask = jnp.ones((1, 4))
    loss, m = ppo_clip_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    # r=1.5,A=1 -> -1.28 ; r=0.5,A=-1 -> max(0.5, 0.8)=0.8 ; r=1.1,A=2 -> -2.2 ; r=4,A=-1 -> min(4, 3)=3
    np.testing.assert_allclose(loss, [[-1.28, 0.8, -2.2, 3.0]], rtol=1e-6)
    np.testing.assert_allclose(m["clip_frac_high"], 0.25)
    np.testing.assert_allclose(m["clip_frac_low"], 0.25)
    np.testing.assert_allclose(m["dual_clip_frac"], 0.25)
    np.testing.assert_allclose(m["ratio_max"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(m["num_loss_tokens"], 4.0)


def test_gspo_and_cispo_and_reinforce_hand_computed():
    # one sequence, log ratios (0.2, -0.1, [masked 5.0]) -> s = exp(0.05)
    logp = jnp.array([[0.2 - 1.0, -0.1 - 1.0, 4.0]])
    old = jnp.array([[-1.0, -1.0, -1.0]])
    adv = jnp.array([[2.0, 2.0, 7.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    loss, _ = gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(loss, [[-2 * np.exp(0.05), -2 * np.exp(0.05), 0.0]], rtol=1e-6)
    loss, _ = gspo_loss(logp, old, adv, mask, eps_low=0.01, eps_high=0.01)
    np.testing.assert_allclose(loss, [[-2.02, -2.02, 0.0]], rtol=1e-6)
    loss, m = cispo_loss(logp, old, adv, mask, eps_max=1.1)
    np.testing.assert_allclose(
        loss, [[-1.1 * 2 * -0.8, -np.exp(-0.1) * 2 * -1.1, 0.0]], rtol=1e-6
    )
    np.testing.assert_allclose(m["clip_frac_high"], 0.5)
    loss, _ = reinforce_loss(logp, old, adv, mask)
    np.testing.assert_allclose(loss, [[1.6, 2.2, 0.0]], rtol=1e-6)


@pytest.mark.parametrize(
    "name,ref,hp",
    [
        ("ppo", np_ppo, dict(eps_low=0.2, eps_high=0.28)),
        ("ppo", np_ppo, dict(eps_low=0.1, eps_high=0.3, dual_clip=2.0)),
        ("gspo", np_gspo, dict(eps_low=0.05, eps_high=0.06)),
        ("cispo", np_cispo, dict(eps_max=1.2)),
        ("reinforce", lambda lp, o, a, m: -a * lp * m, {}),
    ],
)
def test_numpy_reference_float64(name, ref, hp):
    logp, old, adv, mask = _random_batch(np.random.default_rng(0))
    with enable_x64(True):
        fn = jax.jit(lambda *xs: get_loss(name)(*xs, **hp)[0])
        got = fn(*map(jnp.asarray, (logp, old, adv, mask)))
    np.testing.assert_allclose(got, ref(logp, old, adv, mask, **hp), rtol=1e-6, atol=1e-12)


def test_gspo_token_equals_gspo_for_sequence_advantages():
    logp, old, adv, mask = map(jnp.asarray, _random_batch(np.random.default_rng(1), scale=0.01))
    adv = jnp.broadcast_to(adv[:, :1], adv.shape) * mask
    per_seq = lambda loss: jnp.sum(loss.sum(1) / mask.sum(1))  # noqa: E731
    f_seq = lambda lp: per_seq(gspo_loss(lp, old, adv, mask)[0])  # noqa: E731
    f_tok = lambda lp: per_seq(gspo_token_loss(lp, old, adv, mask)[0])  # noqa: E731
    np.testing.assert_allclose(f_seq(logp), f_tok(logp), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f_seq)(logp), jax.grad(f_tok)(logp), rtol=1e-5, atol=1e-7)


def _logits_objective(name, targets, old, adv, mask):
    def f(logits):
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
        loss, _ = get_loss(name)(logp, old, adv, mask, **WIDE[name])
        return jnp.sum(loss)

    return jax.jit(jax.grad(f))


@pytest.mark.parametrize("name", LOSSES)
def test_gradient_wrt_logits_is_exactly_zero_at_masked_positions(name):
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 7, (2, 5)))
    _, old, adv, mask = map(lambda x: jnp.asarray(x, jnp.float32), _random_batch(rng, (2, 5)))
    # padding holds garbage: huge old logprobs and NaN advantages must not leak
    old = jnp.where(mask > 0, old, 1e4)
    adv = jnp.where(mask > 0, adv, jnp.nan)
    grad = _logits_objective(name, targets, old, adv, mask)(logits)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[np.asarray(mask) == 0] == 0.0)
    assert np.any(np.asarray(grad)[np.asarray(mask) > 0] != 0.0)


@pytest.mark.parametrize("name", LOSSES)
def test_padding_changes_nothing_including_gradients(name):
    logp, old, adv, mask = map(jnp.asarray, _random_batch(np.random.default_rng(3)))
    pad = lambda x, v: jnp.concatenate([x, jnp.full((x.shape[0], 4), v, x.dtype)], 1)  # noqa: E731
    fn = lambda *xs: get_loss(name)(*xs, **WIDE[name])  # noqa: E731
    f = lambda lp, o, a, m: jnp.sum(fn(lp, o, a, m)[0])  # noqa: E731
    value, grad = jax.value_and_grad(f)(logp, old, adv, mask)
    value_p, grad_p = jax.value_and_grad(f)(pad(logp, -50.0), pad(old, 3.0), pad(adv, 9.0), pad(mask, 0.0))
    np.testing.assert_allclose(value_p, value, rtol=1e-6)
    np.testing.assert_allclose(grad_p[:, :6], grad, rtol=1e-6)
    assert np.all(np.asarray(grad_p[:, 6:]) == 0.0)
    _, metrics = fn(logp, old, adv, mask)
    _, metrics_p = fn(pad(logp, -50.0), pad(old, 3.0), pad(adv, 9.0), pad(mask, 0.0))
    for key in metrics:
        np.testing.assert_allclose(metrics_p[key], metrics[key], rtol=1e-6, err_msg=key)


def test_bad_hyperparameters_fail_with_the_name():
    x = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(x, x, x, x + 1, dual_clip=0.5)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(x, x, x, x + 1, eps_low=1.5)
    with pytest.raises(TypeError, match="eps_lo"):
        get_loss("ppo")(x, x, x, x + 1, eps_lo=0.2)


def test_kl_estimators_hand_and_reference():
    logp = jnp.array([[np.log(0.5), np.log(0.2), 0.0]])
    ref = jnp.array([[np.log(0.25), np.log(0.4), 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    d = np.log([0.5, 2.0])
    np.testing.assert_allclose(kl_estimate(logp, ref, mask, kind="k1")[0, :2], -d, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, mask, kind="k2")[0, :2], 0.5 * d**2, rtol=1e-6)
    np.testing.assert_allclose(
        kl_estimate(logp, ref, mask, kind="k3")[0, :2], np.exp(d) - d - 1, rtol=1e-6
    )
    # k3 gradient: d/dlogp [exp(ref-logp) - (ref-logp) - 1] = 1 - exp(ref - logp)
    term, metrics = kl_loss(logp, ref, mask, coef=0.1, kind="k3")
    g = jax.grad(lambda lp: kl_loss(lp, ref, mask, coef=0.1)[0].sum())(logp)
    np.testing.assert_allclose(g[0, :2], 0.1 * (1 - np.exp(d)), rtol=1e-6)
    assert g[0, 2] == 0.0
    np.testing.assert_allclose(metrics["kl_k3"], np.mean(np.exp(d) - d - 1), rtol=1e-6)
    penalty = kl_reward_penalty(logp, ref, mask, coef=0.5, kind="k1")
    np.testing.assert_allclose(penalty[0, :2], 0.5 * d, rtol=1e-6)
    assert np.all(np.asarray(jax.grad(lambda lp: kl_reward_penalty(lp, ref, mask, coef=1.0).sum())(logp)) == 0)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, mask, kind="k4")


def test_kl_numpy_reference_float64():
    rng = np.random.default_rng(5)
    logp, ref, _, mask = _random_batch(rng)
    d = ref - logp
    refs = {"k1": -d, "k2": 0.5 * d**2, "k3": np.exp(d) - d - 1}
    with enable_x64(True):
        for kind, want in refs.items():
            got = jax.jit(lambda a, b, m: kl_estimate(a, b, m, kind=kind))(
                jnp.asarray(logp), jnp.asarray(ref), jnp.asarray(mask)
            )
            np.testing.assert_allclose(got, want * mask, rtol=1e-6, atol=1e-12)


def test_entropy_bonus():
    entropy = jnp.array([[1.0, 2.0, 100.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    term, metrics = entropy_bonus(entropy, mask, coef=0.01)
    np.testing.assert_allclose(term, [[-0.01, -0.02, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(metrics["entropy"], 1.5)
