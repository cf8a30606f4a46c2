"""Tiny random-init decoders the unit tests share (Qwen3-shaped, seed 0)."""

from __future__ import annotations

import jax
from flax import nnx

from agentrl_jax.models import Decoder, DecoderConfig, split_params
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.sharding import make_mesh


def tiny_decoder():
    """``(graphdef, params)`` of a 2-layer, 32-wide Qwen3 decoder over a 64-token vocabulary."""
    cfg = DecoderConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=128,
    )
    return split_params(Decoder(cfg, rngs=nnx.Rngs(0)))


def tiny_agent_engine(vocab_size: int, *, slots: int, max_target_length: int, max_prefill_length: int,
                      min_prefill_bucket: int, max_position_embeddings: int = 256):
    """``(engine, params)``: a 1-layer, 32-wide Qwen3 decoder over a trained tiny tokenizer's
    vocabulary, behind the real Engine on one CPU device (the agent-loop tests' policy)."""
    cfg = DecoderConfig(
        architecture="qwen3", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=max_position_embeddings,
    )
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    engine = Engine(model, mesh=make_mesh({"data": 1}, jax.devices()[:1]), max_concurrent_decodes=slots,
                    max_target_length=max_target_length, max_prefill_length=max_prefill_length,
                    min_prefill_bucket=min_prefill_bucket, cache_dtype=None)
    return engine, split_params(model)[1]
