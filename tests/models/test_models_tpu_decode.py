"""The TPU paged decode attention kernel (`models/tpu_decode_attention.py`), in Pallas's TPU
interpreter: a NumPy reference, invariances, and `forward` with it == the XLA paged path."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models_helpers import SMALL_QWEN3

from agentrl_jax.models import Decoder
from agentrl_jax.models.decode import AttentionPlan, forward
from agentrl_jax.models.decode_params import LayerCache, to_decode_params
from agentrl_jax.models.tpu_decode_attention import (
    paged_decode_attention,
    pages_per_block_for,
    tpu_kernel_fits,
)
from agentrl_jax.sharding import make_mesh

P, TP, KV, K = 8, 4, 2, 16  # page size, table width, kv heads, head dim
LENGTHS = np.array([27, 9, 1, 0, TP * P, 8], np.int32)  # ragged, not multiples of P, one entry, inactive, full


def _reference(q, k_pool, v_pool, lengths, table):
    """float64 attention of each row over its entries gathered one by one through the table."""
    out = np.zeros(q.shape, np.float64)
    for b, length in enumerate(lengths):
        entries = np.arange(length)
        k = k_pool[table[b, entries // P], :, entries % P].astype(np.float64)  # [L, KV, K]
        v = v_pool[table[b, entries // P], :, entries % P].astype(np.float64)
        logits = np.einsum("ngk,lnk->ngl", q[b].astype(np.float64), k) / np.sqrt(q.shape[-1])
        if length:
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            out[b] = np.einsum("ngl,lnk->ngk", probs / probs.sum(-1, keepdims=True), v)
    return out


def _inputs(G, dtype=np.float32, seed=0):
    """Pools whose every entry outside the rows' lengths is NaN (a masked entry must not leak),
    rows' pages shuffled over the pool, and table entries past a row's pages out of range
    (clamped by the kernel: the interpreter raises on an out-of-bounds copy)."""
    rng = np.random.default_rng(seed)
    B = len(LENGTHS)
    N = B * TP + 1
    table = (1 + rng.permutation(B * TP)).reshape(B, TP).astype(np.int32)
    k_pool, v_pool = (np.full((N, KV, P, K), np.nan, np.float32) for _ in range(2))
    for b, length in enumerate(LENGTHS):
        entries = np.arange(length)
        for pool in (k_pool, v_pool):
            pool[table[b, entries // P], :, entries % P] = rng.normal(size=(length, KV, K))
        table[b, -(-length // P):] = N + 7 if b % 2 else -3
    q = rng.normal(size=(B, KV, G, K)).astype(np.float32)
    cast = lambda x: jnp.asarray(x).astype(dtype)
    return cast(q), cast(k_pool), cast(v_pool), table


@pytest.mark.parametrize("G,pages_per_block", [(1, 1), (2, 2), (4, 4)])
def test_kernel_matches_a_numpy_reference(G, pages_per_block):
    """float32 pools, ragged lengths, a row of one entry (its value, exactly), an inactive row (zeros)."""
    q, k_pool, v_pool, table = _inputs(G)
    got = np.asarray(paged_decode_attention(q, k_pool, v_pool, jnp.asarray(LENGTHS), jnp.asarray(table),
                                            pages_per_block=pages_per_block))
    want = _reference(*map(np.asarray, (q, k_pool, v_pool)), LENGTHS, table)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[2], np.broadcast_to(np.asarray(v_pool)[table[2, 0], :, 0][:, None], got[2].shape))
    np.testing.assert_array_equal(got[3], 0.0)


def test_kernel_reads_a_bf16_pool_in_bf16():
    """A bf16 pool and queries: the reference on the same bf16 values, to bf16 rounding."""
    q, k_pool, v_pool, table = _inputs(2, jnp.bfloat16, seed=1)
    got = paged_decode_attention(q, k_pool, v_pool, jnp.asarray(LENGTHS), jnp.asarray(table), pages_per_block=2)
    assert got.dtype == jnp.bfloat16
    want = _reference(*(np.asarray(x.astype(jnp.float32)) for x in (q, k_pool, v_pool)), LENGTHS, table)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_kernel_ignores_page_ids_and_block_size():
    """Relabelling the pool's pages (and the table with them) and reading 1 or 4 pages per
    step give the same result."""
    q, k_pool, v_pool, table = _inputs(2, seed=2)
    lengths = jnp.asarray(LENGTHS)
    want = paged_decode_attention(q, k_pool, v_pool, lengths, jnp.asarray(table), pages_per_block=4)
    relabel = np.random.default_rng(3).permutation(k_pool.shape[0])  # new id of page p: relabel[p]
    inverse = np.argsort(relabel)
    valid = (table >= 0) & (table < k_pool.shape[0])
    new_table = np.where(valid, relabel[np.clip(table, 0, k_pool.shape[0] - 1)], table).astype(np.int32)
    got = paged_decode_attention(q, k_pool[inverse], v_pool[inverse], lengths, jnp.asarray(new_table),
                                 pages_per_block=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_kernel_shape_rules():
    assert [pages_per_block_for(w, 4) for w in (16, 6, 5, 3, 1)] == [4, 3, 1, 3, 1]
    assert tpu_kernel_fits(128, 16, jnp.bfloat16) and tpu_kernel_fits(256, 8, jnp.float32)
    assert not tpu_kernel_fits(128, 8, jnp.bfloat16)  # half a bf16 sublane tile
    assert not tpu_kernel_fits(64, 32, jnp.bfloat16)  # half the lanes
    q, k_pool, v_pool, table = _inputs(2)
    lengths = jnp.asarray(LENGTHS)
    with pytest.raises(ValueError, match="pages_per_block=3"):
        paged_decode_attention(q, k_pool, v_pool, lengths, jnp.asarray(table), pages_per_block=3)
    with pytest.raises(ValueError, match="pools"):
        paged_decode_attention(q, k_pool[:, :1], v_pool[:, :1], lengths, jnp.asarray(table))
    with pytest.raises(ValueError, match="rows"):
        paged_decode_attention(q, k_pool, v_pool, lengths[:2], jnp.asarray(table))


def _decode_steps(cfg, params, cache, table, lengths, tokens, *, attention, steps=2, mesh=None, cache_spec=None):
    """``steps`` greedy decode steps from ``lengths`` (float32): hidden states and the final cache."""
    plan = AttentionPlan(cfg, jnp.float32, attention, mesh=mesh, cache_spec=cache_spec)
    step = jax.jit(functools.partial(forward, plan=plan, attend_len=table.shape[1] * P))
    hiddens = []
    for _ in range(steps):
        hidden, cache = step(params, tokens, lengths[:, None], cache, lengths, page_table=table)
        hiddens.append(np.asarray(hidden))
        tokens = jnp.argmax(hidden @ params.embed.T, -1).astype(jnp.int32)
        lengths = lengths + 1
    return np.stack(hiddens), cache


def _paged_setup(cfg, B):
    rng = np.random.default_rng(4)
    params = to_decode_params(cfg, nnx.state(Decoder(cfg, rngs=nnx.Rngs(5)), nnx.Param))
    N = B * TP + 1
    cache = LayerCache.init(cfg, N, P, jnp.float32).map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype))
    table = jnp.asarray((1 + rng.permutation(B * TP)).reshape(B, TP), jnp.int32)
    lengths = jnp.asarray(rng.integers(0, TP * P - 3, B), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 1)), jnp.int32)
    return params, cache, table, lengths, tokens


def test_forward_with_the_tpu_kernel_equals_the_xla_paged_path():
    """Two decode steps on a paged cache (random prefix entries, shuffled pages, ragged
    lengths): hidden states and every layer's pool equal the XLA path's."""
    cfg = dataclasses.replace(SMALL_QWEN3, num_layers=1)  # one layer: the interpreter's compile is the cost
    params, cache, table, lengths, tokens = _paged_setup(cfg, B=3)
    got, got_cache = _decode_steps(cfg, params, cache.map(jnp.copy), table, lengths, tokens, attention="pallas_tpu")
    want, want_cache = _decode_steps(cfg, params, cache, table, lengths, tokens, attention="xla")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_cache.k + got_cache.v, want_cache.k + want_cache.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)  # later steps' keys: ulps apart
    with pytest.raises(ValueError, match="page_table"):
        forward(params, tokens, lengths[:, None], cache, lengths, AttentionPlan(cfg, jnp.float32, "pallas_tpu"),
                attend_len=8)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharded_forward_with_the_tpu_kernel_equals_one_device():
    """Rows over ('data', 2) and kv heads over ('tensor', 2): the kernel runs per shard under
    `shard_map`, each shard reading its own pool pages (local page ids)."""
    cfg = SMALL_QWEN3
    params, cache, table, lengths, tokens = _paged_setup(cfg, B=4)
    want, _ = _decode_steps(cfg, params, cache.map(jnp.copy), table, lengths, tokens, attention="xla")
    mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])
    # shard s holds rows 2s, 2s + 1 and their pages: the pool is the shards' pools stacked, ids local
    rows = np.asarray(table)
    local = np.zeros_like(rows)
    pools = []
    for shard in range(2):
        pages = np.concatenate([[0], rows[2 * shard:2 * shard + 2].reshape(-1)])
        local[2 * shard:2 * shard + 2] = np.arange(1, len(pages)).reshape(2, TP)
        pools.append(cache.map(lambda x, pages=pages: x[pages]))
    stacked = LayerCache(k=tuple(jnp.concatenate(x) for x in zip(*(p.k for p in pools))),
                         v=tuple(jnp.concatenate(x) for x in zip(*(p.v for p in pools))))
    spec = jax.sharding.PartitionSpec("data", "tensor")
    got, _ = _decode_steps(cfg, params, stacked, jnp.asarray(local), lengths, tokens, attention="pallas_tpu",
                           mesh=mesh, cache_spec=spec)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,page_size,G", [(jnp.bfloat16, 32, 2), (jnp.float32, 16, 1)])
def test_kernel_lowers_to_mosaic_for_a_tpu(dtype, page_size, G):
    """Exported for a TPU target (an abstract TPU v5e device): Pallas's Mosaic lowering rules
    accept the kernel at Qwen3-like shapes (scalar prefetch, DMAs, semaphores, the loop).
    Mosaic's own compile (layouts, tiling) runs only in libtpu, on a TPU: not checked here."""
    device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    B, KV, N, Tp, K = 8, 4, 64, 16, 128
    kernel = jax.jit(functools.partial(paged_decode_attention, pages_per_block=4, interpret=False))
    shapes = [((B, KV, G, K), dtype), ((N, KV, page_size, K), dtype), ((N, KV, page_size, K), dtype),
              ((B,), jnp.int32), ((B, Tp), jnp.int32)]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        exported = jax.export.export(kernel, platforms=["tpu"])(*(jax.ShapeDtypeStruct(*s) for s in shapes))
    assert "tpu_custom_call" in exported.mlir_module()
