"""The paged prefill attention kernel (`models/prefill_attention.py`) against a NumPy reference,
and `forward`'s paged prefill with it against the XLA path."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_helpers import SMALL_QWEN3

from agentrl_jax.models import Decoder, split_params
from agentrl_jax.models.cache_attention import grouped_attention
from agentrl_jax.models.decode import AttentionPlan, forward
from agentrl_jax.models.decode_params import LayerCache, to_decode_params
from agentrl_jax.models.prefill_attention import prefill_attention

ON_GPU = jax.default_backend() == "gpu"


def numpy_reference(q, k_pool, v_pool, table, starts, lengths):
    """Query t < lengths[r] of row r over entries ``[0, starts[r] + t]`` of its pages, float64 softmax;
    the queries past a row's length are left zero (their outputs are unused)."""
    R, _, KV, _, K = q.shape
    P = k_pool.shape[2]
    out = np.zeros(q.shape, np.float64)
    for r in range(R):
        for t in range(lengths[r]):
            entries = np.arange(starts[r] + t + 1)
            pages, offsets = table[r, entries // P], entries % P
            for h in range(KV):
                k, v = k_pool[pages, h, offsets].astype(np.float64), v_pool[pages, h, offsets].astype(np.float64)
                s = q[r, t, h].astype(np.float64) @ k.T / math.sqrt(K)  # [G, n]
                p = np.exp(s - s.max(axis=1, keepdims=True))
                out[r, t, h] = (p / p.sum(axis=1, keepdims=True)) @ v
    return out


def random_case(rng, *, R, C, KV, G, K, P, Tp, starts, lengths, dtype=np.float32):
    N = R * Tp + 1  # page 0 plays the trash page: tables point there past a row's pages
    k_pool, v_pool = (rng.normal(size=(N, KV, P, K)).astype(dtype) for _ in range(2))
    table = np.zeros((R, Tp), np.int32)
    ids = 1 + rng.permutation(R * Tp)
    for r in range(R):
        used = -(-(starts[r] + lengths[r]) // P)
        table[r, :used] = ids[r * Tp: r * Tp + used]
    q = rng.normal(size=(R, C, KV, G, K)).astype(dtype)
    return q, k_pool, v_pool, table, np.asarray(starts, np.int32), np.asarray(lengths, np.int32)


@pytest.mark.parametrize("G,P,block_k", [
    (1, 32, 16),  # two blocks per page (contiguous loads)
    (2, 16, 16),  # a block per page
    (2, 8, 16),  # a block over two pages (gathered entry by entry)
    (4, 6, 16),  # pages of 6: no power of two, gathered
])
def test_kernel_equals_a_numpy_reference(G, P, block_k):
    """Rows of length 0, < C and C; starts and ends that are no multiple of the page size; rows whose
    reach differs in one call (the shortest stops early); tiles of 16 flattened (token, head) rows
    (several query blocks per row, the last one partly padding)."""
    rng = np.random.default_rng(G * 100 + P)
    C, Tp = 6, 8
    starts, lengths = [0, P + 3, 2 * P - 1, 5, 3 * P + 1], [6, 4, 6, 0, 2]
    case = random_case(rng, R=5, C=C, KV=2, G=G, K=16, P=P, Tp=Tp, starts=starts, lengths=lengths)
    got = np.asarray(prefill_attention(*map(jnp.asarray, case), block_q=16, block_k=block_k))
    want = numpy_reference(*case)
    real = np.arange(C)[None, :] < np.asarray(lengths)[:, None]  # [R, C]
    np.testing.assert_allclose(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[3], 0.0)  # the padding row read nothing


def test_kernel_equals_grouped_attention_over_the_gathered_window():
    """The XLA path's attention (`grouped_attention` over each row's gathered pages, a causal mask)
    on full rows, with the default blocks (one query block per row)."""
    rng = np.random.default_rng(7)
    R, C, KV, G, K, P, Tp = 3, 8, 2, 2, 16, 16, 4
    starts = [0, 19, 56]
    q, k_pool, v_pool, table, starts, lengths = random_case(
        rng, R=R, C=C, KV=KV, G=G, K=K, P=P, Tp=Tp, starts=starts, lengths=[C] * R)
    window = [pool[table].transpose(0, 2, 1, 3, 4).reshape(R, KV, Tp * P, K) for pool in (k_pool, v_pool)]
    visible = np.arange(Tp * P)[None, None, :] <= (starts[:, None] + np.arange(C))[:, :, None]
    want = grouped_attention(jnp.asarray(q), *map(jnp.asarray, window), jnp.asarray(visible))
    got = prefill_attention(*map(jnp.asarray, (q, k_pool, v_pool, table, starts, lengths)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_kernel_bad_inputs_name_the_argument():
    rng = np.random.default_rng(0)
    q, k_pool, v_pool, table, starts, lengths = map(jnp.asarray, random_case(
        rng, R=2, C=4, KV=2, G=2, K=16, P=8, Tp=2, starts=[0, 1], lengths=[4, 4]))
    with pytest.raises(ValueError, match=r"\[R, C, KV, G, K\]"):
        prefill_attention(q[0], k_pool, v_pool, table, starts, lengths)
    with pytest.raises(ValueError, match="pools"):
        prefill_attention(q, k_pool[:, :1], v_pool[:, :1], table, starts, lengths)
    with pytest.raises(ValueError, match="page_table"):
        prefill_attention(q, k_pool, v_pool, table[:1], starts, lengths)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        prefill_attention(q, k_pool, v_pool, table, starts, lengths, block_k=24)


def _paged_forward(params, tokens, positions, cache, starts, table, lengths, *, config, attention):
    return forward(params, tokens, positions, cache, starts, AttentionPlan(config, jnp.float32, prefill_attention=attention),
                   attend_len=table.shape[1] * 8, page_table=table, write_len=lengths)


@pytest.mark.slow  # ~5 s interpreted; the engine's prefill test covers the default suite
def test_forward_with_the_kernel_equals_the_xla_paged_prefill():
    """`forward`'s paged prefill (two pieces of one sequence in one call, a padding row, a row
    starting mid-page): hidden states of the real tokens and the pools equal the XLA path's."""
    config = dataclasses.replace(SMALL_QWEN3, num_layers=2)
    model = Decoder(config, rngs=nnx.Rngs(1))
    params = to_decode_params(config, split_params(model)[1])
    R, C, P, Tp = 3, 5, 8, 2
    cache = LayerCache(*(tuple(jnp.zeros((R * Tp + 1, config.num_kv_heads, P, 16)) for _ in range(config.num_layers))
                         for _ in range(2)))
    table = np.array([[1, 2], [1, 2], [0, 0]], np.int32)  # rows 0 and 1: pieces of one sequence
    starts, lengths = np.array([0, 5, 0], np.int32), np.array([5, 4, 0], np.int32)
    tokens = np.random.default_rng(0).integers(1, config.vocab_size, (R, C)).astype(np.int32)
    positions = starts[:, None] + np.arange(C, dtype=np.int32)[None]
    args = tuple(map(jnp.asarray, (tokens, positions))) + (cache,) + tuple(map(jnp.asarray, (starts, table, lengths)))
    outs = {a: jax.jit(_paged_forward, static_argnames=("config", "attention"))(params, *args, config=config,
                                                                               attention=a)
            for a in ("xla", "pallas")}
    (h_xla, c_xla), (h_pallas, c_pallas) = outs["xla"], outs["pallas"]
    real = np.arange(C)[None, :] < lengths[:, None]
    np.testing.assert_allclose(np.asarray(h_pallas)[real], np.asarray(h_xla)[real], atol=1e-5, rtol=1e-5)
    for a, b in zip(c_pallas.k + c_pallas.v, c_xla.k + c_xla.v, strict=True):  # layer 2 on: from layer 1's output
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        _paged_forward(params, *args, config=config, attention="triton")
    with pytest.raises(ValueError, match="needs a page_table and write_len"):
        forward(params, *args[:4], AttentionPlan(config, jnp.float32, prefill_attention="pallas"), attend_len=8)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel at the 1.7B head shapes: GPU only (interpreted: minutes)")
@pytest.mark.parametrize("P,block_k", [(32, 32), (32, 64), (16, 64)])
def test_kernel_bf16_at_the_qwen3_1_7b_head_shapes(P, block_k):
    """bf16, 8 kv heads x 2 query heads x 128, rows of 64 tokens reaching 64 to ~1000 entries:
    within bf16 rounding of the float64 reference (the XLA path's own bf16 error is as large)."""
    rng = np.random.default_rng(P + block_k)
    C, Tp = 64, 1024 // P
    starts, lengths = [0, 100, 1024 - 64, 37, 500, 0], [64, 64, 64, 10, 1, 0]
    case = random_case(rng, R=6, C=C, KV=8, G=2, K=128, P=P, Tp=Tp, starts=starts, lengths=lengths)
    q, k_pool, v_pool = (jnp.asarray(x, jnp.bfloat16) for x in case[:3])
    got = prefill_attention(q, k_pool, v_pool, *map(jnp.asarray, case[3:]), block_k=block_k)
    want = numpy_reference(*(np.asarray(x, np.float32) for x in (q, k_pool, v_pool)), *case[3:])
    real = np.arange(C)[None, :] < np.asarray(lengths)[:, None]
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], atol=3e-2, rtol=3e-2)
