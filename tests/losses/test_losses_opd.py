"""Hindsight OPD shaping (docs/hybrid.md): centering, clipping, lambda schedule, diagnostics.

Hand-computed cases, a float64 NumPy reference on random ragged inputs, packed == unpacked,
and the reduction to ``hybrid_advantages`` when no shaping is asked for; all under jax.jit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from agentrl_jax.losses import (
    center_per_sequence,
    clip_per_token,
    hindsight_advantages,
    hybrid_advantages,
    opd_lambda,
    opd_term_diagnostics,
    shaped_opd_term,
)


def np_shaped(teacher, logp, mask, has_teacher, *, center, clip):
    """Independent reference: row by row, loops over the loss tokens."""
    out = np.zeros_like(teacher)
    for b in range(teacher.shape[0]):
        idx = np.nonzero(mask[b] > 0)[0]
        if not has_teacher[b] or len(idx) == 0:
            continue
        d = teacher[b, idx] - logp[b, idx]
        if center:
            d = d - d.mean()
        if clip > 0:
            d = np.minimum(np.maximum(d, -clip), clip)
        out[b, idx] = d
    return out


def random_batch(rng, rows=6, width=11, dtype=np.float64):
    teacher = rng.normal(-2.0, 1.5, (rows, width)).astype(dtype)
    logp = rng.normal(-1.0, 1.0, (rows, width)).astype(dtype)
    mask = np.zeros((rows, width), dtype)
    for b in range(rows):  # ragged: a prompt, sampled tokens, an observation hole, padding
        start, stop = rng.integers(0, 3), rng.integers(5, width + 1)
        mask[b, start:stop] = 1.0
        mask[b, rng.integers(start, stop)] = 0.0
    mask[-1] = 0.0  # one row without loss tokens
    has_teacher = rng.random(rows) < 0.7
    has_teacher[0], has_teacher[1] = True, False
    return teacher, logp, mask, has_teacher


def test_center_and_clip_by_hand():
    values = jnp.array([[-3.0, -1.0, 5.0, 9.0], [2.0, 2.0, 2.0, 0.0]])
    mask = jnp.array([[1, 1, 0, 1], [1, 1, 1, 0]], jnp.float32)
    # row 0: mean of (-3, -1, 9) = 5/3; row 1: all equal -> exactly 0
    np.testing.assert_allclose(center_per_sequence(values, mask),
                               [[-3 - 5 / 3, -1 - 5 / 3, 0, 9 - 5 / 3], [0, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(clip_per_token(values, mask, bound=2.0), [[-2, -1, 0, 2], [2, 2, 2, 0]])
    with pytest.raises(ValueError, match="bound must be > 0"):
        clip_per_token(values, mask, bound=0.0)


def test_uniform_offset_from_the_hint_cancels_under_centering():
    """docs/hybrid.md's collapse: a hint lowering every teacher logprob by c gives d = -c
    everywhere; centered, that trajectory gets no OPD push at all, only A_group."""
    logp = jnp.array([[-0.5, -1.0, -2.0, -0.1]])
    mask = jnp.ones((1, 4))
    group = jnp.full((1, 4), -0.7)
    teacher = logp - 1.2
    raw = hindsight_advantages(group, teacher, logp, mask, jnp.array([True]), lam=1.0)
    centered = hindsight_advantages(group, teacher, logp, mask, jnp.array([True]), lam=1.0, center=True)
    np.testing.assert_allclose(raw, np.full((1, 4), -1.9), rtol=1e-6)
    np.testing.assert_allclose(centered, group, atol=1e-6)
    # one wrong token on top of the offset: centered, it alone stays clearly negative
    wrong = teacher.at[0, 1].add(-4.0)
    term = shaped_opd_term(wrong, logp, mask, jnp.array([True]), center=True)
    np.testing.assert_allclose(term, [[1.0, -3.0, 1.0, 1.0]], atol=1e-6)


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("clip", [0.0, 0.8])
def test_numpy_reference_float64_under_jit(center, clip):
    rng = np.random.default_rng(int(center) * 10 + int(clip * 10))
    teacher, logp, mask, has_teacher = random_batch(rng)
    with enable_x64():
        fn = jax.jit(functools.partial(shaped_opd_term, center=center, clip=clip))
        got = np.asarray(fn(jnp.asarray(teacher), jnp.asarray(logp), jnp.asarray(mask), jnp.asarray(has_teacher)))
    want = np_shaped(teacher, logp, mask, has_teacher, center=center, clip=clip)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.all(got[~has_teacher] == 0.0) and np.all(got[mask == 0] == 0.0)
    if clip:
        assert np.abs(got).max() <= clip
    if center and not clip:  # centered: every taught sequence's term sums to 0
        sums = (got * mask).sum(axis=1)
        np.testing.assert_allclose(sums, 0.0, atol=1e-10)


def test_without_shaping_equals_hybrid_advantages_exactly():
    rng = np.random.default_rng(3)
    teacher, logp, mask, has_teacher = (jnp.asarray(x) for x in random_batch(rng, dtype=np.float32))
    group = jnp.asarray(rng.normal(size=mask.shape), jnp.float32) * mask
    got = hindsight_advantages(group, teacher, logp, mask, has_teacher, lam=0.3)
    want = hybrid_advantages(group, teacher, logp, mask, has_teacher, lam=0.3)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_no_gradient_flows_into_the_old_logprobs():
    rng = np.random.default_rng(4)
    teacher, logp, mask, has_teacher = (jnp.asarray(x) for x in random_batch(rng, dtype=np.float32))
    g = jax.grad(lambda lp: shaped_opd_term(teacher, lp, mask, has_teacher, center=True, clip=1.0).sum())(logp)
    assert np.all(np.asarray(g) == 0.0)


def pack(arrays, lengths, width):
    """Concatenate the loss-token spans of rows into packed rows of `width` (first fit)."""
    rows, ids, current, current_ids = [], [], [[] for _ in arrays], []
    for seq, n in enumerate(lengths):
        if len(current_ids) + n > width:
            rows.append(current)
            ids.append(current_ids)
            current, current_ids = [[] for _ in arrays], []
        for k, a in enumerate(arrays):
            current[k] += list(a[seq, :n])
        current_ids += [seq] * n
    rows.append(current)
    ids.append(current_ids)
    out = []
    for k in range(len(arrays)):
        out.append(np.array([r[k] + [0.0] * (width - len(r[k])) for r in rows], np.float32))
    seq_ids = np.array([i + [0] * (width - len(i)) for i in ids], np.int32)
    return out, seq_ids


@pytest.mark.parametrize("center", [False, True])
def test_packed_rows_equal_unpacked(center):
    rng = np.random.default_rng(5)
    rows, width = 5, 7
    lengths = [7, 3, 5, 2, 6]
    teacher = rng.normal(-2, 1, (rows, width)).astype(np.float32)
    logp = rng.normal(-1, 1, (rows, width)).astype(np.float32)
    mask = np.zeros((rows, width), np.float32)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1.0
    mask[2, 1] = 0.0  # an observation token inside a response
    has_teacher = np.array([True, False, True, True, False])
    unpacked = shaped_opd_term(*(jnp.asarray(x) for x in (teacher, logp, mask, has_teacher)), center=center, clip=1.5)
    (p_teacher, p_logp, p_mask), seq_ids = pack([teacher, logp, mask], lengths, width=12)
    packed = jax.jit(functools.partial(shaped_opd_term, center=center, clip=1.5, num_sequences=rows))(
        jnp.asarray(p_teacher), jnp.asarray(p_logp), jnp.asarray(p_mask), jnp.asarray(has_teacher),
        sequence_ids=jnp.asarray(seq_ids))
    (repacked,), _ = pack([np.asarray(unpacked)], lengths, width=12)
    np.testing.assert_allclose(np.asarray(packed), repacked, rtol=1e-6, atol=1e-6)
    diag_u = opd_term_diagnostics(unpacked, jnp.asarray(mask), jnp.asarray(has_teacher))
    diag_p = opd_term_diagnostics(packed, jnp.asarray(p_mask), jnp.asarray(has_teacher),
                                  sequence_ids=jnp.asarray(seq_ids), num_sequences=rows)
    for key in diag_u:
        np.testing.assert_allclose(float(diag_p[key]), float(diag_u[key]), rtol=1e-6, atol=1e-6)


def test_lambda_schedules_by_hand_and_traced():
    assert float(opd_lambda(7, lam=0.3)) == pytest.approx(0.3)
    warm = [float(opd_lambda(s, lam=1.0, schedule="linear_warmup", warmup_steps=4)) for s in (0, 2, 4, 9)]
    assert warm == pytest.approx([0.0, 0.5, 1.0, 1.0])
    decay = [float(opd_lambda(s, lam=1.0, schedule="linear_decay", decay_steps=10, final_lam=0.2)) for s in (0, 5, 20)]
    assert decay == pytest.approx([1.0, 0.6, 0.2])
    cosine = [float(opd_lambda(s, lam=1.0, schedule="cosine_decay", decay_steps=10, final_lam=0.0)) for s in (0, 5, 10)]
    assert cosine == pytest.approx([1.0, 0.5, 0.0], abs=1e-6)
    traced = jax.jit(functools.partial(opd_lambda, lam=1.0, schedule="linear_warmup", warmup_steps=4))
    assert float(traced(jnp.int32(2))) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="schedule must be one of"):
        opd_lambda(0, lam=1.0, schedule="step")
    with pytest.raises(ValueError, match="ramp length"):
        opd_lambda(0, lam=1.0, schedule="linear_decay")


def test_diagnostics_by_hand():
    term = jnp.array([[0.1, -3.0, 0.05, 0.0], [-0.2, 0.3, 0.0, 0.0], [-9.0, -9.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]], jnp.float32)
    has_teacher = jnp.array([True, True, False])
    d = jax.jit(opd_term_diagnostics)(term, mask, has_teacher)
    assert float(d["sequences"]) == 2.0
    assert float(d["mean"]) == pytest.approx((0.1 - 3.0 + 0.05 - 0.2 + 0.3) / 5)
    assert float(d["min_token"]) == pytest.approx((-3.0 - 0.2) / 2)
    assert float(d["near_zero_fraction"]) == pytest.approx(3 / 5)
    empty = opd_term_diagnostics(term, mask, jnp.array([False, False, False]))
    assert all(float(v) == 0.0 for v in empty.values())
