"""The demo in the native tool-call layout, end to end through the real entry point.

`launch/tpu_pod.py --config configs/demo.py --set environment.layout=native`: the scratch
tokenizer's ChatML template lists the `python` tool in the system turn, SFT runs on
demonstrations in the native layout (a `python` tool call, its tool message, the answer), the policy's turns
end at its end-of-turn token, tool calls are parsed in the Hermes format, and 2 RL steps run
through the real engine, driver, sandbox pool and trainer on a (data=2, fsdp=2, tensor=2)
mesh. (The random scratch model rarely writes a well-formed call; the tool-message appends
themselves are covered with the real engine in tests/envs/test_agent_loop_native.py.)
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

NATIVE_TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=8", "rollout.max_prompt_length=640",
    "rollout.max_sequence_length=704", "data.prompts_per_step=2", "algorithm.group_size=4",
    "algorithm.entropy_coef=0.01", "environment.num_train_tasks=16", "environment.num_eval_tasks=2",
    "eval.num_tasks=2", "eval.samples_per_task=1", "sft.steps=2", "sft.batch_size=4", "sft.max_length=768", "total_steps=2", "checkpoint.resume=false",
    "logging.sample_trajectories=2", "environment.layout=native", "environment.tool_format=hermes",
]


@pytest.mark.slow  # ~1 min of compilation for 700-token rows; the fast variant is tests/envs/test_agent_loop_native.py
def test_demo_trains_two_steps_in_the_native_tool_call_layout(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py",
           "--set", f"output_dir={out}"]
    for item in NATIVE_TINY:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "loss" in r}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert math.isfinite(m["loss"]) and m["skipped"] == 0 and m["update_norm"] > 0
        assert m["logprob_gap_train_infer"] < 1e-4 and m["rollout/sampled_tokens"] > 0
    sft = [json.loads(line) for line in (out / "sft_metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft if "sft/loss" in r] == [0, 1]  # SFT on native demonstrations
    samples = [json.loads(line) for line in (out / "metrics" / "samples.jsonl").read_text().splitlines()]
    text = "\n".join(str(s) for s in samples)
    assert "<tools>" in text and '"name": "python"' in text.replace('\\"', '"')
