"""Batch building: alignment, masks, packing == padding, bucketing, errors."""

import numpy as np
import pytest

from agentrl_jax.train.batch import TokenRecord, bucket_length, build_batch, pack_first_fit


def _record(n, seed, prompt=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 100, n)
    mask = np.zeros(n, int)
    mask[prompt:] = 1
    mask[prompt + 2 : prompt + 4] = 0  # an observation inside the response
    lp = np.where(mask, -rng.random(n), 0.0)
    ver = np.where(mask, 7, -1)
    adv = np.where(mask, rng.normal(), 0.0)
    return TokenRecord(ids.tolist(), mask.tolist(), lp.tolist(), ver.tolist(), adv.tolist())


def test_alignment_hand_case():
    rec = TokenRecord([10, 11, 12, 13], [0, 0, 1, 1], [0, 0, -0.5, -0.25], [-1, -1, 3, 3], [0, 0, 2.0, 2.0])
    b = build_batch([rec], row_length=6)
    np.testing.assert_array_equal(b.input_ids[0], [10, 11, 12, 13, 0, 0])
    np.testing.assert_array_equal(b.targets[0], [11, 12, 13, 0, 0, 0])
    np.testing.assert_array_equal(b.loss_mask[0], [0, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(b.rollout_logprobs[0], [0, -0.5, -0.25, 0, 0, 0])
    np.testing.assert_array_equal(b.params_versions[0], [-1, 3, 3, -1, -1, -1])
    np.testing.assert_allclose(b.advantages[0], [0, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(b.segment_ids[0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(b.positions[0], [0, 1, 2, 3, 0, 0])


def test_packed_holds_the_same_tokens_as_padded():
    recs = [_record(n, i) for i, n in enumerate([9, 17, 5, 12, 30, 8])]
    padded = build_batch(recs)
    packed = build_batch(recs, pack=True, row_length=32)
    assert packed.shape[0] < padded.shape[0]
    for i in range(len(recs)):
        for name in ("targets", "loss_mask", "rollout_logprobs", "advantages", "params_versions"):
            a = getattr(padded, name)[padded.sequence_ids == i][padded.segment_ids[padded.sequence_ids == i] > 0]
            sel = (packed.sequence_ids == i) & (packed.segment_ids > 0)
            np.testing.assert_array_equal(np.sort(getattr(packed, name)[sel]), np.sort(a), err_msg=name)
    # Positions restart per segment, and targets never cross a segment boundary.
    for r in range(packed.shape[0]):
        for seg in set(packed.segment_ids[r]) - {0}:
            idx = np.flatnonzero(packed.segment_ids[r] == seg)
            np.testing.assert_array_equal(packed.positions[r, idx], np.arange(len(idx)))
            assert packed.loss_mask[r, idx[-1]] == 0
    assert packed.loss_mask.sum() == padded.loss_mask.sum()


def test_row_multiple_and_bucketing():
    recs = [_record(20, i) for i in range(3)]
    b = build_batch(recs, row_multiple=4)
    assert b.shape == (4, 32)
    assert b.loss_mask[3].sum() == 0
    assert bucket_length(33) == 64 and bucket_length(5) == 32 and bucket_length(90, maximum=96) == 96
    with pytest.raises(ValueError, match="exceeds the row length limit 64"):
        bucket_length(65, maximum=64)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="TokenRecord.loss_mask has 2 entries, token_ids has 3"):
        TokenRecord([1, 2, 3], [0, 1], [0, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="more than row_length=8"):
        build_batch([_record(12, 0)], row_length=8)
    with pytest.raises(ValueError, match="more than the row length"):
        pack_first_fit([5, 40], 32)
