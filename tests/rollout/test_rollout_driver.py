"""Driver: continuous batching, stops, groups, sessions, weight updates, error propagation."""

import asyncio

import jax
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW, make_model, teacher_forced

from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 17, 42, 8, 99, 5, 60]


def greedy_reference(model, prompt, n):
    """n greedy tokens by repeated full forward passes (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(np.asarray(model.logits(teacher_forced(model, seq))[0, -1]))))
    return seq[len(prompt) :]


def drive(engine, params, coro_fn, **kw):
    async def main():
        async with Driver(engine, params, steps_per_dispatch=4, **kw) as driver:
            return await coro_fn(driver)

    return asyncio.run(main())


def test_continuous_batching_more_requests_than_slots(engine, tiny_model):
    prompts = [PROMPT, [1, 2, 3], list(range(10, 30)), [77] * 5, [5, 4, 3, 2, 1], [9, 8]]
    budgets = [9, 3, 6, 1, 7, 5]

    async def run(driver):
        return await asyncio.gather(
            *(driver.generate(p, GREEDY, max_new_tokens=m) for p, m in zip(prompts, budgets))
        )

    completions = drive(engine, tiny_model, run)
    for prompt, budget, completion in zip(prompts, budgets, completions):
        assert completion.finish_reason == "length"
        assert completion.token_ids == greedy_reference(tiny_model, prompt, budget)
        assert completion.params_versions == [0] * budget
        assert completion.prompt_length == len(prompt)


def test_stop_token_ids_and_stop_strings_keep_the_stop(engine, tiny_model):
    ref = greedy_reference(tiny_model, PROMPT, 9)
    stop_id = ref[4]
    first = ref.index(stop_id)
    detok = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    stop_string = f"{ref[5]}><{ref[6]}>"  # spans two tokens

    async def run(driver):
        by_id = await driver.generate(PROMPT, GREEDY, stop_token_ids=[stop_id], max_new_tokens=9)
        by_string = await driver.generate(PROMPT, GREEDY, stop_strings=["never", stop_string], max_new_tokens=9)
        by_eos = await driver.generate(PROMPT, GREEDY, max_new_tokens=9)
        return by_id, by_string, by_eos

    by_id, by_string, by_eos = drive(engine, tiny_model, run, detokenize=detok, eos_token_ids=[ref[7]])
    assert by_id.token_ids == ref[: first + 1] and by_id.finish_reason == "stop" and by_id.stop == stop_id
    assert by_string.token_ids[-2:] == ref[5:7] and by_string.stop == stop_string
    assert by_string.token_ids == ref[: len(by_string.token_ids)]
    assert by_eos.token_ids == ref[: ref.index(ref[7]) + 1] and by_eos.finish_reason == "stop"


def test_group_prefill_gives_independent_samples(engine, tiny_model):
    sampler = SamplingParams(temperature=1.0, seed=21)

    async def run(driver):
        group = await driver.generate_group(PROMPT, 4, sampler, max_new_tokens=6)
        lone = await driver.generate(PROMPT, sampler, max_new_tokens=6)
        return group, lone

    group, lone = drive(engine, tiny_model, run)
    assert len(group) == 4 and all(len(c.token_ids) == 6 for c in group)
    assert len({tuple(c.token_ids) for c in group}) > 1
    assert group[0].token_ids == lone.token_ids
    np.testing.assert_allclose(group[0].logprobs, lone.logprobs, atol=1e-6)


def test_top_k_requests_switch_the_decode_program_exactly(engine, tiny_model):
    """A top_k=1 request decoding next to plain sampled ones takes the greedy tokens (its truncated
    logprobs are 0), and the plain ones sample what they sample alone: the driver compiles the sorted
    sampling path only while a truncating request holds a slot, so the host must know which do."""
    plain = [SamplingParams(1.0, seed=s) for s in (31, 32)]

    async def run(driver, with_top_k):
        calls = [driver.generate(PROMPT, p, max_new_tokens=9) for p in plain]
        if with_top_k:
            calls.append(driver.generate(PROMPT, SamplingParams(1.0, top_k=1, seed=33), max_new_tokens=9))
        return await asyncio.gather(*calls)

    alone = drive(engine, tiny_model, lambda d: run(d, False))
    mixed = drive(engine, tiny_model, lambda d: run(d, True))
    assert mixed[2].token_ids == greedy_reference(tiny_model, PROMPT, 9)
    np.testing.assert_allclose(mixed[2].truncated_logprobs, 0.0, atol=1e-6)
    for a, b in zip(alone, mixed):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_session_extends_its_own_prefix(engine, tiny_model):
    observation = [70, 71, 72, 73]

    async def run(driver):
        session = driver.session()
        turn1 = await driver.generate(PROMPT, GREEDY, max_new_tokens=5, session=session)
        cached = session.num_cached_tokens
        turn2 = await driver.generate(observation, GREEDY, max_new_tokens=6, session=session)
        session.close()
        scratch = await driver.generate(PROMPT + turn1.token_ids + observation, GREEDY, max_new_tokens=6)
        return turn1, cached, turn2, scratch

    turn1, cached, turn2, scratch = drive(engine, tiny_model, run)
    assert cached == len(PROMPT) + len(turn1.token_ids) - 1
    assert turn2.prompt_length == len(observation)
    assert turn2.token_ids == scratch.token_ids
    np.testing.assert_allclose(turn2.logprobs, scratch.logprobs, atol=1e-5)


def test_update_params_new_weights_and_versions(engine, tiny_model):
    other = make_model(1)

    async def run(driver):
        before = await driver.generate(PROMPT, GREEDY, max_new_tokens=5)
        await driver.update_params(other, version=1)
        after = await driver.generate(PROMPT, GREEDY, max_new_tokens=5)
        in_flight = asyncio.ensure_future(driver.generate(PROMPT, GREEDY, max_new_tokens=40))
        await asyncio.sleep(0)
        await driver.update_params(tiny_model, version=2)
        mixed = await in_flight
        drained_task = asyncio.ensure_future(driver.generate(PROMPT, GREEDY, max_new_tokens=20))
        await asyncio.sleep(0)
        await driver.update_params(other, version=3, drain=True)
        drained = await drained_task
        return before, after, mixed, drained

    before, after, mixed, drained = drive(engine, tiny_model, run)
    assert before.token_ids == greedy_reference(tiny_model, PROMPT, 5) and before.params_version == 0
    assert after.token_ids == greedy_reference(other, PROMPT, 5)
    assert after.params_versions == [1] * 5
    assert mixed.params_versions == sorted(mixed.params_versions)
    assert {1, 2} <= set(mixed.params_versions), mixed.params_versions
    assert drained.params_versions == [2] * 20


def test_too_long_prompt_fails_that_request_only(engine, tiny_model):
    async def run(driver):
        with pytest.raises(ValueError, match="max_target_length"):
            await driver.generate(list(range(64)), GREEDY)
        return await driver.generate(PROMPT, GREEDY, max_new_tokens=2)

    assert drive(engine, tiny_model, run).token_ids == greedy_reference(tiny_model, PROMPT, 2)


def test_exception_in_loop_reaches_every_caller(engine, tiny_model):
    def broken_detokenize(ids):
        raise KeyError("tokenizer exploded")

    async def run(driver):
        results = await asyncio.gather(
            driver.generate(PROMPT, GREEDY, max_new_tokens=8),
            driver.generate(PROMPT, GREEDY, max_new_tokens=8, stop_strings=["x"]),
            return_exceptions=True,
        )
        with pytest.raises(RuntimeError, match="loop failed") as info:
            await driver.generate(PROMPT, GREEDY)
        return results, info.value.__cause__

    results, cause = drive(engine, tiny_model, run, detokenize=broken_detokenize)
    assert all(isinstance(r, KeyError) for r in results), results
    assert isinstance(cause, KeyError)


def test_prompt_longer_than_max_prefill_is_prefilled_in_chunks(engine, tiny_model):
    prompt = [(7 * i + 3) % 128 for i in range(40)]  # max_prefill_length is 32: two chunks

    async def run(driver):
        return await driver.generate(prompt, GREEDY, max_new_tokens=4)

    completion = drive(engine, tiny_model, run)
    assert completion.token_ids == greedy_reference(tiny_model, prompt, 4)
    assert completion.prompt_length == 40


def test_stats_count_dispatches_occupancy_and_kv_pages(engine, tiny_model):
    """One request of 8 tokens, 4 steps per dispatch, 4 slots: its first token comes from the prefill,
    the next 4 from dispatch 1 and 3 from dispatch 2 (its limit falls inside dispatch 2, so its slot
    is retired before a third dispatch: `Dispatcher._retire_known_ends`): 2 dispatches, 8 of 32
    slot-steps held, 7 of 8 tokens kept."""

    async def run(driver):
        session = driver.session()
        await driver.generate(PROMPT, GREEDY, max_new_tokens=8, session=session)
        during = driver.stats()
        session.close()
        await driver.generate([1, 2], GREEDY, max_new_tokens=1)  # a tick releases the closed session
        return during, driver.stats(), driver.pages_in_use()

    during, after, pages = drive(engine, tiny_model, run)
    assert during["decode_dispatches"] == 2
    assert during["slot_occupancy"] == pytest.approx(8 / 32)
    assert during["kept_token_fraction"] == pytest.approx(7 / 8)
    P = engine.page_size
    assert during["kv_pool_tokens"] == engine.memory_plan.tokens
    # the session holds its turn: 7 prompt + 7 sampled entries (the last token is fed next turn)
    assert during["kv_written_tokens"] == len(PROMPT) + 7
    assert during["kv_held_tokens"] % P == 0 and during["kv_held_tokens"] >= len(PROMPT) + 7
    assert after["kv_held_tokens"] == pages * P == 0 and after["kv_written_tokens"] == 0
    # the 1-token request's slot is filled and decodes one dispatch before its prefilled token is read
    assert after["decode_dispatches"] == 3 and after["kept_tokens"] == 7


def test_a_slot_whose_length_limit_falls_in_flight_takes_the_next_request_at_once(tiny_model):
    """One slot, two 5-token requests, 4 steps per dispatch. The first request's limit falls inside
    dispatch 1, so its slot is retired before dispatch 2 and the second request decodes there: 2 full
    dispatches (4 when the slot waited for its results: one for the first request's dropped tail,
    one for the second's). Tokens and logprobs are unchanged (the greedy reference)."""
    engine = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **{**ENGINE_KW,
                    "max_concurrent_decodes": 1})
    prompts = [PROMPT, [9, 8, 7]]

    async def run(driver):
        return await asyncio.gather(*(driver.generate(p, GREEDY, max_new_tokens=5) for p in prompts)), driver.stats()

    completions, stats = drive(engine, tiny_model, run)
    for prompt, completion in zip(prompts, completions):
        assert completion.finish_reason == "length"
        assert completion.token_ids == greedy_reference(tiny_model, prompt, 5)
    assert stats["decode_dispatches"] == 2
    assert stats["kept_token_fraction"] == 1.0 and stats["slot_occupancy"] == 1.0
    assert engine.pages.num_used() == 0
    # host time: every tick counted, the device waits (two prefills, two dispatches read) inside them
    assert stats["ticks"] >= 3 and 0 < stats["device_wait_seconds"] < stats["tick_seconds"] <= stats["busy_seconds"]



