"""The driver's prefill as a closed set of compiled shapes: rows cut into fixed-width pieces equal
one row per sequence, `Driver.warmup` compiles every program a run meets, and the prefill
program writes the KV pool in place."""

import asyncio

import jax
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW

from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.paged_prefill import (
    Admission,
    PrefillRow,
    empty_pack,
    rows_bucket,
    window_pages,
)
from agentrl_jax.rollout.prefill_api import PrefillShape
from agentrl_jax.rollout.sampling import SamplingParams, request_key
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml


def one_device_engine(tiny_model, **kw):
    return Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **{**ENGINE_KW, **kw})


def programs(engine) -> int:
    return engine.compiled_programs()


async def workload(driver, seed: int, top_p: float = 1.0):
    """Groups sharing a prompt, a prompt longer than max_prefill_length (chunks over ticks), and
    three-turn sessions (sampling with ``top_p``): every row kind (fresh, shared with page copies,
    chunk, continuation)."""
    rng = np.random.default_rng(seed)

    async def session(i):
        s, out = driver.session(), []
        prompt = rng.integers(1, 128, int(rng.integers(3, 12))).tolist()
        try:
            for _ in range(3):
                c = await driver.generate(prompt, SamplingParams(1.0, top_p=top_p, seed=seed * 10 + i), max_new_tokens=5, session=s)
                out.append((c.token_ids, c.logprobs))
                prompt = rng.integers(1, 128, int(rng.integers(1, 7))).tolist()
        finally:
            s.close()
        return out

    group = driver.generate_group([5, 9, 14, 2, 77, 31, 8], 3, SamplingParams(1.0, seed=seed), max_new_tokens=6)
    long = driver.generate(rng.integers(1, 128, 40).tolist(), SamplingParams(0.0), max_new_tokens=4)
    results = await asyncio.gather(group, long, *(session(i) for i in range(3)))
    group_out = [(c.token_ids, c.logprobs) for c in results[0]]
    return [group_out, [(results[1].token_ids, results[1].logprobs)], *results[2:]]


def run(engine, model, coro_fn):
    async def main():
        async with Driver(engine, model, steps_per_dispatch=4) as driver:
            return await coro_fn(driver)

    return asyncio.run(main())


