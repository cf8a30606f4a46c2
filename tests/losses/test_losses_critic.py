"""GAE over multi-turn agent masks, whitening and the critic's value loss, against float64 NumPy
references written here (token walks, independent of the compressed-steps implementation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from agentrl_jax.losses import (
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    get_advantage,
    value_positions,
    whiten_advantages,
)

# Two rows of [prompt | turn | observation | turn | observation | turn | padding] and one
# single-turn row: 1 = agent token.
MASKS = np.array([
    [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0],
    [0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
], np.float64)


def walk_gae(rewards, values, mask, gamma, lam):
    """Token-level GAE by a backward walk over the row: a reward off the agent tokens waits for
    the agent token before it; one before the first agent token is dropped."""
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        next_value, next_adv, pending = 0.0, 0.0, 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                delta = rewards[b, t] + pending + gamma * next_value - values[b, t]
                next_adv = delta + gamma * lam * next_adv
                adv[b, t], next_value, pending = next_adv, values[b, t], 0.0
            else:
                pending += rewards[b, t]
    return adv


def turn_gae(rewards, values, mask, gamma, lam):
    """Turn-level GAE: a turn's reward is the sum over its tokens and the observation after it,
    its value the one at its last agent token; every agent token of the turn gets its advantage."""
    adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        agent = mask[b] > 0
        starts = [t for t in range(len(agent)) if agent[t] and (t == 0 or not agent[t - 1])]
        ends = [t for t in range(len(agent)) if agent[t] and (t + 1 == len(agent) or not agent[t + 1])]
        bounds = starts[1:] + [len(agent)]
        r = [rewards[b, s:e].sum() for s, e in zip(starts, bounds)]
        v = [values[b, e] for e in ends]
        running = 0.0
        for k in reversed(range(len(starts))):
            next_v = v[k + 1] if k + 1 < len(starts) else 0.0
            running = r[k] + gamma * next_v - v[k] + gamma * lam * running
            adv[b, starts[k]: ends[k] + 1] = running
            ret[b, ends[k]] = running + v[k]
    return adv, ret


def _random(seed, shape=MASKS.shape):
    rng = np.random.default_rng(seed)
    return rng.normal(size=shape), rng.normal(size=shape)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_token_level_gae_matches_the_walk_with_rewards_on_observation_and_padding(gamma, lam):
    rewards, values = _random(0)  # rewards on every position: prompt, observations, padding
    with enable_x64(True):
        adv, returns = jax.jit(lambda r, v, m: gae_advantages(r, v, m, gamma=gamma, lam=lam))(
            jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(MASKS))
    want = walk_gae(rewards, values, MASKS, gamma, lam)
    np.testing.assert_allclose(adv, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(returns, (want + values) * MASKS, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.7)])
def test_turn_level_gae_matches_the_reference(gamma, lam):
    rewards, values = _random(1)
    rewards[:, :1] = 0.0  # before the first turn: no action to credit (the reference does not drop)
    with enable_x64(True):
        adv, returns = jax.jit(lambda r, v, m: gae_advantages(r, v, m, gamma=gamma, lam=lam, turn_level=True))(
            jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(MASKS))
    want_adv, want_ret = turn_gae(rewards, values, MASKS, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(returns, want_ret, rtol=1e-9, atol=1e-12)
    ends = np.asarray(value_positions(jnp.asarray(MASKS), turn_level=True))
    assert ends.sum(axis=1).tolist() == [3, 3, 1]
    np.testing.assert_array_equal(ends, want_ret != 0)


@pytest.mark.parametrize("turn_level", [False, True])
def test_values_off_the_value_positions_change_nothing(turn_level):
    rewards, values = _random(2)
    off = ~np.asarray(value_positions(jnp.asarray(MASKS), turn_level=turn_level))
    noisy = np.where(off, 1e3 * np.random.default_rng(3).normal(size=values.shape), values)
    got = [gae_advantages(jnp.asarray(rewards), jnp.asarray(v), jnp.asarray(MASKS), gamma=0.95, lam=0.9,
                          turn_level=turn_level) for v in (values, noisy)]
    for a, b in zip(*got):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_without_tool_turns_it_is_single_turn_gae():
    """One contiguous response: the textbook A_t = sum_l (gamma lam)^l delta_{t+l}, V after the end 0;
    turn level then gives every token R - V_last."""
    rewards, values = np.zeros((1, 12)), np.random.default_rng(4).normal(size=(1, 12))
    mask = np.zeros((1, 12))
    mask[0, 3:9] = 1.0
    rewards[0, 8] = 1.0
    gamma, lam = 0.97, 0.9
    v = values[0, 3:9]
    deltas = rewards[0, 3:9] + gamma * np.append(v[1:], 0.0) - v
    textbook = [sum((gamma * lam) ** i * d for i, d in enumerate(deltas[t:])) for t in range(6)]
    adv, _ = gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
    np.testing.assert_allclose(np.asarray(adv)[0, 3:9], textbook, rtol=1e-5, atol=1e-6)
    turn, _ = gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam,
                             turn_level=True)
    np.testing.assert_allclose(np.asarray(turn)[0], mask[0] * (1.0 - v[-1]), rtol=1e-5, atol=1e-6)


def test_the_registered_estimator_puts_the_outcome_on_the_last_agent_token():
    rewards = np.array([1.0, 0.0, 1.0])
    values = np.random.default_rng(5).normal(size=MASKS.shape)
    got = get_advantage("gae")(jnp.asarray(rewards), jnp.zeros(3, jnp.int32), jnp.asarray(MASKS), num_groups=1,
                               values=jnp.asarray(values), gamma=1.0, lam=0.9, turn_level=True)
    token_rewards = np.zeros_like(values)
    for b in range(3):
        token_rewards[b, np.flatnonzero(MASKS[b])[-1]] = rewards[b]
    np.testing.assert_allclose(got, turn_gae(token_rewards, values, MASKS, 1.0, 0.9)[0], rtol=1e-5, atol=1e-6)


def test_whitening_over_the_batch_agent_tokens():
    adv = np.random.default_rng(6).normal(2.0, 3.0, size=MASKS.shape)
    got = np.asarray(whiten_advantages(jnp.asarray(adv, jnp.float32), jnp.asarray(MASKS, jnp.float32)))
    on = MASKS > 0
    np.testing.assert_allclose(got[on], (adv[on] - adv[on].mean()) / adv[on].std(), rtol=1e-4, atol=1e-5)
    assert np.all(got[~on] == 0)
    assert np.all(np.asarray(whiten_advantages(jnp.ones((2, 3)), jnp.zeros((2, 3)))) == 0)


def np_value_loss(values, old, returns, mask, clip):
    unclipped = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * unclipped * mask
    clipped = (old + np.clip(values - old, -clip, clip) - returns) ** 2
    return 0.5 * np.maximum(unclipped, clipped) * mask


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_clipped_value_loss_matches_the_reference(clip):
    rng = np.random.default_rng(7)
    values, old, returns = (rng.normal(size=MASKS.shape) for _ in range(3))
    per_token, metrics = clipped_value_loss(*(jnp.asarray(x, jnp.float32) for x in (values, old, returns, MASKS)),
                                            clip=clip)
    np.testing.assert_allclose(per_token, np_value_loss(values, old, returns, MASKS, clip), rtol=1e-5, atol=1e-6)
    if clip:
        clipped = (old + np.clip(values - old, -clip, clip) - returns) ** 2 > (values - returns) ** 2
        assert float(metrics["value_clip_frac"]) == pytest.approx(clipped[MASKS > 0].mean())
        assert 0 < float(metrics["value_clip_frac"]) < 1


def test_value_clipping_stops_the_gradient_past_the_clip():
    """A value that moved past old + clip toward its return gets no gradient (the clipped term is
    the max and constant in V); one inside the clip range gets the plain regression gradient."""
    old, returns, mask = jnp.zeros((1, 2)), jnp.array([[1.0, -1.0]]), jnp.ones((1, 2))
    grad = jax.grad(lambda v: clipped_value_loss(v, old, returns, mask, clip=0.2)[0].sum())(jnp.array([[0.5, 0.1]]))
    np.testing.assert_allclose(grad, [[0.0, 0.1 + 1.0]], atol=1e-6)


def test_explained_variance():
    rng = np.random.default_rng(8)
    returns = rng.normal(size=50)
    values = returns + 0.3 * rng.normal(size=50)
    want = 1 - np.var(returns - values) / np.var(returns)
    assert float(explained_variance(jnp.asarray(values), jnp.asarray(returns))) == pytest.approx(want, rel=1e-5)
    assert float(explained_variance(jnp.asarray(values), jnp.ones(50))) == 0.0
    rounding = 1.0 + 1e-7 * rng.normal(size=50)  # all-equal returns after float32 rounding
    assert float(explained_variance(jnp.asarray(values), jnp.asarray(rounding, jnp.float32))) == 0.0
