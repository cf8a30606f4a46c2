"""Aggregation: NumPy reference, micro-batch == full batch, packed == unpacked.

The exactness tests run the trainer's own loss composition (`train.step.loss_from_logprobs`:
registered loss, off-policy correction, KL, entropy, aggregation), the one the update uses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from agentrl_jax.losses import AGGREGATIONS, aggregate, global_normalizer
from agentrl_jax.train.step import LossSettings, loss_from_logprobs

MAX_LEN = 16


def trainer_loss(name, logp, old, adv, mask, *, aggregation="token-mean", normalizer, rollout=None,
                 sequence_ids=None, num_sequences=None, entropy=None, ref=None, hparams=None, **settings):
    """The trainer's scalar loss and metrics of one micro-batch, from arrays."""
    settings = LossSettings(loss=name, hparams=tuple(sorted((hparams or {}).items())), aggregation=aggregation,
                            packed=sequence_ids is not None, **settings)
    micro = dict(loss_mask=mask, old_logprobs=old, advantages=adv,
                 rollout_logprobs=old if rollout is None else rollout)
    if sequence_ids is not None:
        micro["sequence_ids"] = sequence_ids
    if ref is not None:
        micro["ref_logprobs"] = ref
    entropy = jnp.zeros_like(logp) if entropy is None else entropy
    return loss_from_logprobs(logp, entropy, micro, normalizer, settings, num_sequences)


def np_aggregate(loss, mask, mode):
    per_seq_sum = (loss * mask).sum(1)
    n = mask.sum(1)
    nonempty = n > 0
    if mode == "token-mean":
        return per_seq_sum.sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return (per_seq_sum[nonempty] / n[nonempty]).sum() / nonempty.sum()
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / nonempty.sum()
    return per_seq_sum.sum() / (nonempty.sum() * MAX_LEN)


def _batch(rng, batch=8, seq_len=6):
    logp = -rng.random((batch, seq_len)) * 2
    old = logp + rng.normal(size=(batch, seq_len)) * 0.2
    adv = rng.normal(size=(batch, 1)) * np.ones((1, seq_len))
    mask = (rng.random((batch, seq_len)) < 0.6).astype(np.float64)
    mask[3] = 0.0  # a sequence without loss tokens
    return logp, old, adv, mask


