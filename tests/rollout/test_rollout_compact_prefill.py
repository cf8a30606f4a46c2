"""The compacted prefill (`paged_prefill.CompactTokens`): the token buckets, and `prefill_insert`
with compaction equal to without it (first tokens, logprobs, every page of the KV pool), on one
device and over data shards."""

import itertools
import re

import jax
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW

from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.paged_prefill import (
    Admission,
    PrefillRow,
    empty_pack,
    tokens_bucket,
)
from agentrl_jax.rollout.sampling import SamplingParams, request_key
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

KW = {**ENGINE_KW, "max_concurrent_decodes": 32, "max_target_length": 128, "max_prefill_length": 64,
      "prefill_row_tokens": 16, "page_size": 5,  # pages of 5: no row's reach is a whole number of pages
      "prefill_compaction": True}  # (the default on GPU and TPU meshes only)


def test_tokens_bucket_hand_values():
    """k x C for k on 2, 3, 4, 6, 8, 12, 16: at least 2 rows' worth and rows / 4, at most the rows."""
    C = 64
    tokens = (1, 256, 257, 264, 385, 513, 769, 1024)
    assert [tokens_bucket(t, 16, C) // C for t in tokens] == [4, 4, 6, 6, 8, 12, 16, 16]
    assert [tokens_bucket(t, 8, C) // C for t in (1, 128, 129, 193, 264, 385, 512)] == [2, 2, 3, 4, 6, 8, 8]
    assert [tokens_bucket(t, 2, C) // C for t in (1, 128)] == [2, 2]  # two rows: computed as they are
    assert tokens_bucket(100, 12, 10) == 120  # a row cap of 12: 3, 4, 6, 8, then the 12 rows themselves
    assert tokens_bucket(81, 12, 10) == 120 and tokens_bucket(80, 12, 10) == 80


def test_compaction_is_on_by_default_on_accelerators_only(tiny_model):
    """Off on a CPU mesh (compiling the extra programs costs more than the compute they save there),
    on on a GPU or TPU one; asking for it turns it on anywhere."""
    on_accelerator = jax.devices()[0].platform != "cpu"
    default = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **ENGINE_KW).prefill_compaction
    assert default == on_accelerator
    assert Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), prefill_compaction=True,
                  **ENGINE_KW).prefill_compaction


def test_shape_counts_of_the_default_and_the_benchmark_engines(tiny_model):
    """The compiled set: (rows, tokens) layouts x windows; compaction adds <= 4 token buckets per row bucket."""
    mesh = make_mesh({"data": 1}, jax.devices()[:1])
    bench = dict(max_prefill_length=256, max_target_length=2560, max_concurrent_decodes=64)
    for kw, budget, rows_only, compacted in [({}, 2048, 6, 20), (bench, 1024, 5, 15)]:
        for compaction, count in ((False, rows_only), (True, compacted)):
            shapes = Engine(tiny_model, mesh=mesh, prefill_compaction=compaction, prefill_attention="pallas",
                            **kw).prefill_shapes(budget)
            assert len(shapes) == count
            assert all(s.tokens <= s.rows * s.row_tokens and s.tokens % s.row_tokens == 0 for s in shapes)


