"""transformers (PyTorch) as the independent reference the engine's greedy decoding is checked against."""

from __future__ import annotations

import torch


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
