"""The agent loop in the native chat layout: assistant turn -> tool messages -> assistant turn,
appended through the chat template, with the loss mask on exactly the sampled tokens.

Real pieces: a tiny tokenizer with the Qwen3-format and Llama 3.1-format fixture templates,
a random tiny decoder, the real Engine and Driver on one CPU device, the tool-calling
environment with the real calculator tool. Only the *parse* of each turn is scripted: a
random model does not write tool calls, so its turns are read as the calls under test.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from chat_formats import CORPUS, FORMATS, build_tokenizer
from tiny_decoder import tiny_agent_engine

from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.envs.tools import (
    ParsedTurn,
    ToolCall,
    ToolCallingEnv,
    ToolEnvConfig,
    ToolRegistry,
    calculator_tool,
)
from agentrl_jax.envs.tools.parsers import MalformedCall
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.sampling import SamplingParams

TASK = {"question": "What is 12*34+5?", "answer": "413"}
PER_TURN = 6
MAX_TOKENS = 320
SCRIPT = [
    ParsedTurn("", (ToolCall("calculator", {"expression": "12*34"}), MalformedCall("bad_json", "not JSON"))),
    ParsedTurn("", (ToolCall("calculator", {"expression": "408+5"}),)),
    ParsedTurn("413"),
]


# Llama 3.1 compiles a second engine (its own vocabulary): slow; the default suite runs Qwen3.
@pytest.fixture(scope="module", params=["qwen3", pytest.param("llama3.1", marks=pytest.mark.slow)])
def setup(request, tmp_path_factory):
    fmt = FORMATS[request.param]
    root = tmp_path_factory.mktemp("tok")
    # A vocabulary trained on the rendered conversation keeps the prompt short (and the test fast).
    draft = build_tokenizer(fmt, root / "draft")
    env = make_env(fmt)
    texts = [draft.render_chat(asyncio.run(env.reset(TASK)), tools=env.tools)] * 20 + list(CORPUS)
    tok = build_tokenizer(fmt, root / fmt.name, individual_digits=True, texts=texts, vocab_size=1200)
    engine, params = tiny_agent_engine(tok.vocab_size, slots=2, max_target_length=MAX_TOKENS, max_prefill_length=256,
                                       min_prefill_bucket=32, max_position_embeddings=512)
    return fmt, tok, engine, params


def make_env(fmt) -> ToolCallingEnv:
    return ToolCallingEnv(lambda: ToolRegistry([calculator_tool()]),
                          ToolEnvConfig(tool_format=fmt.tool_format, system_prompt="Use the calculator."))


def run_episode(setup, seed: int):
    fmt, tok, engine, params = setup
    env = make_env(fmt)
    script = list(SCRIPT)
    env.parse = lambda text: script.pop(0)

    async def main():
        async with Driver(engine, params, eos_token_ids=tok.eos_token_ids,
                          detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True)) as driver:
            loop = AgentLoop(driver, tok, max_new_tokens_per_turn=PER_TURN, max_total_tokens=MAX_TOKENS)
            return await loop.run_episode(env, TASK, SamplingParams(temperature=1.0, seed=seed))

    return asyncio.run(main()), env


def runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of the maximal constant runs of ``mask``."""
    edges = [0, *np.flatnonzero(np.diff(mask)) + 1, len(mask)]
    return [(int(mask[a]), a, b) for a, b in zip(edges[:-1], edges[1:])]


def test_tool_messages_are_appended_through_the_template_and_masked(setup):
    fmt, tok, _, _ = setup
    t, env = run_episode(setup, seed=0)
    assert t.finish_reason == "answer"
    assert t.reward_components["correct"] == 1.0 and t.reward == 1.0
    assert (t.tool_stats.calls, t.tool_stats.malformed, t.tool_stats.errors) == (3, 1, 1)
    ids, mask = t.token_ids.tolist(), t.loss_mask
    prompt = tok.apply_chat(env.initial_messages(TASK), tools=env.tools, add_generation_prompt=True)
    assert len(prompt) < 256
    assert ids[:len(prompt)] == prompt and '"name": "calculator"' in tok.decode(prompt)
    assert t.tools == env.tools and t.tools[0]["function"]["name"] == "calculator"
    # prompt, turn 1, tool glue 1, turn 2, tool glue 2, turn 3: mask runs 0 1 0 1 0 1.
    segments = runs(mask)
    assert [v for v, _, _ in segments] == [0, 1, 0, 1, 0, 1]
    tool_messages = [m for m in env.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages[:1] + tool_messages[2:]] == ["408", "413"]
    assert tool_messages[1]["content"].startswith("Error: not JSON.")
    batches = [tool_messages[:2], tool_messages[2:]]
    for (_, start, end), messages in zip([s for s in segments if s[0] == 0][1:], batches):
        glue = ids[start:end]
        expected = tok.append_messages(ids[:start], messages, tools=env.tools, close_turn=True)[1]
        assert glue == expected
        if ids[start - 1] not in tok.eos_token_ids:  # the turn hit its token budget: closed by glue
            assert glue[0] == tok.eos_token_ids[0]
        header = "<|start_header_id|>ipython" if fmt.name == "llama3.1" else "<|im_start|>user\n<tool_response>"
        assert header in tok.decode(glue)
    # Sampled tokens carry the engine's logprobs and params versions; template glue does not.
    sampled = mask.astype(bool)
    assert np.all(t.params_versions[sampled] >= 0) and np.all(t.params_versions[~sampled] == -1)
    assert np.all(t.rollout_logprobs[~sampled] == 0.0)
    assert [m["role"] for m in t.turns] == ["system", "user", "assistant", "tool", "tool", "assistant", "tool",
                                            "assistant"]
