"""Paged KV cache: the allocator, paged decoding == teacher forcing, shared prefixes, sessions
that keep their pages, preemption, the budget and its errors, and a randomized no-leak run."""

import asyncio
import random

import jax
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW, make_model, teacher_forced

from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.paged_prefill import Admission, PrefillRow
from agentrl_jax.rollout.pages import TRASH_PAGE, OutOfPages, PageAllocator
from agentrl_jax.rollout.sampling import SamplingParams, request_key
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 17, 42, 8, 99, 5, 60]  # 7 tokens: page sizes 3 and 5 divide neither it nor 4-step turns
ONE_DEVICE = dict(mesh=None)
LOGP_ATOL = 2e-2 if jax.default_backend() == "gpu" else 1e-5  # the Pallas kernels' float32 dots: TF32 on GPU


def one_device_engine(tiny_model, **kw):
    return Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **{**ENGINE_KW, **kw})


@pytest.fixture(scope="module")
def paged(tiny_model):
    """Pages of 5 tokens (divides no prompt or turn length used here)."""
    return one_device_engine(tiny_model, page_size=5)


def test_allocator_refcounts_and_trash():
    pages = PageAllocator(num_shards=2, pages_per_shard=4)
    assert pages.usable_pages == 3 and pages.num_free(0) == 3
    got = pages.alloc(0, 3)
    assert TRASH_PAGE not in got and sorted(got) == [1, 2, 3]
    with pytest.raises(OutOfPages):
        pages.alloc(0, 1)
    assert pages.num_free(1) == 3  # shards are separate
    pages.incref(0, got[:1])
    pages.release(0, got)
    assert pages.num_free(0) == 2 and pages.refcount(0, got[0]) == 1
    pages.release(0, got[:1])
    assert pages.num_free(0) == 3 and pages.num_used() == 0
    with pytest.raises(RuntimeError, match="nobody holds"):
        pages.release(0, got[:1])
    with pytest.raises(RuntimeError, match="nobody holds"):
        pages.incref(1, [TRASH_PAGE])


def greedy_reference(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(np.asarray(model.logits(teacher_forced(model, seq))[0, -1]))))
    return seq[len(prompt):]


def trainer_logprobs(model, prompt, generated):
    from agentrl_jax.losses.logprobs import token_logprobs

    seq = np.concatenate([prompt, generated]).astype(np.int32)
    hidden = teacher_forced(model, seq)
    table, layout = model.output_embedding()
    logp = token_logprobs(hidden[:, :-1], table, jax.numpy.asarray(seq[1:])[None], temperature=1.0,
                          embedding_layout=layout)
    return np.asarray(logp[0, len(prompt) - 1:])