def test_shape_buckets():
    assert [rows_bucket(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    assert [rows_bucket(n, cap=12) for n in (5, 9, 12, 13)] == [8, 12, 12, 16]  # the cap holds what fits
    assert [window_pages(r, page_size=32, floor=32, table_width=80) for r in (1, 1024, 1025, 2048, 2049)] == [
        32, 32, 64, 64, 80]


def test_the_prefill_kernel_needs_one_window(tiny_model):
    """The pallas prefill reads each row up to its own reach: its shapes are the (rows, computed
    tokens) layouts at the table's full width, a third of the XLA path's programs here (windows
    16, 32, 64 pages). Rows 1 and 2 compute their rows; 4 rows compact to 2, 3 or 4 rows' worth."""
    kw = dict(page_size=4, max_target_length=256, max_prefill_length=64, prefill_row_tokens=16, prefill_compaction=True)
    xla = one_device_engine(tiny_model, prefill_attention="xla", **kw).prefill_shapes(64)
    kernel = one_device_engine(tiny_model, prefill_attention="pallas", **kw).prefill_shapes(64)
    layouts = [(1, 16), (2, 32), (4, 32), (4, 48), (4, 64)]
    assert sorted({s.window for s in xla}) == [16, 32, 64] and len(xla) == 3 * len(layouts)
    assert kernel == [PrefillShape(r, 16, 64, n) for r, n in layouts]


@pytest.mark.slow  # ~20 s on 2 CPU cores; pieces are also checked against teacher forcing in test_rollout_paged
def test_pieces_of_a_row_equal_one_row_per_sequence(tiny_model):
    """The same driver workload with rows cut into pieces of 4 tokens and with one piece per
    sequence (width 32 = max_prefill_length, the earlier layout): same tokens, logprobs within 1e-5."""
    got = run(one_device_engine(tiny_model, page_size=5, prefill_row_tokens=4), tiny_model,
              lambda d: workload(d, 3))
    want = run(one_device_engine(tiny_model, page_size=5, prefill_row_tokens=32), tiny_model,
               lambda d: workload(d, 3))
    for a, b in zip(got, want):
        for (tokens_a, logp_a), (tokens_b, logp_b) in zip(a, b):
            assert tokens_a == tokens_b
            np.testing.assert_allclose(logp_a, logp_b, atol=1e-5)


@pytest.mark.slow  # ~10-20 s on 2 CPU cores (it compiles every program of the set)
@pytest.mark.parametrize("truncation", [False, True])
def test_warmup_compiles_every_program_a_run_meets(tiny_model, truncation):
    """After `Driver.warmup` a run of groups, chunked prompts and sessions compiles nothing; the
    warm-up reports the closed set's size. With top-p sessions, ``warmup(truncation=True)``
    compiles each program twice (with and without the sorted sampling path) and the run meets both."""
    engine = one_device_engine(tiny_model, page_size=5)

    async def main(driver):
        stats = await driver.warmup(truncation=truncation)
        before = programs(engine)
        await workload(driver, 1, top_p=0.9 if truncation else 1.0)
        return stats, before, programs(engine)

    stats, before, after = run(engine, tiny_model, main)
    budget = 4 * engine.max_prefill_length
    variants = 2 if truncation else 1
    assert stats["prefill_shapes"] == len(engine.prefill_shapes(budget)) == len(engine._paged_prefill_fns) // variants
    assert after == before, "a tick compiled a program that warm-up did not"
    assert {key[-1] for key in engine._generate_fns} == ({False, True} if truncation else {False})


def test_decode_and_prefill_programs_have_no_device_conditional(tiny_model):
    """No `lax.cond` on a device value in the programs a driver tick launches: on GPU, XLA runs a
    conditional it leaves outside its CUDA graphs on the host (the predicate copied back, the
    launching thread waiting for the device). The top-k / top-p sampling cond, once per decode
    step, did that and made every dispatch synchronous (the device idled while the host prepared
    the next one)."""
    engine = one_device_engine(tiny_model, page_size=5)
    params, state = engine.load_params(tiny_model), engine.init_decode_state()
    for truncation in (False, True):
        texts = [engine._generate_fn(4, engine.table_width * engine.page_size, truncation).lower(params, state).as_text()]
        fn, args = engine._prefill_call(params, state, empty_pack(rows=2, row_tokens=engine.prefill_row_tokens,
                                                                  window=4, num_slots=engine.max_concurrent_decodes),
                                        truncation)
        texts.append(fn.lower(*args).as_text())
        for text in texts:
            assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_prefill_program_writes_the_pool_in_place(tiny_model):
    """The compiled prefill holds no copy of a KV pool. With the group's page copies inside it, XLA
    copied every layer's whole pool twice per call to order the copies after the attention reads
    (on an H200 ~20 ms a call at a 17.5 GB pool, whatever the tokens)."""
    engine = one_device_engine(tiny_model, page_size=5)
    params, state = engine.load_params(tiny_model), engine.init_decode_state()
    shared, last = engine.pages.alloc(0, 1), engine.pages.alloc(0, 1)
    own = engine.pages.alloc(0, 1)
    engine.pages.incref(0, shared)
    admissions = [Admission(s, shared + p, np.asarray(request_key(0, s)), 0, SamplingParams(1.0))
                  for s, p in ((0, last), (1, own))]
    row = PrefillRow(0, shared + last, 0, np.arange(1, 8, dtype=np.int32), admissions, copies=[(last[0], own[0])])
    packed = engine._pack([row], None)
    fn, args = engine._prefill_call(params, state, packed)
    hlo = fn.lower(*args).compile().as_text()
    pool = state.cache.k[0]
    pool_type = f"{pool.dtype.name[0]}{pool.dtype.itemsize * 8}[{','.join(map(str, pool.shape))}]"
    copies = [line for line in hlo.splitlines() if pool_type in line and " copy(" in line]
    assert not copies, copies[:2]


def test_padding_rows_and_copies_write_nothing(tiny_model):
    """Padding rows and padding page copies leave every page alone, the trash page included, and
    the real writes and copies still land. (They used to write the trash page: colliding writes,
    which XLA's GPU scatter serializes; the writes are now declared unique, which only holds if
    padding writes nowhere.)"""
    engine = one_device_engine(tiny_model, page_size=5, prefill_row_tokens=3)
    params, state = engine.load_params(tiny_model), engine.init_decode_state()
    src, dst = engine.pages.alloc(0, 2), engine.pages.alloc(0, 1)
    row = PrefillRow(0, src, 0, np.arange(1, 8, dtype=np.int32), copies=[(src[1], dst[0])])
    packed = engine._pack([row], row_cap=4)  # three pieces, one padding row, padding copies
    assert packed.tokens.shape[0] == 4 and packed.copy_dst.size > 1
    before = [np.asarray(x) for x in state.cache.k + state.cache.v]
    state, _ = engine._run_prefill(params, state, packed)
    after = [np.asarray(x) for x in state.cache.k + state.cache.v]
    written = set(src) | set(dst)
    for b, a in zip(before, after, strict=True):
        untouched = [p for p in range(b.shape[0]) if p not in written]
        np.testing.assert_array_equal(a[untouched], b[untouched])  # the trash page (0) among them
        assert np.abs(a[src[0]]).sum() > 0
        np.testing.assert_array_equal(a[dst[0]], a[src[1]])  # the copy-on-write landed
