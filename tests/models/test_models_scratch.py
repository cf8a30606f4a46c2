"""The scratch model of a run (``model.scratch``): made without PyTorch, loaded by transformers."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from agentrl_jax.models import DecoderConfig
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models.tiny import save_scratch_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "llama"])
def test_scratch_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, architecture):
    config = DecoderConfig(architecture=architecture, vocab_size=53, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                           attention_bias=architecture == "qwen2", qk_norm=architecture == "qwen3",
                           max_position_embeddings=512)
    path = save_scratch_checkpoint(tmp_path / "m", config, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, 53, (2, 11))
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
    ours = load_hf_checkpoint(path)
    hidden = ours(ids, np.broadcast_to(np.arange(11), ids.shape))
    np.testing.assert_allclose(np.asarray(ours.logits(hidden)), theirs, atol=1e-4, rtol=1e-4)
    # the init is the documented one: matrices N(0, 0.1^2), norms around 1
    state = dict(hf.named_parameters())
    assert abs(float(state["model.embed_tokens.weight"].detach().std()) - 0.1) < 0.02
    assert abs(float(state["model.norm.weight"].detach().mean()) - 1.0) < 0.1


def test_the_demo_model_assets_are_made_without_pytorch(tmp_path):
    """`pip install -e .` has no PyTorch; the README's demo command must still create its model."""
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from agentrl_jax.config import load_config
        from agentrl_jax.train.setup import prepare_model_assets
        config = load_config("configs/demo.py", ["output_dir={tmp_path}", "model.scratch.hidden_size=32",
                                                 "model.scratch.intermediate_size=64", "model.scratch.num_layers=1"])
        print(prepare_model_assets(config, ["1 + 2 = 3", "12 * 34 = 408"] * 20))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "init" / "model" / "model.safetensors").exists()
    assert (tmp_path / "init" / "tokenizer" / "tokenizer_config.json").exists()