@pytest.mark.parametrize("page_size", [3, 5])
def test_paged_decoding_equals_teacher_forcing(tiny_model, page_size):
    """prefill_insert into pages of 3 / 5 tokens, then 3 dispatches of 4 steps: greedy tokens are
    the teacher-forced argmax, logprobs the trainer's within 1e-5 (float32). With pages of 3 the
    7-token prompt is cut into packed rows of 4 tokens (`prefill_row_tokens`): two pieces of one
    sequence in one call."""
    engine = one_device_engine(tiny_model, page_size=page_size, prefill_row_tokens=4 if page_size == 3 else 64)
    params = engine.load_params(tiny_model)
    state = engine.init_decode_state()
    pages = engine.pages.alloc(0, 3)  # 7 prompt tokens (+ room) over 3 pages
    admission = Admission(slot=2, pages=pages, key=np.asarray(request_key(0, 0)), generated=0, sampling=GREEDY)
    row = PrefillRow(shard=0, pages=pages, start=0, tokens=np.asarray(PROMPT, np.int32), admissions=[admission])
    state, first = engine.prefill_insert(params, state, [row])
    tokens, logprobs = [int(first.tokens[0])], [float(first.log_prob[0])]
    for _ in range(3):
        state, result = engine.generate(params, state, num_steps=4)
        tokens += np.asarray(result.tokens[:, 2]).tolist()
        logprobs += np.asarray(result.log_prob[:, 2]).tolist()
    assert len(engine.pages.slot_pages(2)) == -(-(len(PROMPT) + 12) // page_size)  # pages grew as it decoded
    assert tokens == greedy_reference(tiny_model, PROMPT, len(tokens))
    np.testing.assert_allclose(logprobs, trainer_logprobs(tiny_model, PROMPT, tokens), atol=1e-5)


def drive(engine, model, coro_fn, **kw):
    async def main():
        async with Driver(engine, model, steps_per_dispatch=4, **kw) as driver:
            return await coro_fn(driver)

    return asyncio.run(main())


def test_group_shares_the_prompt_pages_and_equals_separate_prefills(paged, tiny_model):
    """One prefill for G=4 samples: full pages shared (refcount 4), the partial page copied per
    sample; tokens and logprobs equal 4 prefills of their own with the same keys."""
    params = paged.load_params(tiny_model)
    sampler = SamplingParams(temperature=1.0, seed=11)
    keys = [np.asarray(request_key(11, g)) for g in range(4)]
    prompt = np.asarray(PROMPT, np.int32)

    def decode(rows_for):
        state = paged.init_decode_state()
        state, first = paged.prefill_insert(params, state, rows_for(paged))
        tokens = [[int(t)] for t in np.asarray(first.tokens)[:4]]
        shared_refs = paged.pages.refcount(0, paged.pages.slot_pages(0)[0])
        for _ in range(2):
            state, result = paged.generate(params, state, num_steps=4)
            for g in range(4):
                tokens[g] += np.asarray(result.tokens[:, g]).tolist()
        return tokens, shared_refs, paged.pages.num_used()

    def group(engine):
        pages = engine.pages.alloc(0, 2)  # 7 tokens: one full page of 5, one partial
        engine.pages.incref(0, pages[:1] * 3)
        row = PrefillRow(0, pages, 0, prompt, admissions=[], copies=[])
        for g in range(4):
            own = [pages[1]] if g == 0 else engine.pages.alloc(0, 1)
            if g:
                row.copies.append((pages[1], own[0]))
            row.admissions.append(Admission(g, [pages[0]] + own, keys[g], 0, sampler))
        return [row]

    def separate(engine):
        rows = []
        for g in range(4):
            pages = engine.pages.alloc(0, 2)
            rows.append(PrefillRow(0, pages, 0, prompt, admissions=[Admission(g, pages, keys[g], 0, sampler)]))
        return rows

    shared, refs, used_shared = decode(group)
    alone, alone_refs, used_alone = decode(separate)
    assert shared == alone
    assert len({tuple(t) for t in shared}) > 1, "group samples are identical"
    assert refs == 4 and alone_refs == 1 and used_shared < used_alone


def test_driver_group_and_identical_prompts_prefill_once(paged, tiny_model):
    """generate_group and 4 concurrent generate calls with one prompt: one prefill each, shared pages."""
    sampler = SamplingParams(temperature=1.0, seed=21)

    async def run(driver):
        group = await driver.generate_group(PROMPT, 4, sampler, max_new_tokens=6)
        shared_after_group = driver.shared_prefills
        lone = await driver.generate(PROMPT, sampler, max_new_tokens=6)
        together = await asyncio.gather(*(driver.generate(PROMPT, SamplingParams(1.0, seed=s), max_new_tokens=6)
                                          for s in (1, 2, 3)))
        return group, shared_after_group, lone, together, driver.shared_prefills, driver.pages_in_use()

    group, shared_group, lone, together, shared, used = drive(paged, tiny_model, run)
    assert shared_group == 3 and shared == 5  # 3 samples of the group, then 2 of the 3 concurrent prompts
    assert group[0].token_ids == lone.token_ids
    np.testing.assert_allclose(group[0].logprobs, lone.logprobs, atol=1e-6)
    assert len({tuple(c.token_ids) for c in together}) > 1
    assert used == 0


def test_session_keeps_its_pages_and_equals_prefill_from_scratch(paged, tiny_model):
    observation = [70, 71, 72, 73]

    async def run(driver):
        session = driver.session()
        turn1 = await driver.generate(PROMPT, GREEDY, max_new_tokens=5, session=session)
        pages_after_turn1 = list(session.pages)
        turn2 = await driver.generate(observation, GREEDY, max_new_tokens=6, session=session)
        held = driver.pages_in_use()
        session.close()
        scratch = await driver.generate(PROMPT + turn1.token_ids + observation, GREEDY, max_new_tokens=6)
        return turn1, pages_after_turn1, turn2, held, scratch, driver.pages_in_use()

    turn1, pages1, turn2, held, scratch, used = drive(paged, tiny_model, run)
    assert pages1 and held >= len(pages1)  # the session held its pages across the "tool call"
    assert turn2.token_ids == scratch.token_ids
    np.testing.assert_allclose(turn2.logprobs, scratch.logprobs, atol=1e-5)
    assert used == 0


def test_pallas_prefill_attention_first_tokens_equal_teacher_forcing():
    """The prefill attention kernel (`models.prefill_attention`, interpreted here) in
    `prefill_insert`: a 7-token prompt cut into pieces of 4 (pages of 3), then the next 5 tokens
    at entry 7 (mid-page) in a second call; each call's admitted first token is the
    teacher-forced argmax and its logprob the trainer's (on GPU within TF32's error: float32 dots
    run on the tensor cores there)."""
    model = make_model(0, head_dim=16)  # the Triton kernel's head dim: a power of two >= 16
    engine = one_device_engine(model, page_size=3, prefill_row_tokens=4, prefill_attention="pallas")
    params, state = engine.load_params(model), engine.init_decode_state()
    pages = engine.pages.alloc(0, 4)
    history = PROMPT + [70, 71, 72, 73, 74]
    for start, end, slot in ((0, 7, 0), (7, 12, 1)):
        admission = Admission(slot, pages, np.asarray(request_key(0, slot)), 0, GREEDY)
        engine.pages.incref(0, pages)  # the slot takes over a reference; the test keeps its own
        row = PrefillRow(0, pages, start, np.asarray(history[start:end], np.int32), admissions=[admission])
        state, first = engine.prefill_insert(params, state, [row])
        want_token = greedy_reference(model, history[:end], 1)
        assert int(first.tokens[0]) == want_token[0]
        want_logp = trainer_logprobs(model, history[:end], want_token)
        np.testing.assert_allclose(float(first.log_prob[0]), want_logp[0], atol=LOGP_ATOL)
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        one_device_engine(model, prefill_attention="triton")


@pytest.mark.slow
def test_pallas_prefill_attention_in_a_driver_session_equals_teacher_forcing():
    """The driver with the prefill kernel (interpreted): a 7-token prompt cut into pieces of 4
    in one call (pages of 3), then a session's next turn prefilled mid-page: greedy tokens are
    the teacher-forced argmax and logprobs the trainer's, as with the XLA prefill."""
    model = make_model(0, head_dim=16)
    engine = one_device_engine(model, page_size=3, prefill_row_tokens=4, prefill_attention="pallas")
    assert engine.prefill_attention == "pallas" and engine.decode_attention == "xla"
    observation = [70, 71, 72, 73, 74]

    async def run(driver):
        session = driver.session()
        turn1 = await driver.generate(PROMPT, GREEDY, max_new_tokens=4, session=session)
        turn2 = await driver.generate(observation, GREEDY, max_new_tokens=3, session=session)
        session.close()
        return turn1, turn2

    turn1, turn2 = drive(engine, model, run)
    assert turn1.token_ids == greedy_reference(model, PROMPT, 4)
    history = PROMPT + turn1.token_ids + observation
    assert turn2.token_ids == greedy_reference(model, history, 3)
    np.testing.assert_allclose(turn1.logprobs, trainer_logprobs(model, PROMPT, turn1.token_ids), atol=LOGP_ATOL)
    np.testing.assert_allclose(turn2.logprobs, trainer_logprobs(model, history, turn2.token_ids), atol=LOGP_ATOL)


@pytest.fixture(scope="module")
def tight_and_roomy(tiny_model):
    return one_device_engine(tiny_model, page_size=3, num_pages=12), one_device_engine(tiny_model, page_size=3)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
def test_preempted_sequences_equal_uninterrupted_ones(tiny_model, tight_and_roomy, temperature):
    """A pool of 12 pages of 3 tokens cannot hold 4 sequences of 7 + 20 tokens: the driver preempts
    and re-prefills; tokens and logprobs equal an engine with room for all."""
    prompts = [PROMPT, [1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2], [50, 51]]
    samplers = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]

    def run_on(engine):
        async def run(driver):
            out = await asyncio.gather(*(driver.generate(p, s, max_new_tokens=20) for p, s in zip(prompts, samplers)))
            return out, driver.preemptions, driver.pages_in_use()

        return drive(engine, tiny_model, run)

    tight, preemptions, used = run_on(tight_and_roomy[0])
    roomy, none, _ = run_on(tight_and_roomy[1])
    assert preemptions > 0 and none == 0 and used == 0
    for a, b in zip(tight, roomy):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "length"
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_request_that_can_never_fit_fails_alone(tiny_model):
    engine = one_device_engine(tiny_model, page_size=4, num_pages=10)  # 40 tokens of KV

    async def run(driver):
        ok = driver.generate(PROMPT, GREEDY, max_new_tokens=3)
        await driver.generate([1, 2], GREEDY, max_new_tokens=1)  # builds the state (and the memory plan)
        with pytest.raises(ValueError, match="KV pages"):
            await driver.generate(list(range(50, 95)), GREEDY, max_new_tokens=3)
        with pytest.raises(ValueError, match="max_target_length"):
            await driver.generate(list(range(64)), GREEDY)
        return await ok

    assert drive(engine, tiny_model, run).token_ids == greedy_reference(tiny_model, PROMPT, 3)


