"""KV-cache path: chunked prefill + token-by-token decode equals one full forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_helpers import SMALL_QWEN3

from agentrl_jax.models import Decoder, KVCache, apply, split_params

CONFIG = SMALL_QWEN3


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(3))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, ids, positions, cache, cache_index):
    return apply(graphdef, params, ids, positions, cache=cache, cache_index=cache_index)


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, params, ids, positions):
    return apply(graphdef, params, ids, positions)[0]


def test_chunked_prefill_then_decode_matches_full_forward(model):
    graphdef, params = split_params(model)
    rng = np.random.default_rng(0)
    prompt_lens = np.array([9, 13])
    decode_steps = 4
    total = prompt_lens + decode_steps
    seqs = rng.integers(0, CONFIG.vocab_size, (2, int(total.max())))
    cache = KVCache.init(CONFIG, batch=2, max_len=24, dtype=jnp.float32)
    chunk1 = 5
    h1, cache = _forward(
        graphdef,
        params,
        seqs[:, :chunk1],
        np.tile(np.arange(chunk1), (2, 1)),
        cache,
        np.zeros(2, np.int32),
    )
    # Second prefill chunk, right-padded to a common length: row 0's padding lands at cache
    # positions 9..12 and must be overwritten by its decode steps.
    T2 = int(prompt_lens.max()) - chunk1
    ids2 = np.zeros((2, T2), np.int64)
    for b in range(2):
        n = prompt_lens[b] - chunk1
        ids2[b, :n] = seqs[b, chunk1 : prompt_lens[b]]
    pos2 = chunk1 + np.tile(np.arange(T2), (2, 1))
    h2, cache = _forward(graphdef, params, ids2, pos2, cache, np.full(2, chunk1, np.int32))
    decoded = []
    for step in range(decode_steps):
        idx = prompt_lens + step
        tok = seqs[np.arange(2), idx][:, None]
        h, cache = _forward(graphdef, params, tok, idx[:, None], cache, idx.astype(np.int32))
        decoded.append(np.asarray(h[:, 0]))
    for b in range(2):
        n = int(total[b])
        full = np.asarray(_full(graphdef, params, seqs[b : b + 1, :n], np.arange(n)[None]))[0]
        p = int(prompt_lens[b])
        got = np.concatenate(
            [np.asarray(h1[b]), np.asarray(h2[b, : p - chunk1]), np.stack([d[b] for d in decoded])]
        )
        np.testing.assert_allclose(got, full, atol=1e-5, rtol=0)


def test_cache_holds_rope_keys_of_written_tokens_only(model):
    graphdef, params = split_params(model)
    cache = KVCache.init(CONFIG, batch=2, max_len=8, dtype=jnp.float32)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    _, cache = _forward(
        graphdef, params, ids, np.tile(np.arange(3), (2, 1)), cache, np.array([0, 2], np.int32)
    )
    k = np.asarray(cache.k)
    assert np.abs(k[:, 0, :3]).min() > 0 and not k[:, 0, 3:].any()
    assert not k[:, 1, :2].any() and np.abs(k[:, 1, 2:5]).min() > 0 and not k[:, 1, 5:].any()


def test_writes_past_the_cache_end_are_dropped(model):
    graphdef, params = split_params(model)
    cache = KVCache.init(CONFIG, batch=1, max_len=6, dtype=jnp.float32)
    _, cache = _forward(
        graphdef, params, np.array([[1, 2, 3, 4]]), np.arange(4)[None], cache, np.zeros(1, np.int32)
    )
    before = np.asarray(cache.k)
    # Three tokens at index 4 of a 6-long cache: positions 4, 5 are written, 6 is dropped
    # (a clamped dynamic_update_slice would have shifted the write onto positions 3..5).
    _, cache = _forward(
        graphdef,
        params,
        np.array([[5, 6, 7]]),
        np.arange(4, 7)[None],
        cache,
        np.array([4], np.int32),
    )
    after = np.asarray(cache.k)
    np.testing.assert_array_equal(after[:, :, :4], before[:, :, :4])
    assert np.abs(after[:, :, 4:]).min() > 0


def test_cache_requires_cache_index(model):
    cache = KVCache.init(CONFIG, batch=1, max_len=4, dtype=jnp.float32)
    with pytest.raises(ValueError, match="cache_index"):
        model(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache=cache)


def test_kv_cache_logical_axes_and_shape():
    assert KVCache.logical_axes().k == ("layers", "slots", "cache_sequence", "kv_heads", "head_dim")
    cache = KVCache.init(CONFIG, batch=3, max_len=10)
    assert cache.k.shape == (3, 3, 10, 2, 16) and cache.k.dtype == jnp.bfloat16
    assert cache.batch == 3 and cache.max_len == 10
