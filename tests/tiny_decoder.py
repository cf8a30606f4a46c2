"""The two-layer Qwen3-shaped decoder the trainer's unit tests run (random init, seed 0)."""

from __future__ import annotations

from flax import nnx

from agentrl_jax.models import Decoder, DecoderConfig, split_params


def tiny_decoder():
    """``(graphdef, params)`` of a 2-layer, 32-wide Qwen3 decoder over a 64-token vocabulary."""
    cfg = DecoderConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=True,
        max_position_embeddings=128,
    )
    return split_params(Decoder(cfg, rngs=nnx.Rngs(0)))
