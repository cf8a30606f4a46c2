"""configs/smollm2_tools.py end to end on CPU with the real SmolLM2-135M-Instruct GGUF file.

A pipeline check at a size a CPU runs in a few minutes (2 SFT steps, 1 RL step, 2 held-out tasks),
not a learning claim: docs/smollm2_tools.md has the GPU numbers. Slow, and it needs the real file:
$AGENTRL_SMOLLM2_GGUF, else where ``python -m agentrl_jax.assets smollm2 DIR`` caches it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from hf_reference import engine_greedy, hf_greedy
from repo_scripts import load_script

from agentrl_jax.assets import SMOLLM2
from agentrl_jax.config import load_config
from agentrl_jax.models import Tokenizer, load_hf_checkpoint
from agentrl_jax.models.gguf_cache import cache_root
from agentrl_jax.train.run import train

ROOT = Path(__file__).resolve().parents[2]
GGUF = Path(os.environ.get("AGENTRL_SMOLLM2_GGUF") or cache_root() / "assets" / SMOLLM2.gguf_name)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} not found: set AGENTRL_SMOLLM2_GGUF or run "
                       "`python -m agentrl_jax.assets smollm2 DIR`"),
]
SMOKE = [
    "sft.steps=2", "sft.batch_size=2", "total_steps=1", "data.prompts_per_step=2", "algorithm.group_size=2",
    "algorithm.minibatches=1", "eval.num_tasks=2", "eval.samples_per_task=1", "environment.num_demonstrations=8",
    "environment.num_train_tasks=50", "environment.num_eval_tasks=4", "rollout.max_concurrent=8",
    "rollout.kv_cache_bytes=268435456", "environment.sandbox.workers=2", "logging.progress=false",
    "checkpoint.every_steps=0",
]


PROMPTS = ["Compute 4821*(937 + 55).", "Hi! How are you today?", "Why is the sky blue?",
           "Find the least common multiple of 136 and 472."]
NEW_TOKENS = 24


def test_the_recipe_runs_from_the_gguf_file_and_its_export_decodes_as_our_engine(tmp_path):
    """The recipe at smoke size, then the trained policy's HF export: transformers loads it and its
    greedy tokens equal our engine's on 4 chat prompts."""
    config = load_config(str(ROOT / "configs" / "smollm2_tools.py"),
                         [f"model.path={GGUF}", f"output_dir={tmp_path}", *SMOKE])
    results = train(config)
    for stage in ("start", "end"):
        assert {"held_out_range/pass_at_1", "held_out_combo/pass_at_1"} <= set(results[stage])
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/mean" in r for r in rows)

    export = tmp_path / "export"
    tokenizer = Tokenizer(export)
    prompts = [tokenizer.apply_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert all(p[:3] == prompts[0][:3] for p in prompts)  # the ChatML template came along: same header
    ours = engine_greedy(load_hf_checkpoint(export), prompts, NEW_TOKENS)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(theirs, prompt, NEW_TOKENS)


def test_the_config_file_points_at_the_assets_cache():
    module = load_script("configs/smollm2_tools.py")
    assert Path(module.get_config().model.path) == cache_root() / "assets" / SMOLLM2.gguf_name