def test_budget_errors_name_the_field_and_the_plan_is_logged(tiny_model, caplog):
    with pytest.raises(ValueError, match="rollout.kv_cache_bytes"):
        one_device_engine(tiny_model, kv_cache_bytes=1000).init_decode_state()
    with pytest.raises(ValueError, match="page_size"):
        one_device_engine(tiny_model, page_size=0)
    with pytest.raises(ValueError, match="page_size=8"):
        one_device_engine(tiny_model, page_size=8, decode_attention="pallas")
    engine = one_device_engine(tiny_model, page_size=4)
    with caplog.at_level("INFO"):
        engine.init_decode_state()
    plan = engine.memory_plan
    assert "KV memory plan" in caplog.text
    # CPU reports no free memory: every slot at full length, plus one trash page
    assert plan.pages_per_shard == 4 * (64 // 4) + 1 and plan.tokens == 4 * 64
    per_token = 2 * 2 * 4 * 8 * 4  # K and V x layers x kv heads x head dim x float32
    assert plan.bytes_per_page == 4 * per_token
    engine = one_device_engine(tiny_model, page_size=4, kv_cache_bytes=20 * plan.bytes_per_page)
    engine.init_decode_state()
    assert engine.memory_plan.pages_per_shard == 20


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharded_paged_driver_equals_single_device(tiny_model):
    """Slots and pages over data=4 (one slot per shard), kv heads over tensor=2; a group, a session
    and plain requests decode exactly as on one device."""
    sharded = Engine(tiny_model, mesh=make_mesh({"data": 4, "tensor": 2}), page_size=5, **ENGINE_KW)
    assert sharded.num_shards == 4
    single = one_device_engine(tiny_model, page_size=5)
    sampler = SamplingParams(temperature=1.0, seed=3)

    async def run(driver):
        session = driver.session()
        first = await driver.generate(PROMPT, GREEDY, max_new_tokens=5, session=session)
        rest = await asyncio.gather(
            driver.generate([70, 71, 72], GREEDY, max_new_tokens=6, session=session),
            driver.generate(list(range(20, 40)), sampler, max_new_tokens=9),
            driver.generate([5, 6], GREEDY, max_new_tokens=7),
        )
        session.close()
        return [first, *rest]

    got = drive(sharded, tiny_model, run)
    want = drive(single, tiny_model, run)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize(("prefix_cache", "decode_batch"), [(False, None), (True, None), (False, 2)])
def test_randomized_no_leaks(tiny_model, prefix_cache, decode_batch):
    """Random arrivals, lengths, stops, multi-turn sessions, weight updates, cancellations and a
    tight page pool: every request is answered (or cancelled) and every page ends free (but the
    prefix cache's own); also with 2 decode lanes for the 4 slots (slots wait ready for a lane) and
    two-token stop strings given as tokens."""
    engine = one_device_engine(tiny_model, page_size=3, num_pages=12, decode_batch=decode_batch)
    other = make_model(1)
    rng = random.Random(0)
    pairs = random.Random(1)  # with lanes, stop strings of two tokens the device checks too (their own draws)
    outcomes = {"done": 0, "cancelled": 0, "error": 0}

    async def episode(driver, i):
        session = driver.session() if i % 2 else None
        prompt = [rng.randrange(1, 128) for _ in range(rng.randrange(1, 12))]
        try:
            for _ in range(rng.randrange(1, 4)):
                await asyncio.sleep(rng.random() * 0.01)
                completion = await driver.generate(
                    prompt, SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i),
                    stop_token_ids=[rng.randrange(128)], max_new_tokens=rng.randrange(1, 14), session=session,
                    stop_strings=[f"{pairs.randrange(128)} {pairs.randrange(128)}"] if decode_batch else (),
                )
                assert 1 <= len(completion.token_ids)
                prompt = [rng.randrange(1, 128) for _ in range(rng.randrange(1, 6))]
                if session is None:
                    break
            outcomes["done"] += 1
        except ValueError:
            outcomes["error"] += 1
        finally:
            if session is not None:
                session.close()

    async def run(driver):
        tasks = [asyncio.ensure_future(episode(driver, i)) for i in range(14)]
        await asyncio.sleep(0.05)
        await driver.update_params(other, version=1)
        for task in tasks[::5]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        outcomes["cancelled"] = sum(t.cancelled() for t in tasks)
        await driver.update_params(tiny_model, version=2)
        await driver.generate([1, 2, 3], GREEDY, max_new_tokens=2)  # one more tick: closed sessions released
        return driver.pages_in_use() - driver.stats().get("prefix_cache_pages", 0), driver.preemptions + driver.evictions

    used, pressure = drive(engine, tiny_model, run, prefix_cache=prefix_cache,
                           detokenize=lambda ids: " ".join(map(str, ids)), tokenize=lambda s: [int(t) for t in s.split()])
    assert used == 0
    assert sum(outcomes.values()) == 14 and outcomes["done"] > 0
    assert pressure > 0, "the pool never ran short: the test does not exercise preemption"


def test_rollout_config_page_fields_are_validated():
    from agentrl_jax.config import Config, ConfigError, apply_overrides

    with pytest.raises(ConfigError, match="rollout.page_size"):
        apply_overrides(Config(), ["rollout.page_size=24"])
    with pytest.raises(ConfigError, match="rollout.kv_cache_memory_fraction"):
        apply_overrides(Config(), ["rollout.kv_cache_memory_fraction=1.5"])
    with pytest.raises(ConfigError, match="rollout.prefill_token_budget"):
        apply_overrides(Config(), ["rollout.prefill_token_budget=10"])
    with pytest.raises(ConfigError, match="rollout.decode_batch"):
        apply_overrides(Config(), ["rollout.max_concurrent=8", "rollout.decode_batch=9"])
    rollout = apply_overrides(Config(), ["rollout.page_size=32", "rollout.kv_cache_bytes=1000000"]).rollout
    assert rollout.engine_kwargs() == {"decode_batch": None, "page_size": 32, "kv_cache_bytes": 1000000,
                                       "kv_cache_memory_fraction": None, "compilation_cache_dir": None,
                                       "decode_compiler_options": None}
    assert apply_overrides(Config(), ["rollout.decode_batch=16"]).rollout.engine_kwargs()["decode_batch"] == 16


