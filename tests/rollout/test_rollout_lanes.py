"""Decode lanes (`Engine(decode_batch=B)` with B < slots): a slot that stops on the device hands
its lane to the ready slot admitted first, at the next step; nothing a sequence samples depends
on the lanes."""

import asyncio
import random

import jax
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW, make_model

from agentrl_jax.rollout.decode_step import assign_lanes
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.paged_prefill import Admission, PrefillRow
from agentrl_jax.rollout.pages import pages_for
from agentrl_jax.rollout.sampling import SamplingParams, request_keys
from agentrl_jax.rollout.stops import StopMatcher, TokenTexts
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

GREEDY = SamplingParams(temperature=0.0)


def one_device_engine(model, **kw):
    return Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **{**ENGINE_KW, **kw})


def reference_lanes(lane_slot, active, order, shards):
    """`assign_lanes` written plainly: keep an active slot, else take the first-admitted ready slot of
    the lane's shard, lanes in order."""
    S, B = len(active), len(lane_slot)
    out = list(lane_slot)
    for d in range(shards):
        lanes = range(d * B // shards, (d + 1) * B // shards)
        slots = range(d * S // shards, (d + 1) * S // shards)
        kept = {lane: out[lane] for lane in lanes if out[lane] >= 0 and active[out[lane]]}
        queue = sorted((order[s], s) for s in slots if active[s] and s not in kept.values())
        for lane in lanes:
            if lane not in kept:
                out[lane] = queue.pop(0)[1] if queue else -1
    return out


@pytest.mark.parametrize("shards", [1, 2])
def test_assign_lanes_matches_a_plain_reference(shards):
    rng = np.random.default_rng(0)
    S, B = 12, 4
    fn = jax.jit(lambda lanes, active, order: assign_lanes(lanes, active, order, shards=shards))
    for _ in range(50):
        active = rng.random(S) < 0.6
        order = rng.permutation(100)[:S].astype(np.int32)
        lane_slot = np.full(B, -1, np.int32)
        for d in range(shards):  # lanes hold distinct slots of their own shard, or none
            slots = rng.permutation(np.arange(d * S // shards, (d + 1) * S // shards))
            for i, lane in enumerate(range(d * B // shards, (d + 1) * B // shards)):
                lane_slot[lane] = slots[i] if rng.random() < 0.7 else -1
        got = np.asarray(fn(lane_slot, active, order)).tolist()
        assert got == reference_lanes(lane_slot.tolist(), active.tolist(), order.tolist(), shards)


def admit(engine, params, state, prompts, limits, stop_ids=((),), stop_sequences=((),), forced=(), recent=()):
    """Prefill each prompt into slot i (its own pages), with a device-side length limit of
    ``limits[i]`` new tokens, ``stop_ids[i]`` and ``stop_sequences[i]``, and for a resumed one
    ``forced[i]`` >= 0 (the token it feeds) with ``recent[i]`` (its turn's tokens before that);
    returns the state and the first tokens."""
    rows = []
    for i, (prompt, new_tokens) in enumerate(zip(prompts, limits)):
        pages = engine.pages.alloc(0, pages_for(len(prompt) + new_tokens + 8, engine.page_size))
        key = request_keys(i + 1, 1)[0]
        admission = Admission(i, pages, key, 0, SamplingParams(temperature=1.0, seed=i + 1),
                              forced_token=forced[i] if i < len(forced) else -1,
                              limit=len(prompt) + new_tokens - 1, stop_ids=stop_ids[i % len(stop_ids)],
                              stop_sequences=stop_sequences[i % len(stop_sequences)],
                              recent=recent[i] if i < len(recent) else ())
        rows.append(PrefillRow(shard=0, pages=pages, start=0, tokens=np.asarray(prompt, np.int32),
                               admissions=[admission]))
    state, first = engine.prefill_insert(params, state, rows)
    return state, np.asarray(first.tokens).tolist()


def test_a_stopped_slot_hands_its_lane_to_the_ready_slot_at_the_next_step(tiny_model):
    """Three slots, two lanes: A stops at its length limit after 2 decode steps, so at step 2 its
    lane takes C (admitted third, ready since the prefill); B runs throughout. Every slot samples
    the tokens it samples with a lane of its own (the same keys, positions and pages)."""
    prompts = [[3, 17, 42, 8], [9, 8, 7], [5, 6, 7, 8, 9]]
    limits = [3, 20, 20]  # new tokens: A's first comes from the prefill, two more from the decode steps
    runs = {}
    for lanes in (2, 3):
        engine = one_device_engine(tiny_model, max_concurrent_decodes=3, decode_batch=lanes)
        params = engine.load_params(tiny_model)
        state, first = admit(engine, params, engine.init_decode_state(), prompts, limits)
        state, result = engine.generate(params, state, num_steps=8)
        runs[lanes] = first, np.asarray(result.tokens), np.asarray(result.valid), np.asarray(result.log_prob)
    first, tokens, valid, log_prob = runs[2]
    assert valid[:, 0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert valid[:, 1].all()
    assert valid[:, 2].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    first_w, tokens_w, _, log_prob_w = runs[3]  # a lane per slot: A, B and C from step 0
    assert first == first_w
    np.testing.assert_array_equal(tokens[:2, 0], tokens_w[:2, 0])
    np.testing.assert_array_equal(tokens[:, 1], tokens_w[:, 1])
    np.testing.assert_array_equal(tokens[2:, 2], tokens_w[:6, 2])
    # on GPU the two engines' kernels split rows into different chunk counts (2 lanes vs 3 rows; lanes
    # double the programs): the float32 combine reassociates (1.9e-6 seen on an H200)
    np.testing.assert_allclose(log_prob[2:, 2], log_prob_w[:6, 2], atol=1e-5)


PROMPTS = [[3, 17, 42, 8], [9, 8, 7], [5, 6, 7, 8, 9]]


def probe_a(model):
    """A lane per slot for `PROMPTS` (A, B, C): ``(the probe engine, params, A's first token then
    its 6 decoded ones)``."""
    probe = one_device_engine(model, max_concurrent_decodes=3, decode_batch=3)
    params = probe.load_params(model)
    state, first = admit(probe, params, probe.init_decode_state(), PROMPTS, [20, 20, 20])
    _, result = probe.generate(params, state, num_steps=6)
    return probe, params, [first[0], *np.asarray(result.tokens)[:, 0].tolist()]


def test_a_sampled_stop_id_frees_the_lane_on_the_device(tiny_model):
    """A's first decoded token that it had not sampled before is made its stop id: A stops at that
    step (its token kept) and C decodes from the next."""
    prompts = PROMPTS
    _, params, sampled = probe_a(tiny_model)
    at = next(j for j in range(1, 6) if sampled[j + 1] not in sampled[: j + 1])  # decode step of A's stop
    stop = sampled[at + 1]
    engine = one_device_engine(tiny_model, max_concurrent_decodes=3, decode_batch=2)
    state, _ = admit(engine, params, engine.init_decode_state(), prompts, [20, 20, 20], stop_ids=((stop,), (), ()))
    _, result = engine.generate(params, state, num_steps=6)
    valid = np.asarray(result.valid)
    assert valid[:, 0].tolist() == [1] * (at + 1) + [0] * (5 - at)
    assert int(np.asarray(result.tokens)[at, 0]) == stop
    assert valid[:, 2].tolist() == [0] * (at + 1) + [1] * (5 - at)


def test_a_completed_stop_sequence_frees_the_lane_on_the_device(tiny_model):
    """A stops at the step whose token completes one of its stop sequences (a stop string's
    tokens): a pair of tokens it samples at two decode steps, first seen there; C decodes from
    the next step. A resumed A (its token forced) matches the tokens of its turn before that one
    too: (r, forced, next) stops it at the first decode step, which it would not without them."""
    prompts = PROMPTS
    probe, params, sampled = probe_a(tiny_model)
    pairs = list(zip(sampled, sampled[1:]))
    at = next(j for j in range(1, 5) if pairs[j] not in pairs[:j])  # decode step at which A's pair completes
    engine = one_device_engine(tiny_model, max_concurrent_decodes=3, decode_batch=2)
    never = (pairs[at][1], pairs[at][0], pairs[at][1], 127)  # a longer sequence it does not complete
    state, _ = admit(engine, params, engine.init_decode_state(), prompts, [20, 20, 20],
                     stop_sequences=((pairs[at], never), (), ()))
    _, result = engine.generate(params, state, num_steps=6)
    valid = np.asarray(result.valid)
    assert valid[:, 0].tolist() == [1] * (at + 1) + [0] * (5 - at)
    assert int(np.asarray(result.tokens)[at, 0]) == pairs[at][1]
    assert valid[:, 2].tolist() == [0] * (at + 1) + [1] * (5 - at)

    # resumed: A feeds a forced token f after its turn's tokens r; what it samples next is x
    f, r = 11, [40, 41]
    state, _ = admit(probe, params, probe.init_decode_state(), prompts, [20, 20, 20], forced=(f,), recent=(r,))
    _, result = probe.generate(params, state, num_steps=2)
    x = int(np.asarray(result.tokens)[0, 0])
    for sequence, stops_at_once in (((r[-1], f, x), True), ((r[0], f, x), False)):
        state, first = admit(engine, params, engine.init_decode_state(), prompts, [20, 20, 20],
                             stop_sequences=((sequence,), (), ()), forced=(f,), recent=(r,))
        assert first[0] == f
        _, result = engine.generate(params, state, num_steps=3)
        assert np.asarray(result.valid)[:, 0].tolist() == ([1, 0, 0] if stops_at_once else [1, 1, 1]), sequence
    with pytest.raises(ValueError, match="device_stop_sequences"):
        one_device_engine(tiny_model, device_stop_sequences=(2, 0))


def test_the_decode_kernels_chunking_changes_no_token_or_logprob():
    """`Engine(decode_kernel_programs=)` only splits the GPU kernel's work (here interpreted): rows of
    ragged lengths, one program per (row, kv head) or each row's entries in 4 chunks (some empty), sample the same
    tokens with the same logprobs. The default is twice the kernel's with decode lanes."""
    from agentrl_jax.models.decode import DecodeKernel, kernel_block, kernel_chunks

    tiny_model = make_model(head_dim=16)  # the Triton kernel's smallest head dim (on GPU; interpreted on CPU)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, n).tolist() for n in (20, 35, 41)]  # several 16-entry blocks each
    runs = {}
    for programs in (1, 64):
        engine = one_device_engine(tiny_model, max_concurrent_decodes=3, page_size=16, max_prefill_length=48,
                                   max_target_length=128, decode_attention="pallas", decode_kernel_programs=programs)
        params = engine.load_params(tiny_model)
        state, first = admit(engine, params, engine.init_decode_state(), prompts, [10, 10, 10])
        state, result = engine.generate(params, state, num_steps=5)
        runs[programs] = first, np.asarray(result.tokens), np.asarray(result.log_prob)
    S = engine.table_width * engine.page_size
    # 4 chunks a row: [0, 32) and [32, 41) for the longest (blocks of 32 entries over 2 pages), 2 empty ones
    assert kernel_chunks(3 * tiny_model.config.num_kv_heads, S // kernel_block(S, 16), 64) == 4
    assert runs[1][0] == runs[64][0]
    np.testing.assert_array_equal(runs[1][1], runs[64][1])
    np.testing.assert_allclose(runs[1][2], runs[64][2], atol=1e-5)  # the float32 combine reassociates (2e-6 seen)
    default = DecodeKernel().min_programs
    assert one_device_engine(tiny_model).decode_kernel_programs == default
    assert one_device_engine(tiny_model, decode_batch=2).decode_kernel_programs == 2 * default
    tuned = DecodeKernel(block_k=16, min_programs=64)  # the kernel's settings reach the engine's decode attention
    lanes = one_device_engine(tiny_model, decode_batch=2, decode_kernel=tuned)
    assert lanes.decode_kernel_programs == 128 and lanes.decode_kernel == DecodeKernel(block_k=16, min_programs=128)
    with pytest.raises(ValueError, match="decode_kernel_programs"):
        one_device_engine(tiny_model, decode_kernel_programs=0)


def drive(engine, model, coro_fn, steps=4, tokenize=None):
    async def main():
        async with Driver(engine, model, steps_per_dispatch=steps, detokenize=lambda ids: " ".join(map(str, ids)),
                          tokenize=tokenize) as driver:
            return await coro_fn(driver), driver.stats()

    return asyncio.run(main())


def workload(seed):
    """Groups, multi-turn sessions, stop ids, a stop string and ragged limits, sampled with seeds (each
    episode draws from its own generator: the order in which turns end differs between engines)."""

    async def episode(driver, i):
        rng = random.Random(1000 * seed + i)
        session = driver.session() if i % 3 else None
        prompt = [rng.randrange(1, 128) for _ in range(rng.randrange(2, 10))]
        out = []
        for turn in range(3 if session else 1):
            sampling = SamplingParams(temperature=1.0, seed=100 * seed + i)
            kw = dict(stop_token_ids=[rng.randrange(128)], max_new_tokens=rng.randrange(2, 12))
            if i % 4 == 0 and session is None:
                out += await driver.generate_group(prompt, 3, sampling, **kw)
                break
            if i % 5 == 1:
                kw["stop_strings"] = ["7"]
            out.append(await driver.generate(prompt, sampling, session=session, **kw))
            prompt = [rng.randrange(1, 128) for _ in range(rng.randrange(1, 5))]
        if session is not None:
            session.close()
        return out

    async def run(driver):
        episodes = await asyncio.gather(*(episode(driver, i) for i in range(10)))
        await driver.generate([1, 2, 3], GREEDY, max_new_tokens=2)  # one more tick: closed sessions released
        assert driver.pages_in_use() == 0
        return episodes

    return run


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # ~30 s each on 2 CPU cores
def test_lanes_decode_exactly_what_a_lane_per_slot_decodes(tiny_model, seed):
    """The driver over 6 slots and 2 decode lanes answers every request of a mixed workload with the
    tokens, logprobs and finish reasons of 6 slots with a lane each, in fewer lane-steps lost."""
    wide = one_device_engine(tiny_model, max_concurrent_decodes=6)
    narrow = one_device_engine(tiny_model, max_concurrent_decodes=6, decode_batch=2)
    want, _ = drive(wide, tiny_model, workload(seed))
    got, stats = drive(narrow, tiny_model, workload(seed))
    for episode_got, episode_want in zip(got, want):
        assert len(episode_got) == len(episode_want)
        for a, b in zip(episode_got, episode_want):
            assert (a.token_ids, a.finish_reason, a.stop) == (b.token_ids, b.finish_reason, b.stop)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # with 2 lanes and plenty of ready slots, few lane-steps go to tokens that are dropped
    assert stats["kept_token_fraction"] > 0.9 and stats["slot_occupancy"] > 0.5


def test_stop_strings_given_as_tokens_stop_on_the_device_with_the_same_completions(tiny_model):
    """Each episode's stop string is a pair of tokens it samples when run free with a lane per
    slot (as text "a b", its tokens [a, b] through `Driver(tokenize=)`), first completed there.
    With 2 lanes for 6 slots each completion is the free run's cut after its pair, and no decoded
    step is thrown away: the device stopped every turn itself (a turn stopped by the host alone
    decodes on until the host reads it)."""
    sampling = [SamplingParams(temperature=1.0, seed=50 + i) for i in range(6)]

    async def free_run(driver):
        return await asyncio.gather(*(driver.generate([5 + i, 9, 2 * i + 1], s, max_new_tokens=14)
                                      for i, s in enumerate(sampling)))

    wide = one_device_engine(tiny_model, max_concurrent_decodes=6)
    probe, _ = drive(wide, tiny_model, free_run)
    texts = TokenTexts(lambda ids: " ".join(map(str, ids)))
    stops, ends = [], []
    for completion in probe:
        tokens = completion.token_ids
        for j in range(2, len(tokens) - 1):
            text = f"{tokens[j]} {tokens[j + 1]}"  # first found by the host's text check where the pair ends
            if StopMatcher([text], texts).first_match([], tokens)[0] == j + 1:
                stops.append([text])
                ends.append(j + 2)
                break
        else:
            stops.append([])
            ends.append(len(tokens))
    assert sum(map(bool, stops)) >= 4

    async def with_stops(driver):
        return await asyncio.gather(*(driver.generate([5 + i, 9, 2 * i + 1], s, max_new_tokens=14, stop_strings=stop)
                                      for i, (s, stop) in enumerate(zip(sampling, stops))))

    def tokenize(text):
        return [int(t) for t in text.split()]

    narrow = one_device_engine(tiny_model, max_concurrent_decodes=6, decode_batch=2)
    got, stats = drive(narrow, tiny_model, with_stops, tokenize=tokenize)
    for a, free, stop, end in zip(got, probe, stops, ends):  # the free run, cut where its pair ends
        assert a.token_ids == free.token_ids[:end]
        np.testing.assert_allclose(a.logprobs, free.logprobs[:end], atol=1e-5)
        assert (a.finish_reason, a.stop) == (("stop", stop[0]) if stop else ("length", None))
    assert stats["kept_token_fraction"] == 1.0


@pytest.mark.slow  # ~30 s on 2 CPU cores; the e2e two-step run (tests/e2e) rolls out with lanes on a sharded engine
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_sharded_lanes_equal_a_single_device(tiny_model):
    """Slots and lanes split over data=2 (each shard's lanes take its own slots), kv heads over
    tensor=2: the same completions as one device with a lane per slot."""
    sharded = Engine(tiny_model, mesh=make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4]),
                     **{**ENGINE_KW, "max_concurrent_decodes": 6, "decode_batch": 2})
    single = one_device_engine(tiny_model, max_concurrent_decodes=6)
    got, _ = drive(sharded, tiny_model, workload(2))
    want, _ = drive(single, tiny_model, workload(2))
    for episode_got, episode_want in zip(got, want):
        for a, b in zip(episode_got, episode_want):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_decode_batch_out_of_range_is_an_error(tiny_model):
    with pytest.raises(ValueError, match="decode_batch=5"):
        one_device_engine(tiny_model, decode_batch=5)
    with pytest.raises(ValueError, match="decode_batch=0"):
        one_device_engine(tiny_model, decode_batch=0)
    if jax.device_count() >= 2:
        with pytest.raises(ValueError, match="decode_batch=3"):
            Engine(tiny_model, mesh=make_mesh({"data": 2}, jax.devices()[:2]), **{**ENGINE_KW, "decode_batch": 3})
