"""Flax NNX decoder family (Llama 3, Qwen2/2.5, Qwen3), the rollout engine's forward over a KV cache
(`decode`), HF checkpoint I/O, tokenizer, and the output logits both the sampler and the trainer
compute (`logits`)."""

from agentrl_jax.models.config import ARCHITECTURES, DecoderConfig, Llama3RopeScaling
from agentrl_jax.models.decoder import Decoder, apply, split_params
from agentrl_jax.models.hf_io import (
    load_hf_checkpoint,
    load_hf_params,
    save_hf_checkpoint,
)
from agentrl_jax.models.logits import output_logits, temperature_scaled
from agentrl_jax.models.params import layer_param_specs, param_logical_axes, param_shardings, param_specs
from agentrl_jax.models.safetensors_io import CheckpointError
from agentrl_jax.models.tiny import save_tiny_hf_checkpoint, train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer

__all__ = [
    "ARCHITECTURES",
    "CheckpointError",
    "Decoder",
    "DecoderConfig",
    "Llama3RopeScaling",
    "Tokenizer",
    "apply",
    "layer_param_specs",
    "load_hf_checkpoint",
    "load_hf_params",
    "output_logits",
    "param_logical_axes",
    "param_shardings",
    "param_specs",
    "save_hf_checkpoint",
    "save_tiny_hf_checkpoint",
    "split_params",
    "temperature_scaled",
    "train_tiny_tokenizer",
]