def test_a_next_turn_sent_at_once_is_prefilled_in_the_next_tick(tiny_model):
    """While another request keeps the device busy, a session whose tool answers at once has its
    next turn prefilled in the tick right after its turn was read: 2 dispatches from the first
    turn's prefill to the second's (the tick reading it queues the next dispatch first). Without
    the driver yielding to its callers before taking the inbox, the next tick starts before they
    resubmit and the turn waits one dispatch more (3)."""
    engine = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **ENGINE_KW)
    calls = []
    prefill_insert, generate = engine.prefill_insert, engine.generate

    def logged_prefill(params, state, rows, **kwargs):
        calls.append(("prefill", [r.tokens.tolist() for r in rows]))
        return prefill_insert(params, state, rows, **kwargs)

    def logged_generate(*args, **kwargs):
        calls.append(("generate", None))
        return generate(*args, **kwargs)

    engine.prefill_insert, engine.generate = logged_prefill, logged_generate
    observation = [70, 71, 72]

    async def agent(driver):
        session = driver.session()
        await driver.generate(PROMPT, GREEDY, max_new_tokens=4, session=session)
        await driver.generate(observation, GREEDY, max_new_tokens=2, session=session)
        session.close()

    async def run(driver):
        await asyncio.gather(driver.generate([1, 2, 3], GREEDY, max_new_tokens=40), agent(driver))

    drive(engine, tiny_model, run)
    second = next(i for i, (kind, rows) in enumerate(calls)
                  if kind == "prefill" and any(r[1:] == observation for r in rows))
    assert calls[0][0] == "prefill" and sum(kind == "generate" for kind, _ in calls[:second]) == 2



