"""Tiny decoder and helpers shared by the rollout tests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from agentrl_jax.models import Decoder, DecoderConfig

TINY = DecoderConfig(
    architecture="qwen3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    qk_norm=True,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
# attend_granule=16: decode attention windows of 16, 32, 48 or 64 entries, so the tests cross them;
# cache_dtype=None: the KV cache in the model's compute dtype (float32: exact comparisons with the trainer)
ENGINE_KW = dict(
    max_concurrent_decodes=4, max_target_length=64, max_prefill_length=32, min_prefill_bucket=16, attend_granule=16,
    cache_dtype=None,
)


def make_model(seed: int = 0, **overrides) -> Decoder:
    """A float32 tiny Qwen3 (``TINY`` with ``overrides``) whose weights are scaled up so the
    logits are far from uniform."""
    model = Decoder(dataclasses.replace(TINY, **overrides), rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)

    state = jax.tree_util.tree_map_with_path(lambda path, x: x if "norm" in jax.tree_util.keystr(path) else x * 15.0, state)
    return nnx.merge(graphdef, state)


_FORWARD = {}


def teacher_forced(model, tokens, pad_to: int = 64):
    """[1, T, D] final hidden states of a full causal forward pass over one sequence (no cache).

    The sequence is right-padded to `pad_to` so one compiled forward serves every length
    (causal attention: padding after position t does not change position t).
    """
    tokens = np.asarray(tokens, np.int32)
    graphdef, params = nnx.split(model)
    if graphdef not in _FORWARD:
        _FORWARD[graphdef] = jax.jit(
            lambda p, ids: nnx.merge(graphdef, p)(ids, jnp.arange(ids.shape[1])[None])
        )
    padded = np.zeros((1, max(pad_to, tokens.size)), np.int32)
    padded[0, : tokens.size] = tokens
    return _FORWARD[graphdef](params, jnp.asarray(padded))[:, : tokens.size]
