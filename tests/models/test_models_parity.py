"""Logits parity against transformers (PyTorch, float32) on padded and packed batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from agentrl_jax.models import split_params
from agentrl_jax.models.hf_io import load_hf_checkpoint

NAMES = ["llama3_scaled", "qwen2_tied", "qwen3"]
VOCAB = 97
TOL = 1e-4


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logits(model, ids, positions, attention_mask=None):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(np.asarray(ids)),
            position_ids=torch.tensor(np.asarray(positions)),
            attention_mask=None
            if attention_mask is None
            else torch.tensor(np.asarray(attention_mask)),
        )
    return out.logits.numpy()


def _our_logits(model, ids, positions, **kwargs):
    graphdef, params = split_params(model)

    @jax.jit
    def forward(params, ids, positions, kwargs):
        decoder = nnx.merge(graphdef, params)
        hidden = decoder(ids, positions, **kwargs)
        return decoder.logits(hidden), hidden

    kwargs = {k: jnp.asarray(v) for k, v in kwargs.items()}
    logits, hidden = forward(params, jnp.asarray(ids), jnp.asarray(positions), kwargs)
    return np.asarray(logits), np.asarray(hidden)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_padded(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    rng = np.random.default_rng(0)
    B, T = 3, 24
    ids = rng.integers(0, VOCAB, (B, T))
    mask = np.ones((B, T), np.int32)
    mask[1, :6] = 0  # left padding
    mask[2, 19:] = 0  # right padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours, hidden = _our_logits(load_hf_checkpoint(path), ids, positions, attention_mask=mask)
    theirs = _hf_logits(_hf_model(path), ids, positions, mask)
    real = mask.astype(bool)
    assert np.abs(ours[real] - theirs[real]).max() <= TOL
    assert np.isfinite(hidden).all(), "padded query rows must stay finite"
    assert np.abs(theirs[real]).max() > 0.5  # logits are not trivially small


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_packed(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    rng = np.random.default_rng(1)
    lengths = [7, 10, 5]
    T = sum(lengths) + 2
    ids = rng.integers(0, VOCAB, (1, T))
    segment_ids = np.zeros((1, T), np.int32)
    positions = np.zeros((1, T), np.int32)
    start = 0
    for seg, n in enumerate(lengths):
        segment_ids[0, start : start + n] = seg + 1
        positions[0, start : start + n] = np.arange(n)
        start += n
    mask = (segment_ids > 0).astype(np.int32)
    ours, _ = _our_logits(
        load_hf_checkpoint(path), ids, positions, segment_ids=segment_ids, attention_mask=mask
    )
    hf = _hf_model(path)
    start = 0
    for n in lengths:
        seg_ids = ids[:, start : start + n]
        theirs = _hf_logits(hf, seg_ids, np.arange(n)[None])
        assert np.abs(ours[:, start : start + n] - theirs).max() <= TOL
        start += n


@pytest.mark.parametrize("name", NAMES)
def test_lengths_path_matches_transformers_on_right_padded_rows(tiny_checkpoints, name):
    """The mask-free causal path (row lengths, cuDNN flash on GPU) equals the reference."""
    path = tiny_checkpoints[name]
    rng = np.random.default_rng(1)
    B, T = 3, 20
    ids = rng.integers(0, VOCAB, (B, T))
    lengths = np.array([20, 13, 5], np.int32)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(T), (B, T))
    ours, hidden = _our_logits(load_hf_checkpoint(path), ids, positions, lengths=lengths)
    theirs = _hf_logits(_hf_model(path), ids, positions, mask)
    real = mask.astype(bool)
    assert np.abs(ours[real] - theirs[real]).max() <= TOL
    assert np.isfinite(hidden).all()
