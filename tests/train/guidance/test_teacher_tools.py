"""The hindsight teacher's prompt of a native-layout trajectory lists the same tools as the
student's: the hint is placed in the user message and the prompt re-rendered with the
trajectory's tool schemas, so teacher and student differ only by the hint."""

import numpy as np

from agentrl_jax.envs.base import Trajectory
from agentrl_jax.envs.tools import calculator_tool
from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.train.guidance.distillation import teacher_context


def test_teacher_prompt_lists_the_trajectorys_tools(tmp_path):
    tok = Tokenizer(train_tiny_tokenizer(tmp_path / "tok", ["What is 2+3? calculator expression"] * 20, 300))
    tools = [calculator_tool().schema()]
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tok.apply_chat(messages, tools=tools)
    response = tok.encode("5") + [tok.eos_token_ids[0]]
    n = len(prompt) + len(response)
    trajectory = Trajectory(
        prompt_token_ids=np.asarray(prompt), token_ids=np.asarray(prompt + response),
        loss_mask=np.asarray([0] * len(prompt) + [1] * len(response), np.int8),
        rollout_logprobs=np.zeros(n, np.float32), params_versions=np.full(n, -1, np.int32),
        turns=messages + [{"role": "assistant", "content": "5"}], tools=tools)
    context = teacher_context(trajectory, "add the numbers", tok, placement="user_message", hint_format=" Hint: {hint}")
    teacher_prompt = context.token_ids[:context.prompt_length]
    assert teacher_prompt == tok.apply_chat([{"role": "user", "content": "What is 2+3? Hint: add the numbers"}],
                                            tools=tools)
    assert '"name": "calculator"' in tok.decode(teacher_prompt)
    assert context.token_ids[context.prompt_length:] == response
