"""Inference forward (`models/decode.py`): equals the trainer's `Decoder`, windows, attention kernels."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_helpers import SMALL_QWEN3

from agentrl_jax.models import Decoder, apply, split_params
from agentrl_jax.models.decode import (
    LayerCache,
    _pallas_decode_attention,
    forward,
    grouped_attention,
    to_decode_params,
)

CONFIG = SMALL_QWEN3


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=request.param)
    return Decoder(config, rngs=nnx.Rngs(3))


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, params, ids, positions):
    return apply(graphdef, params, ids, positions)[0]


@functools.partial(jax.jit, static_argnames=("config", "attend_len"))
def _forward(params, ids, positions, cache, index, *, config, attend_len):
    return forward(params, ids, positions, cache, index, config=config, attend_len=attend_len, dtype=jnp.float32)


def test_to_decode_params_layout(model):
    cfg = model.config
    params = to_decode_params(cfg, nnx.state(model, nnx.Param))
    layer = params.layers[1]
    assert len(params.layers) == cfg.num_layers
    G = cfg.num_heads // cfg.num_kv_heads
    assert layer["wqkv"].shape == (cfg.hidden_size, cfg.num_kv_heads, G + 2, cfg.head_dim)
    # kv head 1's slots: its G query heads (2, 3), then its key, then its value
    np.testing.assert_array_equal(layer["wqkv"][:, 1, 1], model.layers.wq[...][1][:, 3])
    np.testing.assert_array_equal(layer["wqkv"][:, 1, G], model.layers.wk[...][1][:, 1])
    np.testing.assert_array_equal(layer["wqkv"][:, 0, G + 1], model.layers.wv[...][1][:, 0])
    np.testing.assert_array_equal(layer["w_gate_up"][:, 1], model.layers.w_up[...][1])
    assert (params.lm_head is None) == cfg.tie_word_embeddings


def test_prefill_then_windowed_decode_matches_the_decoder(model):
    """Two rows of different lengths: chunked prefill, then token-by-token decode with the
    smallest window that covers the longest row; every hidden state equals a full forward."""
    cfg = model.config
    graphdef, state = split_params(model)
    params = to_decode_params(cfg, state)
    rng = np.random.default_rng(0)
    prompt_lens, steps, capacity = np.array([9, 13]), 5, 32
    total = prompt_lens + steps
    seqs = rng.integers(0, cfg.vocab_size, (2, int(total.max())))
    cache = LayerCache.init(cfg, 2, capacity, jnp.float32)
    chunk = 16  # right-padded prefill of both prompts, written at index 0
    ids = np.zeros((2, chunk), np.int64)
    for b in range(2):
        ids[b, : prompt_lens[b]] = seqs[b, : prompt_lens[b]]
    positions = np.tile(np.arange(chunk), (2, 1))
    h_prefill, cache = _forward(params, ids, positions, cache, np.zeros(2, np.int32), config=cfg, attend_len=capacity)
    decoded = []
    for step in range(steps):
        idx = (prompt_lens + step).astype(np.int32)
        window = 8 * -(-(int(idx.max()) + 1) // 8)  # 16, 24: smaller than the cache
        tok = seqs[np.arange(2), idx][:, None]
        h, cache = _forward(params, tok, idx[:, None], cache, idx, config=cfg, attend_len=window)
        decoded.append(np.asarray(h[:, 0]))
    for b in range(2):
        n, p = int(total[b]), int(prompt_lens[b])
        full = np.asarray(_full(graphdef, state, seqs[b : b + 1, :n], np.arange(n)[None]))[0]
        got = np.concatenate([np.asarray(h_prefill[b, :p]), np.stack([d[b] for d in decoded])])
        np.testing.assert_allclose(got, full, atol=1e-5, rtol=0)


def test_writes_land_at_the_row_index_and_past_the_end_are_dropped(model):
    cfg = model.config
    params = to_decode_params(cfg, nnx.state(model, nnx.Param))
    cache = LayerCache.init(cfg, 2, 6, jnp.float32)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    _, cache = _forward(params, ids, np.array([[0, 1, 2], [4, 5, 6]]), cache, np.array([0, 4], np.int32),
                        config=cfg, attend_len=6)
    for k in cache.k:
        k = np.asarray(k)  # [B, KV, S, K]
        assert np.abs(k[0, :, :3]).min() > 0 and not k[0, :, 3:].any()
        assert not k[1, :, :4].any() and np.abs(k[1, :, 4:]).min() > 0  # entry 6 dropped


def _reference_attention(q, k, v, lengths):
    """float64 NumPy: q [B, KV, G, K] over the first lengths[b] of k, v [B, KV, S, K]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros_like(q)
    for b, n in enumerate(lengths):
        logits = np.einsum("ngk,nsk->ngs", q[b], k[b, :, :n]) / np.sqrt(q.shape[-1])
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        out[b] = np.einsum("ngs,nsk->ngk", probs / probs.sum(-1, keepdims=True), v[b, :, :n])
    return out


def test_grouped_attention_hand_values():
    """Two keys with logits 0 and log 3 (after the 1/sqrt(K) scale): weights 1/4, 3/4."""
    K = 4
    q = np.zeros((1, 1, 1, 1, K), np.float32)
    q[..., 0] = np.sqrt(K)
    k = np.zeros((1, 1, 3, K), np.float32)
    k[0, 0, 1, 0] = np.log(3.0)
    k[0, 0, 2, 0] = 100.0  # masked out
    v = np.zeros((1, 1, 3, K), np.float32)
    v[0, 0, 0, 1], v[0, 0, 1, 1], v[0, 0, 2, 1] = 1.0, 5.0, 1000.0
    visible = np.array([[[True, True, False]]])
    out = grouped_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible))
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0, 0], [0.0, 0.25 * 1 + 0.75 * 5, 0.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("rows,min_programs", [(1, 512), (6, 1)])  # 4 chunks of the cache; 1 chunk
def test_decode_attention_kernels_match_a_numpy_reference(rows, min_programs):
    rng = np.random.default_rng(rows)
    KV, G, S, K = 2, 2, 256, 16
    q = rng.normal(size=(rows, KV, G, K)).astype(np.float32)
    k, v = (rng.normal(size=(rows, KV, S, K)).astype(np.float32) for _ in range(2))
    lengths = rng.integers(1, S + 1, rows).astype(np.int32)
    lengths[0] = 65  # one entry past a 64-entry block
    ref = _reference_attention(q, k, v, lengths)
    visible = np.arange(S)[None, None, :] < lengths[:, None, None]
    xla = grouped_attention(jnp.asarray(q)[:, None], jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible))
    np.testing.assert_allclose(np.asarray(xla)[:, 0], ref, atol=1e-5)
    kernel = jax.jit(functools.partial(_pallas_decode_attention, min_programs=min_programs))
    pallas = kernel(*map(jnp.asarray, (q, k, v, lengths)))
    np.testing.assert_allclose(np.asarray(pallas), ref, atol=1e-5)