def test_a_turn_waiting_for_the_pages_of_a_retired_turn_is_not_failed(tiny_model):
    """One slot, a pool of 10 pages of 4 tokens. Session B's next turn waits for the slot while A's
    turn decodes; A's length limit falls in the dispatch in flight, so its slot is retired before
    that dispatch is read, and for one tick A's pages are held by nobody the scheduler may evict.
    B's turn must wait that tick (then A's idle session is evicted), not fail as if it could never
    fit: with nothing else decoding, the driver used to give up on the first waiting sequence."""
    engine = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]),
                    **{**ENGINE_KW, "max_concurrent_decodes": 1, "page_size": 4, "num_pages": 10})

    async def run(driver):
        b, a = driver.session(), driver.session()
        await driver.generate(list(range(1, 13)), GREEDY, max_new_tokens=4, session=b)  # B holds 16 tokens
        first_a = asyncio.ensure_future(driver.generate(list(range(20, 32)), GREEDY, max_new_tokens=8, session=a))
        await asyncio.sleep(0)  # A is admitted first and takes the slot
        second_b = await driver.generate(list(range(40, 48)), GREEDY, max_new_tokens=4, session=b)
        return await first_a, second_b, driver.evictions

    first_a, second_b, evictions = drive(engine, tiny_model, run)
    assert first_a.finish_reason == "length" and len(first_a.token_ids) == 8
    assert second_b.finish_reason == "length" and len(second_b.token_ids) == 4
    assert evictions >= 1  # B's turn took A's idle session's pages
