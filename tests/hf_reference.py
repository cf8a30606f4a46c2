"""Greedy decoding two ways, for parity tests on real checkpoints: our Engine + Driver, and
transformers (PyTorch) as the independent reference."""

from __future__ import annotations

import asyncio

import torch


def engine_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``new_tokens`` argmax tokens per prompt through our Engine + Driver on one device (no eos stop)."""
    import jax

    from agentrl_jax.rollout import Driver, Engine, SamplingParams
    from agentrl_jax.sharding import make_mesh

    longest = max(len(p) for p in prompts)
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=len(prompts),
                    max_target_length=longest + new_tokens, max_prefill_length=longest, page_size=16, cache_dtype=None)

    async def generate():
        async with Driver(engine, model, steps_per_dispatch=8) as driver:
            return await asyncio.gather(*(driver.generate(p, SamplingParams(temperature=0.0),
                                                          max_new_tokens=new_tokens) for p in prompts))

    return [list(c.token_ids) for c in asyncio.run(generate())]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """``new_tokens`` argmax tokens with transformers' KV cache, through eos (as the Driver without eos ids)."""
    tokens, past, step = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens
