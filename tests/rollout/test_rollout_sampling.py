"""Sampling: hand values, NumPy references for the truncated distributions, invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import SamplingParams, SlotSampling, request_key, sample, step_keys

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

_sample = jax.jit(sample)


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _np_kept_set(z, tau, k, p):
    """Reference top-k then top-p set (indices) for one row, float64."""
    scaled = np.asarray(z, np.float64) / tau
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(len(z), bool)
    k = len(z) if k == 0 else k
    topk = order[:k]
    probs = np.exp(_np_log_softmax(scaled[topk]))
    mass = 0.0
    for idx, pr in zip(topk, probs):
        if mass >= p:
            break
        keep[idx] = True
        mass += pr
    return keep


def _rows(params_list):
    return SlotSampling(
        temperature=jnp.array([p.temperature for p in params_list], jnp.float32),
        top_k=jnp.array([p.top_k for p in params_list], jnp.int32),
        top_p=jnp.array([p.top_p for p in params_list], jnp.float32),
    )


def _keys(n, seed=0):
    return jnp.stack([request_key(seed, i) for i in range(n)])


def test_greedy_hand_values():
    logits = jnp.array([[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]], jnp.float32)
    tokens, logp, trunc = _sample(logits, _keys(2), _rows([SamplingParams(temperature=0.0)] * 2))
    np.testing.assert_array_equal(tokens, [1, 0])
    expected = _np_log_softmax(np.asarray(logits))[[0, 1], [1, 0]]
    np.testing.assert_allclose(logp, expected, rtol=1e-6)
    np.testing.assert_array_equal(trunc, [0.0, 0.0])


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_full_logprob_is_tempered_log_softmax(tau):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    tokens, logp, trunc = _sample(jnp.asarray(logits), _keys(6), _rows([SamplingParams(temperature=tau)] * 6))
    ref = _np_log_softmax(logits / np.float32(tau))[np.arange(6), np.asarray(tokens)]
    np.testing.assert_allclose(logp, ref, atol=1e-5)
    np.testing.assert_allclose(trunc, logp)


def test_top_k_one_is_argmax_with_zero_truncated_logprob():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 30)), jnp.float32)
    tokens, logp, trunc = _sample(logits, _keys(4), _rows([SamplingParams(temperature=1.3, top_k=1)] * 4))
    np.testing.assert_array_equal(tokens, np.argmax(np.asarray(logits), -1))
    np.testing.assert_allclose(trunc, 0.0, atol=1e-6)
    ref = _np_log_softmax(np.asarray(logits) / 1.3)[np.arange(4), np.asarray(tokens)]
    np.testing.assert_allclose(logp, ref, atol=1e-5)


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.6), (8, 0.8)])
def test_truncated_sampling_matches_numpy_reference(k, p):
    rng = np.random.default_rng(2)
    z = rng.normal(size=(20,)).astype(np.float32) * 2
    tau = 0.9
    n = 4000
    logits = jnp.asarray(np.broadcast_to(z, (n, 20)))
    keys = step_keys(jnp.broadcast_to(request_key(7), (n, 2)), jnp.arange(n))
    tokens, logp, trunc = _sample(logits, keys, _rows([SamplingParams(temperature=tau, top_k=k, top_p=p)] * n))
    tokens = np.asarray(tokens)
    keep = _np_kept_set(z, tau, k, p)
    assert keep[tokens].all(), "sampled a token outside the top-k/top-p set"
    kept_lp = _np_log_softmax(np.where(keep, z / tau, -np.inf))
    np.testing.assert_allclose(trunc, kept_lp[tokens], atol=1e-5)
    np.testing.assert_allclose(logp, _np_log_softmax(z / tau)[tokens], atol=1e-5)
    freq = np.bincount(tokens, minlength=20) / n
    np.testing.assert_allclose(freq, np.exp(kept_lp), atol=0.03)


def test_plain_sampling_frequencies_follow_tempered_softmax():
    z = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
    n = 4000
    keys = step_keys(jnp.broadcast_to(request_key(3), (n, 2)), jnp.arange(n))
    tokens, _, _ = _sample(jnp.asarray(np.broadcast_to(z, (n, 4))), keys, _rows([SamplingParams(0.7)] * n))
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    np.testing.assert_allclose(freq, np.exp(_np_log_softmax(z / 0.7)), atol=0.03)


def test_row_result_independent_of_other_rows_sampler():
    """A plain row draws the same token whether or not a neighbour forces the sorted path."""
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(2, 64)), jnp.float32)
    keys = _keys(2, seed=11)
    alone = _sample(logits, keys, _rows([SamplingParams(1.0), SamplingParams(1.0)]))
    mixed = _sample(logits, keys, _rows([SamplingParams(1.0), SamplingParams(1.0, top_k=3, top_p=0.5)]))
    assert int(alone[0][0]) == int(mixed[0][0])
    np.testing.assert_allclose(alone[1][0], mixed[1][0])


def test_the_plain_program_equals_the_truncating_one_on_rows_that_do_not_truncate():
    """`sample(truncation=False)` (no sort compiled) gives the same tokens and logprobs as the
    program with the top-k / top-p path, for greedy and plain temperature rows; `truncates` says
    which rows need the latter."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(4, 300)) * 3, jnp.float32)
    rows = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7), SamplingParams(0.0, top_k=5)]
    assert not any(p.truncates for p in rows) and SamplingParams(1.0, top_p=0.9).truncates
    plain = jax.jit(lambda *a: sample(*a, truncation=False))(logits, _keys(4, seed=3), _rows(rows))
    sorting = jax.jit(lambda *a: sample(*a, truncation=True))(logits, _keys(4, seed=3), _rows(rows))
    for a, b in zip(plain, sorting):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sampling_params_validation_names_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)


def test_result_tokens_packed_layout():
    tokens = jnp.array([[5, 6, 7], [8, 9, 10]])
    valid = jnp.array([[1, 0, 1], [1, 1, 0]])
    lengths = jnp.array([[1, 0, 3], [2, 1, 0]])
    lp = -jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    result = ResultTokens.pack(tokens, valid, lengths, lp, lp * 2).convert_to_numpy()
    assert result.data.shape == (2, 3, 3)
    slot2 = result.get_result_at_slot(2)
    np.testing.assert_array_equal(slot2.tokens[:, 0, 0], [7, 10])
    np.testing.assert_array_equal(slot2.valid[:, 0, 0], [1, 0])
    np.testing.assert_array_equal(slot2.lengths[:, 0], [3, 0])
    np.testing.assert_array_equal(slot2.log_prob[:, 0], [-2, -5])
    np.testing.assert_array_equal(result.tokens, tokens)
    leaves = jax.tree.leaves(result)
    assert len(leaves) == 3  # data, log_prob, truncated_log_prob are the pytree leaves
