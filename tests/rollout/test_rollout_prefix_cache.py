"""The cross-request prefix cache: reused pages give the same tokens and logprobs as prefilling
again, a weight update empties it, and it never holds a page it cannot give back."""

import asyncio

import jax
import numpy as np
import pytest
from rollout_helpers import ENGINE_KW, make_model

from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.pages import PageAllocator
from agentrl_jax.rollout.prefix_cache import PrefixCache
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.sharding import make_mesh

pytestmark = pytest.mark.gpu  # also run on a CUDA GPU: see the `gpu` marker in pyproject.toml

HEADER = [3, 17, 42, 8, 99, 5, 60, 11, 23]  # 9 tokens: two full pages of 4
PROMPTS = [HEADER + [7, 1], HEADER + [7, 1], HEADER + [30], HEADER]


def drive(engine, model, coro_fn, **kw):
    async def main():
        async with Driver(engine, model, steps_per_dispatch=4, **kw) as driver:
            return await coro_fn(driver)

    return asyncio.run(main())


def test_cache_lookup_takes_the_longest_run_of_full_pages_and_keeps_one_token_to_prefill():
    pages = PageAllocator(num_shards=2, pages_per_shard=8)
    cache = PrefixCache(pages, page_size=4)
    tokens = list(range(12))
    held = pages.alloc(1, 3)
    cache.insert(1, tokens, held, written=10)  # pages 0 and 1 are full, page 2 is not
    assert len(cache) == 2 and [pages.refcount(1, p) for p in held] == [2, 2, 1]
    assert cache.lookup(cache.chain(tokens), num_shards=2) == (1, held[:2])
    assert cache.lookup(cache.chain(tokens[:8]), num_shards=2) == (1, held[:1])  # the last token is prefilled
    assert cache.lookup(cache.chain([0, 1, 2, 9, 4]), num_shards=2) == (None, [])  # first page differs
    pages.release(1, held)  # the requests end: only the cache (and the two lookups above) hold pages
    pages.release(1, held[:2] + held[:1])
    cache.evict(1, need=pages.usable_pages)
    assert len(cache) == 0 and pages.num_used() == 0


def test_reused_pages_give_the_same_tokens_and_logprobs_and_updates_empty_the_cache(tiny_model):
    engine = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **{**ENGINE_KW, "page_size": 4})
    other = make_model(1)

    async def run(driver):
        out = []
        for i, prompt in enumerate(PROMPTS):  # one after another: each finds the earlier ones' pages
            out.append(await driver.generate(prompt, SamplingParams(1.0, seed=5 + i), max_new_tokens=6))
        stats = driver.stats()
        await driver.update_params(other, version=1)
        emptied = driver.stats().get("prefix_cache_pages", 0)
        out.append(await driver.generate(HEADER, SamplingParams(1.0, seed=9), max_new_tokens=6))
        return out, stats, emptied, driver.stats()

    cached, stats, emptied, after = drive(engine, tiny_model, run, prefix_cache=True)
    plain, *_ = drive(engine, tiny_model, run)
    for a, b in zip(cached, plain):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # requests 2-4 each reuse the header's two full pages (8 tokens); request 1 filled the cache
    assert stats["prefix_cache_hits"] == 3 and stats["prefix_cache_hit_tokens"] == 24
    assert emptied == 0 and after["prefix_cache_hits"] == 3  # the new weights' request found nothing stale


def test_sessions_first_turns_share_a_header_and_later_turns_stay_exact(tiny_model):
    """Agent loops run every episode in a session: a session's first turn offers its prompt's full
    pages to the cache (its later turns, whose pages hold decoded KV, do not), so the next episode
    with the same header reuses them; both turns equal the run without the cache."""
    engine = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), **{**ENGINE_KW, "page_size": 4})

    async def run(driver):
        out = []
        for i, prompt in enumerate(PROMPTS[:2] + PROMPTS[2:3]):
            session = driver.session()
            sampling = SamplingParams(1.0, seed=11 + i)
            out.append(await driver.generate(prompt, sampling, max_new_tokens=5, session=session))
            out.append(await driver.generate([40, 41, 42], sampling, max_new_tokens=5, session=session))
            session.close()
        return out, driver.stats()

    cached, stats = drive(engine, tiny_model, run, prefix_cache=True)
    plain, _ = drive(engine, tiny_model, run)
    for a, b in zip(cached, plain):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    # episodes 2 and 3 reuse the header's two full pages; no later turn is looked up with pages to share
    assert stats["prefix_cache_hits"] == 2 and stats["prefix_cache_hit_tokens"] == 16


def test_prompts_sent_together_reuse_the_pages_of_those_prefilled_before_them(tiny_model):
    """A step's prompts arrive at once; with one slot they are prefilled one after another, and each
    finds the header pages the earlier ones offered (the lookup happens when a prompt is planned,
    not when it arrives): 3 hits of 2 pages, and the same tokens as without the cache."""
    engine = Engine(tiny_model, mesh=make_mesh({"data": 1}, jax.devices()[:1]),
                    **{**ENGINE_KW, "page_size": 4, "max_concurrent_decodes": 1})

    async def run(driver):
        together = await asyncio.gather(*(driver.generate(p, SamplingParams(1.0, seed=3 + i), max_new_tokens=5)
                                          for i, p in enumerate(PROMPTS)))
        return together, driver.stats()

    cached, stats = drive(engine, tiny_model, run, prefix_cache=True)
    plain, _ = drive(engine, tiny_model, run)
    for a, b in zip(cached, plain):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert stats["prefix_cache_hits"] == 3 and stats["prefix_cache_hit_tokens"] == 24