def run_calls(engine, model):
    """Two prefill calls, rows spread over the shards. Call 1: a group of 3 sharing a 23-token prompt
    (2 pieces, its last page copied twice), a 40-token prompt (3 pieces) and a session's first 7
    tokens. Call 2: the session's next turn (its sampled token and 4 more, from entry 7) and eight
    3-token prompts. Returns per call the admissions' first tokens and logprobs, every layer's k and
    v pool after it, and its `PrefillShape`."""
    D, P = engine.num_shards, engine.page_size
    params, state = engine.load_params(model), engine.init_decode_state()
    free = {d: list(engine.shard_slots(d)) for d in range(D)}
    rng, samples = np.random.default_rng(0), itertools.count()

    def admission(shard, pages, generated=0):  # keys by admission, not slot: the same on any mesh
        return Admission(free[shard].pop(0), pages, np.asarray(request_key(7, next(samples))), generated,
                         SamplingParams(1.0))

    def fresh(shard, n):
        pages = engine.pages.alloc(shard, -(-n // P))
        return PrefillRow(shard, pages, 0, rng.integers(1, 128, n).astype(np.int32), [admission(shard, pages)])

    group_pages = engine.pages.alloc(0, 5)  # 23 tokens: 4 full pages shared, the partial one copied
    group = PrefillRow(0, group_pages, 0, rng.integers(1, 128, 23).astype(np.int32), [admission(0, group_pages)])
    for _ in range(2):
        engine.pages.incref(0, group_pages[:4])
        own = engine.pages.alloc(0, 1)
        group.copies.append((group_pages[4], own[0]))
        group.admissions.append(admission(0, group_pages[:4] + own))
    session = fresh(0, 7)
    rows = [group, fresh(1 % D, 40), session]
    results = []
    for call in range(2):
        state, first = engine.prefill_insert(params, state, rows)
        M = sum(len(r.admissions) for r in rows)
        tokens, logprobs = np.asarray(first.tokens)[:M], np.asarray(first.log_prob)[:M]
        results.append((tokens, logprobs, [np.asarray(x) for x in state.cache.k + state.cache.v],
                        engine.prefill_shape(rows)))
        if call == 0:  # the session's next turn
            slot = session.admissions[0].slot
            sampled = tokens[[a.slot for r in rows for a in r.admissions].index(slot)]
            pages = engine.pages.release_slot(slot, keep_pages=True)
            free[0].append(slot)
            pages += engine.pages.alloc(0, 3 - len(pages))
            turn = PrefillRow(0, pages, 7, np.asarray([sampled, 60, 61, 62, 63], np.int32))
            turn.admissions.append(admission(0, pages, generated=1))
            rows = [turn] + [fresh(d % D, 3) for d in range(1, 9)]
    return results


SHARDED = {"data": 2, "tensor": 2}


@pytest.mark.parametrize("mesh_shape,prefill_attention", [
    pytest.param({"data": 1}, "xla", id="one-device"),
    # ~10 s each; the default suite checks the sharded compacted call against one device's
    pytest.param(SHARDED, "xla", marks=pytest.mark.slow, id="data2-tensor2"),
    pytest.param(SHARDED, "pallas", marks=pytest.mark.slow, id="data2-tensor2-pallas"),  # interpreted off GPU
])
def test_compacted_prefill_equals_the_rows(tiny_model, mesh_shape, prefill_attention):
    """Compaction on and off: the same first tokens, logprobs within 1e-5 and every page of every
    layer's pools within 1e-5 (float32 on CPU; the dense matmuls have other shapes). Both calls are
    compacted (a group, pieces, a session's continuation; over 2 data shards too)."""
    size = int(np.prod(list(mesh_shape.values())))
    if jax.device_count() < size:
        pytest.skip(f"needs {size} devices")
    mesh = make_mesh(mesh_shape, jax.devices()[:size])
    kw = {**KW, "prefill_attention": prefill_attention}
    on = run_calls(Engine(tiny_model, mesh=mesh, **kw), tiny_model)
    off = run_calls(Engine(tiny_model, mesh=mesh, **{**kw, "prefill_compaction": False}), tiny_model)
    for (tokens, logprobs, pools, shape), (want_tokens, want_logprobs, want_pools, rows_shape) in zip(
            on, off, strict=True):
        assert shape.tokens < shape.rows * shape.row_tokens == rows_shape.tokens  # compacted
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)
        for got, want in zip(pools, want_pools, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert len({int(t) for t in on[0][0][:3]}) > 1, "the group's samples are identical"


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")
def test_sharded_compacted_prefill_equals_one_device(tiny_model):
    """Each data shard's compact tokens are its own block, indexed within its own rows: over data=4
    the rows (each call's spread over all 4 shards) give one device's first tokens and logprobs."""
    single = run_calls(Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **KW), tiny_model)
    sharded = run_calls(Engine(tiny_model, mesh=make_mesh({"data": 4}, jax.devices()[:4]), **KW), tiny_model)
    for (tokens, logprobs, _, shape), (want_tokens, want_logprobs, _, _) in zip(sharded, single, strict=True):
        assert shape.tokens < shape.rows * shape.row_tokens  # compacted: 4 blocks of n
        np.testing.assert_array_equal(tokens, want_tokens)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)


COLLECTIVE = re.compile(r" (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def collectives(hlo: str) -> list[str]:
    return sorted(COLLECTIVE.findall(hlo))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_compacted_program_moves_nothing_between_data_shards(tiny_model):
    """On data=4 x tensor=2 the compacted program's collectives are the rows' program's (the tensor
    axis' all-reduces, the admissions' gather), on fewer tokens: the scatter into the rows and the
    gather back run inside each shard."""
    programs = {}
    for compaction in (False, True):
        engine = Engine(tiny_model, mesh=make_mesh({"data": 4, "tensor": 2}), **{**KW, "prefill_compaction": compaction})
        params, state = engine.load_params(tiny_model), engine.init_decode_state()
        shape = min((s for s in engine.prefill_shapes(256) if s.rows == 16), key=lambda s: s.tokens)
        packed = empty_pack(rows=shape.rows, row_tokens=shape.row_tokens, window=shape.window,
                            num_slots=engine.max_concurrent_decodes, tokens=shape.tokens)
        assert (packed.compact is not None) == compaction
        fn, args = engine._prefill_call(params, state, packed)
        programs[compaction] = collectives(fn.lower(*args).compile().as_text())
    assert programs[True] == programs[False] and "all-reduce" in programs[True]