def test_a_compilation_cache_dir_that_cannot_be_a_directory_fails_at_config_load(tmp_path):
    from agentrl_jax.config import Config, ConfigError, apply_overrides

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for bad in (blocker, blocker / "cache"):
        with pytest.raises(ConfigError, match="rollout.compilation_cache_dir"):
            apply_overrides(Config(), [f"rollout.compilation_cache_dir={bad}"])
    good = tmp_path / "new" / "cache"
    rollout = apply_overrides(Config(), [f"rollout.compilation_cache_dir={good}"]).rollout
    assert rollout.engine_kwargs()["compilation_cache_dir"] == str(good) and not good.exists()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton decode kernel runs on GPU only")
def test_pallas_paged_driver_matches_the_xla_one_on_gpu():
    """The fused kernel reading K/V through page tables (pages of 16, sessions, a group, preemption)
    decodes what the XLA paged attention decodes (float32 weights: the kernel's dots are TF32)."""
    import dataclasses

    from flax import nnx
    from rollout_helpers import TINY

    from agentrl_jax.models import Decoder

    model = Decoder(dataclasses.replace(TINY, head_dim=16), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 15.0, state)
    model = nnx.merge(graphdef, state)
    kw = {**ENGINE_KW, "page_size": 16, "num_pages": 12}

    async def run(driver):
        session = driver.session()
        first = await driver.generate(PROMPT, GREEDY, max_new_tokens=9, session=session)
        rest = await asyncio.gather(
            driver.generate([70, 71, 72], GREEDY, max_new_tokens=20, session=session),
            driver.generate_group(list(range(20, 40)), 2, GREEDY, max_new_tokens=25),
        )
        session.close()
        return [first, rest[0], *rest[1]], driver.preemptions

    outs = {}
    for attention in ("pallas", "xla"):
        engine = one_device_engine(model, decode_attention=attention, **kw)
        outs[attention] = drive(engine, model, run)
    (got, _), (want, _) = outs["pallas"], outs["xla"]
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-2)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("prefill_attention", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_sharded_prefill_results_follow_the_callers_row_order(tiny_model, prefill_attention):
    """Rows given out of shard order (slots 5, 0, 1 over 4 shards of ('data', 'fsdp')): first tokens
    and logprobs come back in the caller's order and equal one device's (the prefill kernel: run
    per shard under shard_map)."""
    kw = {**ENGINE_KW, "max_concurrent_decodes": 8, "page_size": 4, "prefill_attention": prefill_attention}
    spec = [(5, [40, 41, 42, 43, 44, 45, 46]), (0, [1, 2, 3, 4, 5]), (1, [9, 8, 7])]

    def first_tokens(engine):
        params, state = engine.load_params(tiny_model), engine.init_decode_state()
        rows = []
        for slot, prompt in spec:
            pages = engine.pages.alloc(engine.shard_of(slot), 3)
            admission = Admission(slot, pages, np.asarray(request_key(slot, 0)), 0, SamplingParams(1.0))
            rows.append(PrefillRow(engine.shard_of(slot), pages, 0, np.asarray(prompt, np.int32), [admission]))
        _, first = engine.prefill_insert(params, state, rows)
        return np.asarray(first.tokens)[:3], np.asarray(first.log_prob)[:3]

    sharded = Engine(tiny_model, mesh=make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), **kw)
    assert sharded.num_shards == 4
    got, want = first_tokens(sharded), first_tokens(one_device_engine(tiny_model, **kw))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)


