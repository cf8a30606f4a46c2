"""Tiny HF checkpoints shared by the model tests (built once per session with transformers)."""

import pytest

from agentrl_jax.models.tiny import save_tiny_hf_checkpoint

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> save_tiny_hf_checkpoint kwargs; covers llama3 rope scaling, qwen2 bias, qwen3 q/k
# norm, tied and untied embeddings, and head_dim != hidden / heads.
CHECKPOINTS = {
    "llama3_scaled": dict(
        architecture="llama", head_dim=16, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING
    ),
    "qwen2_tied": dict(architecture="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architecture="qwen3", head_dim=32),
}
VOCAB = 97


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {
        name: save_tiny_hf_checkpoint(root / name, vocab_size=VOCAB, seed=i, **kwargs)
        for i, (name, kwargs) in enumerate(CHECKPOINTS.items())
    }