def test_hand_computed():
    loss = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    expect = {"token-mean": 10 / 4, "seq-mean-token-mean": (2 + 4) / 2,
              "seq-mean-token-sum": 10 / 2, "seq-mean-token-sum-norm": 10 / (2 * 5)}
    for mode, want in expect.items():
        z = global_normalizer(mask, mode, max_response_length=5)
        np.testing.assert_allclose(aggregate(loss, mask, mode, z), want, rtol=1e-6, err_msg=mode)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_numpy_reference_float64(mode):
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(8, 6))
    _, _, _, mask = _batch(rng)
    with enable_x64(True):
        got = jax.jit(
            lambda l, m: aggregate(l, m, mode, global_normalizer(m, mode, max_response_length=MAX_LEN))
        )(jnp.asarray(loss), jnp.asarray(mask))
    np.testing.assert_allclose(got, np_aggregate(loss, mask, mode), rtol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("name, correction", [("ppo", "none"), ("gspo", "none"), ("cispo", "icepop")])
def test_micro_batched_gradient_equals_full_batch(mode, name, correction):
    """Uneven micro-batches sharing the minibatch normalizer sum to the full batch's loss and
    gradient, with the KL and entropy terms and an off-policy correction on."""
    rng = np.random.default_rng(1)
    logp, old, adv, mask = map(lambda x: jnp.asarray(x, jnp.float32), _batch(rng))
    rollout = old + jnp.asarray(rng.normal(size=old.shape) * 0.1, jnp.float32)
    ref = old - 0.3
    entropy = jnp.asarray(rng.random(old.shape), jnp.float32)
    hp = dict(eps_low=0.1, eps_high=0.15) if name != "cispo" else dict(eps_max=1.2)
    correction_hparams = (("high", 1.5), ("level", "token"), ("low", 0.7)) if correction != "none" else ()
    z = global_normalizer(mask, mode, max_response_length=MAX_LEN)

    @jax.jit
    def loss_and_grad(lp, o, a, m, r, ref, h, z):
        f = lambda lp: trainer_loss(  # noqa: E731
            name, lp, o, a, m, aggregation=mode, normalizer=z, rollout=r, ref=ref, entropy=h, hparams=hp,
            kl_coef=0.05, entropy_coef=0.01, correction=correction, correction_hparams=correction_hparams,
        )[0]
        return jax.value_and_grad(f)(lp)

    arrays = (logp, old, adv, mask, rollout, ref, entropy)
    full_loss, full_grad = loss_and_grad(*arrays, z)
    micro_loss, micro_grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):  # uneven micro-batches
        l, g = loss_and_grad(*(x[rows] for x in arrays), z)
        micro_loss += l
        micro_grads.append(g)
    assert float(full_loss) != 0.0
    np.testing.assert_allclose(micro_loss, full_loss, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jnp.concatenate(micro_grads), full_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("name", ["ppo", "gspo", "gspo_token", "cispo", "reinforce"])
def test_packed_equals_unpacked(mode, name):
    """4 sequences of lengths 3, 5, 2, 4 padded to 5 == packed into 2 rows of 8."""
    rng = np.random.default_rng(2)
    lengths = [3, 5, 2, 4]
    seqs = [(-rng.random(n), rng.normal(size=n) * 0.1, np.full(n, rng.normal())) for n in lengths]
    hp = dict(eps_low=0.05, eps_high=0.08) if name in ("ppo", "gspo", "gspo_token") else {}

    unpacked = np.zeros((3, 4, 5))
    mask_u = np.zeros((4, 5))
    for i, (lp, noise, a) in enumerate(seqs):
        n = len(lp)
        unpacked[:, i, :n] = lp, lp + noise, a
        mask_u[i, :n] = 1
    rows = [[0, 1], [2, 3]]  # sequence 0+1 in row 0 (8 tokens), 2+3 in row 1 (6 + 2 pad)
    packed = np.zeros((3, 2, 8))
    mask_p = np.zeros((2, 8))
    ids_p = np.zeros((2, 8), np.int32)
    for r, members in enumerate(rows):
        pos = 0
        for i in members:
            lp, noise, a = seqs[i]
            n = len(lp)
            packed[:, r, pos : pos + n] = lp, lp + noise, a
            mask_p[r, pos : pos + n] = 1
            ids_p[r, pos : pos + n] = i
            pos += n

    def loss_and_grad(x, mask, ids):
        z = global_normalizer(mask, mode, sequence_ids=ids, num_sequences=4, max_response_length=MAX_LEN)
        f = lambda lp: trainer_loss(  # noqa: E731
            name, lp, x[1], x[2], mask, aggregation=mode, normalizer=z,
            sequence_ids=ids, num_sequences=4 if ids is not None else None, hparams=hp,
        )[0]
        return jax.value_and_grad(f)(x[0])

    lu, gu = loss_and_grad(jnp.asarray(unpacked, jnp.float32), jnp.asarray(mask_u, jnp.float32), None)
    lp_, gp = loss_and_grad(jnp.asarray(packed, jnp.float32), jnp.asarray(mask_p, jnp.float32), jnp.asarray(ids_p))
    np.testing.assert_allclose(lp_, lu, rtol=1e-6)
    gp = np.asarray(gp)
    for r, members in enumerate(rows):
        pos = 0
        for i in members:
            n = lengths[i]
            np.testing.assert_allclose(gp[r, pos : pos + n], np.asarray(gu)[i, :n], rtol=1e-5, atol=1e-8)
            pos += n


def test_unknown_mode_and_missing_constant():
    mask = jnp.ones((1, 2))
    with pytest.raises(ValueError, match="known aggregations"):
        global_normalizer(mask, "mean")
    with pytest.raises(ValueError, match="max_response_length"):
        global_normalizer(mask, "seq-mean-token-sum-norm")


def test_all_padding_micro_batch_is_zero_not_nan():
    loss = jnp.ones((2, 3))
    mask = jnp.zeros((2, 3))
    for mode in AGGREGATIONS:
        assert float(aggregate(loss, mask, mode, global_normalizer(mask, mode, max_response_length=4))) == 0.0


def test_trainer_loss_with_kl_and_entropy():
    logp = jnp.array([[-1.0, -2.0]])
    mask = jnp.ones((1, 2))
    loss, metrics = trainer_loss(
        "reinforce", logp, logp, jnp.ones((1, 2)), mask, normalizer=global_normalizer(mask, "token-mean"),
        ref=logp - 0.5, kl_coef=0.1, kl_kind="k1", entropy=jnp.array([[1.0, 3.0]]), entropy_coef=0.01,
    )
    # reinforce: -(-1 - 2)/2 = 1.5 ; k1 = 0.5 -> +0.05 ; entropy 2 -> -0.02
    np.testing.assert_allclose(loss, 1.5 + 0.05 - 0.02, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], loss)
    np.testing.assert_allclose(metrics["entropy"], 2.0)
    np.testing.assert_allclose(metrics["kl_k1"], 0.5)
