"""configs/multi_policy_smollm2.py end to end on CPU: two policies from the real SmolLM2-135M-Instruct
GGUF file, a solver and a checker on 4 fake devices each, each cold-started on its own
demonstrations in the model's chat template, one RL step of the solver-checker episode, an
export per policy.

A pipeline check at a size a CPU runs in minutes, not a learning claim. Slow, and it needs the
real file: $AGENTRL_SMOLLM2_GGUF, else where ``python -m agentrl_jax.assets smollm2 DIR`` caches it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from test_smollm2_tools import GGUF, SMOKE

from agentrl_jax.config import load_config
from agentrl_jax.models import Tokenizer
from agentrl_jax.train.run import train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} not found: set AGENTRL_SMOLLM2_GGUF or run "
                       "`python -m agentrl_jax.assets smollm2 DIR`"),
    pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices: a policy on each half"),
]


def test_a_pretrained_solver_and_checker_train_in_one_episode(tmp_path):
    config = load_config(str(ROOT / "configs" / "multi_policy_smollm2.py"), [
        f"model.path={GGUF}", f"output_dir={tmp_path}", *SMOKE, "multi_policy.policies.checker.sft.steps=2",
        "logging.sample_trajectories=1", "checkpoint.export_hf=true",
        # two episodes a task rarely differ in reward: the entropy term still moves both policies (from
        # the first step: no warm-up from a learning rate of 0)
        "algorithm.entropy_coef=0.01", "optimizer.warmup_steps=0"])
    results = train(config)
    assert results["schedule"] == "concurrent"  # a policy on each half of the devices
    for stage in ("start", "end"):
        assert {"team/final_correct", "team/first_correct", "checker/accuracy"} <= set(results[stage])
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in rows if "solver/train_tokens" in r]
    for policy in ("solver", "checker"):
        assert step[f"{policy}/train_tokens"] > 0 and step[f"{policy}/update_norm"] > 0, policy
        sft = tmp_path / "policies" / policy / "sft_metrics" / "metrics.jsonl"
        assert sft.exists() and sft.read_text().strip(), policy  # its own cold start ran
        assert Tokenizer(tmp_path / "export" / policy).vocab_size == 49152  # SmolLM2's, in each export
    samples = {json.loads(line)["tag"]: json.loads(line)["text"]
               for line in (tmp_path / "metrics" / "samples.jsonl").read_text().splitlines()}
    checker = samples["checker/sample_0"]  # the checker reads the problem and the solver's transcript
    assert "<|im_start|>system" in checker and "Solution:" in checker
