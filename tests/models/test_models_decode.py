"""Inference forward (`models/decode.py`): equals the trainer's `Decoder`, windows, attention kernels."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_helpers import SMALL_QWEN3

from agentrl_jax.models import Decoder, apply, decode_attention, split_params
from agentrl_jax.models.cache_attention import grouped_attention
from agentrl_jax.models.decode import AttentionPlan, forward
from agentrl_jax.models.decode_params import LayerCache, to_decode_params

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

CONFIG = SMALL_QWEN3


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    config = dataclasses.replace(CONFIG, tie_word_embeddings=request.param)
    return Decoder(config, rngs=nnx.Rngs(3))


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, params, ids, positions):
    return apply(graphdef, params, ids, positions)


@functools.partial(jax.jit, static_argnames=("config", "attend_len"))
def _forward(params, ids, positions, cache, index, *, config, attend_len):
    return forward(params, ids, positions, cache, index, AttentionPlan(config, jnp.float32), attend_len=attend_len)


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


def test_grouped_attention_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    B, KV, G, S, K = 3, 2, 2, 256, 16
    q = rng.normal(size=(B, KV, G, K)).astype(np.float32)
    k, v = (rng.normal(size=(B, KV, S, K)).astype(np.float32) for _ in range(2))
    lengths = np.array([65, 1, 256], np.int32)
    visible = np.arange(S)[None, None, :] < lengths[:, None, None]
    xla = grouped_attention(jnp.asarray(q)[:, None], jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible))
    np.testing.assert_allclose(np.asarray(xla)[:, 0], _reference_attention(q, k, v, lengths), atol=1e-5)


@pytest.mark.parametrize("method", decode_attention.METHODS)
@pytest.mark.parametrize("G,chunks", [(2, 1), (2, 4), (3, 1), (1, 2), (2, 3), (2, 16)])
def test_decode_attention_kernel_writes_then_attends(method, G, chunks):
    """The fused kernel == scatter the new entry, then attend over [0, position] (float64 NumPy)."""
    rng = np.random.default_rng(G * 10 + chunks)
    B, KV, S, K = 4, 2, 256, 16
    q = rng.normal(size=(B, KV, G, K)).astype(np.float32)
    k_cache, v_cache = (rng.normal(size=(B, KV, S, K)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.normal(size=(B, KV, K)).astype(np.float32) for _ in range(2))
    # first entry; one past a 64-entry block; the last entry; past the end (write dropped)
    positions = np.array([0, 64, S - 1, S + 5], np.int32)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b, pos in enumerate(positions[:3]):
        want_k[b, :, pos], want_v[b, :, pos] = k_new[b], v_new[b]
    # row b attends over its first min(position, S) cache entries and the new one
    keys = np.concatenate([want_k, k_new[:, :, None]], axis=2)
    values = np.concatenate([want_v, v_new[:, :, None]], axis=2)
    ref = [_reference_attention(q[b:b + 1], keys[b:b + 1], values[b:b + 1], [pos + 1]) for b, pos in
           enumerate(positions[:3])]
    ref.append(_reference_attention(q[3:], keys[3:], values[3:], [S + 1]))
    qkv = np.concatenate([q, k_new[:, :, None], v_new[:, :, None]], axis=2)
    out, new_k, new_v = decode_attention.decode_attention(
        *map(jnp.asarray, (qkv, positions, k_cache, v_cache)), method=method, chunks=chunks
    )
    np.testing.assert_allclose(np.asarray(out), np.concatenate(ref), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_k), want_k)
    np.testing.assert_array_equal(np.asarray(new_v), want_v)


def test_decode_attention_kernel_bad_shapes():
    qkv = jnp.zeros((2, 2, 4, 16))
    cache = jnp.zeros((2, 2, 128, 16))
    positions = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="multiple of block_k"):
        decode_attention.decode_attention(qkv, positions, cache[:, :, :100], cache[:, :, :100])
    with pytest.raises(ValueError, match="method"):
        decode_attention.decode_attention(qkv, positions, cache, cache, method="mma")
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention.decode_attention(qkv[:, :1], positions, cache, cache)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention.decode_attention(qkv[:, :, :2], positions, cache, cache)
    wide = jnp.zeros((2, 2, 19, 16))  # G = 17 query heads per kv head
    with pytest.raises(ValueError, match="at most 16 query heads"):
        decode_attention.decode_attention(wide, positions, cache, cache, method="dot")
    with pytest.raises(ValueError, match="bias"):
        decode_attention.decode_attention(qkv, positions, cache, cache, bias=jnp.zeros((2, 3, 16)))
    with pytest.raises(ValueError, match="power-of-two head dim"):  # Triton only; the interpreter takes any
        decode_attention.decode_attention(qkv[..., :12], positions, cache[..., :12], cache[..., :12], interpret=False)


@pytest.mark.parametrize("method", decode_attention.METHODS)
@pytest.mark.parametrize("dtype,split", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True),
                                         (jnp.bfloat16, True)])
def test_decode_attention_kernel_applies_projection_norm_and_rope_like_the_xla_path(method, dtype, split):
    """Raw QKV (or its split-K partials + a bias) with in-kernel QK-norm and RoPE == the same
    steps in XLA (`rotate_and_norm`), then the kernel on the finished rows."""
    from agentrl_jax.models.cache_attention import rotate_and_norm
    from agentrl_jax.models.layers import rope_frequencies

    config = dataclasses.replace(CONFIG, qk_norm=True)
    rng = np.random.default_rng(7)
    B, KV, G, S, K = 3, config.num_kv_heads, config.num_heads // config.num_kv_heads, 128, config.head_dim
    cache = jnp.asarray(rng.normal(size=(B, KV, S, K)), dtype)
    norms = {name: jnp.asarray(rng.uniform(0.5, 1.5, K), dtype) for name in ("q_norm", "k_norm")}
    positions = jnp.asarray([0, 70, 127], jnp.int32)
    rope_positions = jnp.asarray([5, 1000, 127], jnp.int32)  # RoPE positions need not be cache indices
    inv_freq = rope_frequencies(config)
    if split:
        partials = jnp.asarray(rng.normal(size=(4, B, KV, G + 2, K)) / 2, jnp.float32)
        bias = jnp.asarray(rng.normal(size=(KV, G + 2, K)), dtype)
        qkv = jnp.sum(partials, axis=0).astype(dtype) + bias
        extra = dict(bias=bias, dtype=dtype)
    else:
        partials = qkv = jnp.asarray(rng.normal(size=(B, KV, G + 2, K)), dtype)
        extra = {}
    ready = rotate_and_norm(qkv[:, None], norms, rope_positions[:, None], config=config, inv_freq=inv_freq)[:, 0]
    want = decode_attention.decode_attention(ready, positions, cache.copy(), cache.copy(), method=method)
    got = decode_attention.decode_attention(
        partials, positions, cache.copy(), cache.copy(), rope_positions=rope_positions, inv_freq=jnp.asarray(inv_freq),
        eps=config.rms_norm_eps, method=method, **norms, **extra,
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for w, g in zip(want, got):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        decode_attention.decode_attention(qkv, positions, cache, cache, q_norm=norms["q_norm"])
    with pytest.raises(ValueError, match="model dtype"):
        decode_attention.decode_attention(partials[None] if not split else partials, positions, cache, cache)


def test_pallas_decode_step_matches_the_xla_path(model):
    """One decode step through the kernel (split-K QKV sum, bias, QK-norm, RoPE, cache write
    and attention in Pallas, interpreted here) == the XLA path, hidden states and caches."""
    cfg = model.config
    assert cfg.attention_bias and cfg.qk_norm and cfg.hidden_size % 4 == 0  # every kernel input in use
    params = to_decode_params(cfg, nnx.state(model, nnx.Param))
    rng = np.random.default_rng(1)
    B, S = 3, 64
    cache = LayerCache.init(cfg, B, S, jnp.float32).map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype))
    index = np.array([0, 17, S - 1], np.int32)
    tokens = rng.integers(0, cfg.vocab_size, (B, 1))
    outs = {}
    for attention in ("xla", "pallas"):
        step = jax.jit(functools.partial(forward, plan=AttentionPlan(cfg, jnp.float32, attention), attend_len=S))
        outs[attention] = step(params, tokens, index[:, None] + 3, cache.map(jnp.copy), index)
    (h_xla, c_xla), (h_pallas, c_pallas) = outs["xla"], outs["pallas"]
    np.testing.assert_allclose(np.asarray(h_pallas), np.asarray(h_xla), atol=1e-5, rtol=1e-5)
    for a, b in zip(c_pallas.k + c_pallas.v, c_xla.k + c_xla.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)  # split-K order: ~1 ulp


def test_kernel_block_hand_values():
    from agentrl_jax.models.decode import kernel_block

    assert kernel_block(1792, None, 32) == 32  # dense: the preferred block
    assert kernel_block(1792, 128, 32) == 32  # a quarter page
    assert kernel_block(1792, 16, 32) == 32  # two whole pages (gathered)
    assert kernel_block(1552, 16, 64) == 16  # 1552 = 97 pages of 16: 64 and 32 do not divide it
    assert kernel_block(1536, 48, 32) == 16  # pages of 48: 32 is neither part of one nor whole pages


def test_kernel_chunks_hand_values():
    from agentrl_jax.models.decode import kernel_chunks

    assert kernel_chunks(512, 56, 512) == 1  # batch 64 x 8 kv heads: one program each
    assert kernel_chunks(128, 56, 512) == 4  # 128 * 4 = 512
    assert kernel_chunks(48, 56, 512) == 11  # 10 would reach 480 only
    assert kernel_chunks(8, 56, 512) == 56  # 64 would: at most every block its own chunk


@pytest.mark.parametrize("method,page_size,block_k,chunks", [
    (method, *case) for method in decode_attention.METHODS for case in ((16, 16, 1), (32, 32, 2), (64, 32, 1))
] + [("dot", 8, 32, 1), ("vector", 16, 32, 2)])  # blocks of several pages: one method each (the gather is shared)
def test_paged_decode_attention_kernel_equals_the_dense_one(method, page_size, block_k, chunks):
    """The kernel reading and writing through a page table (pages shuffled, a trash page for a
    row that writes nowhere) == the dense kernel on the rows gathered from the pages; blocks
    inside a page, and blocks of several pages (gathered entry by entry)."""
    rng = np.random.default_rng(page_size + block_k + chunks)
    B, KV, G, K, T = 4, 2, 2, 16, 4  # T table entries per row: S = T * page_size
    N = B * T + 1
    pool_k, pool_v = (rng.normal(size=(N, KV, page_size, K)).astype(np.float32) for _ in range(2))
    table = (1 + rng.permutation(B * T)).reshape(B, T).astype(np.int32)
    S = T * page_size
    positions = np.array([0, page_size + 3, S - 1, 2 * page_size], np.int32)
    qkv = rng.normal(size=(B, KV, G + 2, K)).astype(np.float32)

    def dense(pool):  # [B, KV, S, K] rows gathered through the table
        return pool[table].transpose(0, 2, 1, 3, 4).reshape(B, KV, S, K)

    want, want_k, want_v = decode_attention.decode_attention(
        *map(jnp.asarray, (qkv, positions, dense(pool_k), dense(pool_v))), method=method, chunks=chunks,
        block_k=block_k,
    )
    got, got_k, got_v = decode_attention.decode_attention(
        *map(jnp.asarray, (qkv, positions, pool_k, pool_v)), page_table=jnp.asarray(table), method=method,
        chunks=chunks, block_k=block_k,
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_array_equal(dense(np.asarray(got_k)), np.asarray(want_k))
    np.testing.assert_array_equal(dense(np.asarray(got_v)), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(got_k)[0], pool_k[0])  # the trash page: untouched here
    with pytest.raises(ValueError, match="must divide one another"):
        decode_attention.decode_attention(*map(jnp.asarray, (qkv, positions, pool_k[:, :, :3 * page_size // 4],
                                                             pool_v[:, :, :3 * page_size // 4])),
                                          page_table=jnp.asarray(table), block_k=page_size // 2)