def test_a_group_is_admitted_into_the_slots_that_are_free_and_equals_an_unsplit_one(paged, tiny_model):
    """4 slots, one held by a long request: a group of 4 takes the 3 free slots at once and its 4th
    sample the first slot freed (re-prefilling at most a page of the shared prompt), instead of
    waiting for the long request to end; every sample equals the group run on an idle engine."""
    prompt = list(range(40, 59))  # 19 tokens: the rest keeps 3 full pages of 5 and re-prefills 4 tokens
    sampling = SamplingParams(temperature=1.0, seed=7)

    async def alongside_a_long_request(driver):
        long = asyncio.ensure_future(driver.generate(PROMPT, GREEDY, max_new_tokens=48))
        await asyncio.sleep(0)  # the long request is admitted first
        group = await driver.generate_group(prompt, 4, sampling, max_new_tokens=4)
        done_at = driver.stats()["decode_dispatches"]
        await long
        return group, done_at, driver.stats().get("split_groups", 0)

    async def alone(driver):
        return await driver.generate_group(prompt, 4, sampling, max_new_tokens=4)

    group, done_at, splits = drive(paged, tiny_model, alongside_a_long_request)
    reference = drive(paged, tiny_model, alone)
    assert done_at < 48 // 4 and splits == 1
    for got, want in zip(group, reference):
        assert got.token_ids == want.token_ids
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)


