"""Flax NNX decoder family (Llama 3, Qwen2/2.5, Qwen3), KV cache, HF checkpoint I/O, tokenizer."""

from agentrl_jax.models.config import ARCHITECTURES, DecoderConfig, Llama3RopeScaling
from agentrl_jax.models.decoder import (
    Decoder,
    apply,
    layer_param_specs,
    param_logical_axes,
    param_shardings,
    split_params,
)
from agentrl_jax.models.kv_cache import KV_CACHE_AXES, KVCache

__all__ = [
    "ARCHITECTURES",
    "KV_CACHE_AXES",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "Llama3RopeScaling",
    "apply",
    "layer_param_specs",
    "param_logical_axes",
    "param_shardings",
    "split_params",
]
