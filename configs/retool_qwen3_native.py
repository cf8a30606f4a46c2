"""ReTool with a Qwen3 instruct model calling its interpreter through native tool calls.

The same tasks, reward and recipe as configs/retool.py, but the episode is a chat in the
model's own format (docs/chat_formats.md): the chat template lists a `python` tool in the
system turn, the model writes Hermes-style `<tool_call>{"name": "python", "arguments":
{"code": ...}}</tool_call>` blocks and ends its turn, each result comes back as a tool
message (`<tool_response>` inside a user turn), and the turn without a call is graded on its
`\\boxed{}` answer. Thinking is on (`enable_thinking`), so each turn may open with a
`<think>` block; the trajectory keeps every turn's reasoning as sampled, although Qwen3's
template would hide earlier turns' reasoning once a new user query follows.

    python launch/tpu_pod.py --config retool_qwen3_native \\
        --set model.path=/data/Qwen3-4B \\
        --set data.train_path=/data/dapo_math_17k.parquet \\
        --set data.eval_path=/data/aime_2024.jsonl

Turn thinking off with `--set 'model.chat_template_kwargs={"enable_thinking": false}'`. A Llama 3.1
instruct model takes `--set environment.tool_format=llama3` (one JSON call per turn).
"""

import dataclasses
from pathlib import Path


def get_config():
    # The paths are left to the command line; load_config checks them after the overrides.
    base = _retool()
    return dataclasses.replace(
        base,
        name="retool_qwen3_native",
        output_dir="runs/retool_qwen3_native",
        model=dataclasses.replace(base.model, chat_template_kwargs={"enable_thinking": True}),
        environment=dataclasses.replace(base.environment, layout="native", tool_format="hermes"),
    )


def _retool():
    import importlib.util

    path = Path(__file__).with_name("retool.py")
    spec = importlib.util.spec_from_file_location("agentrl_jax_config_retool_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()
