"""`forward`'s compacted paged prefill (``token_index``): the token-wise work on the real tokens
only gives the keys/values and hidden states of the packed rows' layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_helpers import SMALL_QWEN3

from agentrl_jax.models import Decoder, split_params
from agentrl_jax.models.decode import AttentionPlan, forward
from agentrl_jax.models.decode_params import LayerCache, to_decode_params

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

P, TP = 4, 4  # page size (divides no row's reach below), pages per table
C = 6  # tokens per row
# rows: a sequence's two pieces (entries [0, 6) and [6, 9)), a session's continuation from entry 5
# (its earlier entries are in the pool already), a padding row, a one-token row
TABLE = np.array([[1, 2, 3, 0], [1, 2, 3, 0], [4, 5, 0, 0], [0, 0, 0, 0], [6, 0, 0, 0]], np.int32)
STARTS = np.array([0, 6, 5, 0, 3], np.int32)
LENGTHS = np.array([6, 3, 2, 0, 1], np.int32)


def setup(seed=0):
    config = SMALL_QWEN3
    params = to_decode_params(config, split_params(Decoder(config, rngs=nnx.Rngs(seed)))[1])
    rng = np.random.default_rng(seed)
    pool = (7, config.num_kv_heads, P, config.head_dim)
    cache = LayerCache(*(tuple(jnp.asarray(rng.normal(size=pool), jnp.float32) for _ in range(config.num_layers))
                         for _ in range(2)))
    tokens = rng.integers(1, config.vocab_size, (len(STARTS), C)).astype(np.int32)
    return config, params, cache, tokens


def compact(tokens, positions, order, size):
    """The real tokens of the rows in ``order`` (a permutation of them), padded to ``size``."""
    real = np.flatnonzero((np.arange(C)[None, :] < LENGTHS[:, None]).reshape(-1))[order]
    index = np.full((size,), tokens.size, np.int32)  # padding: past the rows
    index[: real.size] = real
    pad = np.zeros((size - real.size,), np.int32)
    return (np.concatenate([tokens.reshape(-1)[real], pad]), np.concatenate([positions.reshape(-1)[real], pad]),
            index, real)


@pytest.mark.parametrize("attention", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])  # pallas: interpreted
def test_compacted_forward_equals_the_rows(attention):
    """Real tokens in a shuffled order plus compact padding: every pool entry and the real tokens'
    hidden states equal the uncompacted forward's (float32: ~1e-6 apart on CPU, checked to 1e-5)."""
    config, params, cache, tokens = setup()
    positions = STARTS[:, None] + np.arange(C, dtype=np.int32)[None]
    run = jax.jit(forward, static_argnames=("plan", "attend_len", "row_tokens"))
    kw = dict(plan=AttentionPlan(config, jnp.float32, prefill_attention=attention), attend_len=TP * P,
              page_table=jnp.asarray(TABLE), write_len=jnp.asarray(LENGTHS))
    rows_hidden, rows_cache = run(params, jnp.asarray(tokens), jnp.asarray(positions), cache, jnp.asarray(STARTS), **kw)
    order = np.random.default_rng(1).permutation(int(LENGTHS.sum()))
    c_tokens, c_positions, index, real = compact(tokens, positions, order, 16)
    hidden, got = run(params, jnp.asarray(c_tokens), jnp.asarray(c_positions), cache, jnp.asarray(STARTS),
                      token_index=jnp.asarray(index), row_tokens=C, **kw)
    assert hidden.shape == (16, config.hidden_size)
    want = np.asarray(rows_hidden).reshape(-1, config.hidden_size)[real]
    np.testing.assert_allclose(np.asarray(hidden)[: real.size], want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got.k + got.v, rows_cache.k + rows_cache.v, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    for a, b in zip(got.k, cache.k, strict=True):  # pages 1-3, 5 and 6 written; 0 (trash) and 4 (read) not
        assert all(np.abs(np.asarray(a)[p] - np.asarray(b)[p]).max() > 0 for p in (1, 2, 3, 5, 6))
        np.testing.assert_array_equal(np.asarray(a)[[0, 4]], np.asarray(b)[[0, 4]])


def test_compacted_forward_bad_arguments_name_them():
    config, params, cache, tokens = setup()
    positions = STARTS[:, None] + np.arange(C, dtype=np.int32)[None]
    c_tokens, c_positions, index, _ = compact(tokens, positions, np.arange(int(LENGTHS.sum())), 16)
    c_tokens, c_positions, index = map(jnp.asarray, (c_tokens, c_positions, index))
    kw = dict(plan=AttentionPlan(config, jnp.float32), attend_len=TP * P)
    paged = dict(page_table=jnp.asarray(TABLE), write_len=jnp.asarray(LENGTHS))
    with pytest.raises(ValueError, match="token_index .* needs a page_table, write_len"):
        forward(params, c_tokens, c_positions, cache, jnp.asarray(STARTS), token_index=index, row_tokens=C, **kw)
    with pytest.raises(ValueError, match="row_tokens must be"):
        forward(params, c_tokens, c_positions, cache, jnp.asarray(STARTS), token_index=index, **kw, **paged)
    with pytest.raises(ValueError, match="row_tokens is the width"):
        forward(params, jnp.asarray(tokens), jnp.asarray(positions), cache, jnp.asarray(STARTS), row_tokens=C,
                **kw, **paged)