def test_a_new_prompt_waits_rather_than_evicting_a_session_while_others_decode(tiny_model):
    """A session idles between turns while a long prompt decodes; a new prompt that only fits if
    the session's pages go waits for the decoding request instead (evicting would make the session
    re-prefill its history), and the session's next turn continues on its own pages."""
    engine = one_device_engine(tiny_model, page_size=4, num_pages=16)

    async def run(driver):
        session = driver.session()
        await driver.generate(PROMPT, GREEDY, max_new_tokens=2, session=session)
        decoding = asyncio.ensure_future(driver.generate(list(range(1, 31)), GREEDY, max_new_tokens=8))
        newcomer = asyncio.ensure_future(driver.generate(list(range(40, 60)), GREEDY, max_new_tokens=2))
        while driver.stats()["decode_dispatches"] < 3:
            await asyncio.sleep(0.001)
        await driver.generate([70, 71, 72], GREEDY, max_new_tokens=2, session=session)
        session.close()
        await asyncio.gather(decoding, newcomer)
        return driver.evictions, driver.preemptions

    assert drive(engine, tiny_model, run) == (0, 0)


def test_a_decoding_sequence_alone_in_its_shard_takes_the_pages_of_a_waiting_session_turn(tiny_model):
    """One slot: a long request decodes while a session's next turn waits for the slot, holding the
    session's pages. When the decoding sequence needs pages the pool no longer has, the waiting
    turn gives its pages back and re-prefills its history later (counted as an eviction), instead of
    the decoding sequence being cut short with "capacity" although it fits the pool alone."""
    engine = one_device_engine(tiny_model, max_concurrent_decodes=1, page_size=4, num_pages=15)
    long_prompt = list(range(1, 21))
    observation = [70, 71, 72]

    async def run(driver):
        session = driver.session()
        turn1 = await driver.generate(PROMPT, GREEDY, max_new_tokens=2, session=session)
        decoding = asyncio.ensure_future(driver.generate(long_prompt, GREEDY, max_new_tokens=30))
        await asyncio.sleep(0)  # the long request is submitted first, so it takes the slot
        turn2 = await driver.generate(observation, GREEDY, max_new_tokens=3, session=session)
        session.close()
        return turn1, turn2, await decoding, driver.evictions, driver.preemptions

    turn1, turn2, long, evictions, preemptions = drive(engine, tiny_model, run)
    assert long.finish_reason == "length" and long.token_ids == greedy_reference(tiny_model, long_prompt, 30)
    assert turn2.token_ids == greedy_reference(tiny_model, PROMPT + turn1.token_ids + observation, 3)
    assert (evictions, preemptions) == (1, 0)
