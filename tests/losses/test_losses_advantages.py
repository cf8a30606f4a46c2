"""Advantage estimators: hand cases, NumPy references, permutation and NaN-freedom."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from agentrl_jax.losses import (
    drgrpo_advantages,
    gae_advantages,
    get_advantage,
    grpo_advantages,
    hybrid_advantages,
    opd_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_token_advantages,
)

NUM_GROUPS = 5


def np_group_reference(rewards, group_ids, kind, eps=1e-6):
    out = np.zeros_like(rewards)
    for g in np.unique(group_ids):
        idx = np.where(group_ids == g)[0]
        r = rewards[idx]
        if np.all(r == r[0]):
            continue
        if kind == "grpo":
            out[idx] = (r - r.mean()) / (r.std(ddof=1) + eps)
        elif kind == "drgrpo":
            out[idx] = r - r.mean()
        elif kind == "rloo":
            out[idx] = r - (r.sum() - r) / (len(r) - 1)
    return out


ESTIMATORS = {"grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages}


def test_hand_computed():
    rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 5.0, 5.0])
    group_ids = jnp.array([3, 3, 3, 3, 0, 0])  # unsorted ids, group 0 all-equal
    # group 3: mean 0.5, unbiased std sqrt(1/3)
    std = np.sqrt(1.0 / 3.0)
    np.testing.assert_allclose(
        grpo_advantages(rewards, group_ids, num_groups=4, eps=0.0),
        [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        drgrpo_advantages(rewards, group_ids, num_groups=4), [0.5, -0.5, -0.5, 0.5, 0, 0]
    )
    # RLOO: 1 - (1/3), 0 - 2/3
    np.testing.assert_allclose(
        rloo_advantages(rewards, group_ids, num_groups=4),
        [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0],
        rtol=1e-6,
    )
    # REINFORCE++: batch mean 2, population std
    r = np.asarray(rewards)
    np.testing.assert_allclose(
        reinforce_pp_advantages(rewards, group_ids, num_groups=4, eps=0.0),
        (r - r.mean()) / r.std(),
        rtol=1e-6,
    )


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_numpy_reference_float64(kind):
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24)
    rewards[rng.integers(0, 24, 5)] = 1.0
    group_ids = rng.integers(0, NUM_GROUPS, 24)
    group_ids[group_ids == 2] = 4  # an empty group id is fine
    rewards[group_ids == 1] = 0.25  # an all-equal group
    with enable_x64(True):
        fn = jax.jit(lambda r, g: ESTIMATORS[kind](r, g, num_groups=NUM_GROUPS))
        got = np.asarray(fn(jnp.asarray(rewards), jnp.asarray(group_ids)))
    np.testing.assert_allclose(got, np_group_reference(rewards, group_ids, kind), rtol=1e-6, atol=1e-9)
    assert np.all(got[group_ids == 1] == 0.0)


def test_reinforce_pp_numpy_reference_with_group_baseline():
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=16)
    group_ids = rng.integers(0, 4, 16)
    with enable_x64(True):
        got = jax.jit(
            lambda r, g: reinforce_pp_advantages(r, g, num_groups=4, group_baseline=True)
        )(jnp.asarray(rewards), jnp.asarray(group_ids))
    centered = rewards.copy()
    for g in np.unique(group_ids):
        centered[group_ids == g] -= rewards[group_ids == g].mean()
    np.testing.assert_allclose(got, (centered - centered.mean()) / (centered.std() + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_identical_rewards_give_exact_zero_and_no_nan(kind):
    # 0.1 * 3 / 3 != 0.1 in floating point: the all-equal path must not rely on that.
    rewards = jnp.full((9,), 0.1)
    group_ids = jnp.array([0, 0, 0, 1, 1, 1, 2, 2, 2])
    got = jax.jit(lambda r: ESTIMATORS[kind](r, group_ids, num_groups=3))(rewards)
    assert np.all(np.asarray(got) == 0.0)
    singleton = ESTIMATORS[kind](jnp.array([3.0]), jnp.array([0]), num_groups=1)
    assert np.asarray(singleton)[0] == 0.0
    assert np.all(np.asarray(reinforce_pp_advantages(rewards, group_ids, num_groups=3)) == 0.0)


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_permutation_within_and_across_groups(kind):
    rng = np.random.default_rng(2)
    rewards = jnp.asarray(rng.normal(size=12), jnp.float32)
    group_ids = jnp.asarray(rng.integers(0, 3, 12))
    perm = jnp.asarray(rng.permutation(12))
    fn = lambda r, g: ESTIMATORS[kind](r, g, num_groups=3)  # noqa: E731
    np.testing.assert_allclose(
        fn(rewards[perm], group_ids[perm]), fn(rewards, group_ids)[perm], rtol=1e-6, atol=1e-7
    )


def np_gae(rewards, values, mask, gamma, lam):
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = np.where(mask[b] > 0)[0]
        # credit observation-token rewards to the preceding agent token
        step_r = np.zeros(len(idx))
        for t in range(rewards.shape[1]):
            prior = idx[idx <= t]
            if len(prior):
                step_r[len(prior) - 1] += rewards[b, t]
        v = values[b, idx]
        running = 0.0
        for k in reversed(range(len(idx))):
            next_v = v[k + 1] if k + 1 < len(idx) else 0.0
            delta = step_r[k] + gamma * next_v - v[k]
            running = delta + gamma * lam * running
            adv[b, idx[k]] = running
    return adv


def test_gae_hand_computed_skips_observation_tokens():
    # prompt, a1, a2, obs, obs, a3, pad; reward 1 at a3; V = 0.5 on agent tokens.
    mask = jnp.array([[0, 1, 1, 0, 0, 1, 0]], jnp.float32)
    values = jnp.array([[9.0, 0.5, 0.5, 9.0, 9.0, 0.5, 9.0]])
    rewards = jnp.array([[0, 0, 0, 0, 0, 1.0, 0]])
    adv, returns = gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0)
    # a3: 1 - 0.5 = 0.5 ; a2: 0 + 0.5*0.5 - 0.5 + 0.5*0.5 = 0.0 ; a1: 0.25 - 0.5 + 0.5*0 = -0.25
    np.testing.assert_allclose(adv, [[0, -0.25, 0.0, 0, 0, 0.5, 0]], atol=1e-7)
    np.testing.assert_allclose(returns, [[0, 0.25, 0.5, 0, 0, 1.0, 0]], atol=1e-7)


def test_gae_numpy_reference_float64():
    rng = np.random.default_rng(3)
    mask = (rng.random((4, 11)) < 0.6).astype(np.float64)
    mask[2] = 0.0  # a row without agent tokens
    rewards = rng.normal(size=(4, 11))
    values = rng.normal(size=(4, 11))
    with enable_x64(True):
        adv, returns = jax.jit(lambda r, v, m: gae_advantages(r, v, m, gamma=0.9, lam=0.8))(
            jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask)
        )
    want = np_gae(rewards, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(returns, (want + values) * mask, rtol=1e-6, atol=1e-9)


def test_gae_inserting_observation_tokens_changes_nothing():
    rng = np.random.default_rng(4)
    agent_r, agent_v = rng.normal(size=(1, 5)), rng.normal(size=(1, 5))
    dense, _ = gae_advantages(jnp.asarray(agent_r), jnp.asarray(agent_v), jnp.ones((1, 5)), gamma=0.9, lam=0.7)
    # same 5 agent tokens with 3 observation tokens (garbage values, no reward) in between
    positions = np.array([0, 1, 4, 5, 7])
    r = np.zeros((1, 8)); v = rng.normal(size=(1, 8)) * 100; m = np.zeros((1, 8))
    r[0, positions], v[0, positions], m[0, positions] = agent_r[0], agent_v[0], 1.0
    sparse, _ = gae_advantages(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=0.9, lam=0.7)
    np.testing.assert_allclose(np.asarray(sparse)[0, positions], dense[0], rtol=1e-5, atol=1e-6)


def test_opd_and_hybrid():
    teacher = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    logp = jnp.array([[-1.5, -1.0, -3.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    np.testing.assert_allclose(opd_advantages(teacher, logp, mask), [[0.5, -1.0, 0], [0.5, 0.5, 0.5]])
    # no gradient through sg(logp)
    g = jax.grad(lambda lp: opd_advantages(teacher, lp, mask).sum())(logp)
    assert np.all(np.asarray(g) == 0.0)
    group = sequence_to_token_advantages(jnp.array([1.0, -1.0]), mask)
    got = hybrid_advantages(group, teacher, logp, mask, jnp.array([True, False]), lam=0.5)
    np.testing.assert_allclose(got, [[1.25, 0.5, 0], [-1.0, -1.0, -1.0]])


def test_registered_estimators_return_token_advantages():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0])
    group_ids = jnp.array([0, 0, 1, 1])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], jnp.float32)
    got = get_advantage("drgrpo")(rewards, group_ids, mask, num_groups=2)
    np.testing.assert_allclose(got, [[0.5, 0.5, 0], [-0.5, 0, 0], [0, 0, 0], [0, 0, 0]])
    gae = get_advantage("gae")(
        rewards, group_ids, mask, num_groups=2, values=jnp.zeros((4, 3)), gamma=1.0, lam=1.0
    )
    np.testing.assert_allclose(gae, mask * rewards[:, None])
    with pytest.raises(ValueError, match="known advantages: .*grpo"):
        get_advantage("grpoo")
