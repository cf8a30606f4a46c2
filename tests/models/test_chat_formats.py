"""Template-exact multi-turn appends for the Qwen2.5, Qwen3 and Llama 3.1 chat formats.

The invariant (docs/chat_formats.md): the ids built turn by turn, as the agent loop builds them (the
prompt, then each sampled turn with its end-of-turn token, then the tool messages appended
with ``Tokenizer.append_messages``), equal the ids of rendering the whole message list at
once, for 1-5 tool turns, thinking on and off. The one exception is a template that
rewrites history: Qwen3 renders an earlier turn without its empty ``<think>`` block (thinking
off) and drops all earlier reasoning once a new user query follows; the trajectory keeps
what was sampled, and the tests pin the difference to exactly that.
"""

from __future__ import annotations

import pytest
from chat_formats import FORMATS, build_tokenizer

from agentrl_jax.envs.tools.parsers import ToolCall, format_calls, parser_for
from agentrl_jax.train.sft import conversation_to_record

TOOLS = [
    {"type": "function", "function": {"name": "python", "description": "Run Python code.", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
]
INITIAL = [{"role": "system", "content": "You solve math problems."},
           {"role": "user", "content": "What is 12 * 34 + 5?"}]
QWEN3_EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_formats")
    return {name: build_tokenizer(fmt, root / name) for name, fmt in FORMATS.items()}


def template_kwargs(fmt, thinking: bool) -> dict:
    return {"enable_thinking": thinking} if fmt.thinking_kwarg else {}


def sampled_turn(fmt, thinking: bool, k: int) -> tuple[str, list[ToolCall]]:
    """What the model writes in tool turn k: (think block), (text), one or two calls."""
    calls = [ToolCall("python", {"code": f"print({k} * 7)"})]
    if fmt.tool_format == "hermes" and k == 1:
        calls.append(ToolCall("calculator", {"expression": f"{k} + 12 * 34"}))
    if fmt.tool_format == "llama3":  # Llama 3.1 tool turns are the bare JSON object
        return format_calls(calls, "llama3"), calls
    content = f"Step {k}: let me run it." if k % 2 == 0 else ""
    think = f"<think>\nI should compute part {k}.\n</think>\n\n" if thinking else ""
    return think + format_calls(calls, "hermes", content=content), calls


def final_turn(thinking: bool) -> str:
    return ("<think>\nAll parts are known.\n</think>\n\n" if thinking else "") + "So the answer is \\boxed{413}."


def episode(tok, fmt, thinking: bool, num_turns: int):
    """Builds an episode incrementally; yields (ids, mask, messages, sampled) after every step."""
    kwargs = template_kwargs(fmt, thinking)
    parse = parser_for(fmt.tool_format)
    ids = tok.apply_chat(INITIAL, tools=TOOLS, add_generation_prompt=True, **kwargs)
    mask, messages, sampled = [0] * len(ids), list(INITIAL), []
    for k in range(num_turns + 1):
        text, calls = sampled_turn(fmt, thinking, k) if k < num_turns else (final_turn(thinking), [])
        turn = tok.encode(text) + [tok.eos_token_ids[0]]
        ids, mask, sampled = ids + turn, mask + [1] * len(turn), sampled + [turn]
        parsed = parse(text)
        assert [c for c in parsed.calls] == calls
        messages.append(parsed.assistant_message())
        if k == num_turns:
            yield ids, mask, messages, sampled
            return
        results = [{"role": "tool", "name": c.name, "content": f"{7 * k + i}"} for i, c in enumerate(calls)]
        messages += results
        ids, appended = tok.append_messages(ids, results, tools=TOOLS, **kwargs)
        mask += [0] * len(appended)
        yield ids, mask, messages, sampled


def expected_view(fmt, thinking: bool, text: str) -> str:
    """The text with the documented history rewrite applied (identity where there is none)."""
    if fmt.name == "qwen3" and not thinking:
        return text.replace(QWEN3_EMPTY_THINK, "<|im_start|>assistant\n")
    return text


@pytest.mark.parametrize("thinking", [True, False], ids=["think", "no_think"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_incremental_ids_equal_full_render(tokenizers, name, thinking):
    fmt, tok = FORMATS[name], tokenizers[name]
    kwargs = template_kwargs(fmt, thinking)
    rewrites = name == "qwen3" and not thinking
    for num_turns in range(1, 6):
        for ids, mask, messages, sampled in episode(tok, fmt, thinking, num_turns):
            done = messages[-1]["role"] == "assistant"
            full = tok.apply_chat(messages, tools=TOOLS, add_generation_prompt=not done, **kwargs)
            # A trajectory ends at the final eos; the full render adds the template's turn tail.
            tail = tok.messages_delta([], tools=TOOLS, **kwargs)[1] if done else ""
            if not rewrites:
                assert ids + tok.encode(tail) == full, (num_turns, tok.decode(ids), tok.decode(full))
                continue
            # Qwen3 with thinking off: each earlier turn keeps the empty think block the
            # generation prompt put before it; the full render drops it. Nothing else differs.
            incremental_text, full_text = tok.decode(ids) + tail, tok.decode(full)
            assert incremental_text.count(QWEN3_EMPTY_THINK) == len(sampled) + (not done)
            assert full_text.count(QWEN3_EMPTY_THINK) == 1
            assert expected_view(fmt, thinking, incremental_text) == expected_view(fmt, thinking, full_text)
        # The loss mask covers exactly the sampled turns, each ending with its eos token.
        assert [t for t, m in zip(ids, mask) if m] == [t for turn in sampled for t in turn]
        header = "<|start_header_id|>" if name == "llama3.1" else "<|im_start|>"
        glue = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert glue.count(header) == tok.decode(ids).count(header)  # every role header is masked


def test_qwen3_drops_earlier_reasoning_after_a_new_user_query(tokenizers):
    """The other Qwen3 rewrite: a new user query hides the reasoning of all earlier turns."""
    fmt, tok = FORMATS["qwen3"], tokenizers["qwen3"]
    *_, (ids, _, messages, _) = episode(tok, fmt, True, 2)
    follow_up = {"role": "user", "content": "And times 2?"}
    ids, _ = tok.append_messages(ids, [follow_up], tools=TOOLS, enable_thinking=True)
    full_text = tok.render_chat([*messages, follow_up], tools=TOOLS, enable_thinking=True)
    incremental_text = tok.decode(ids)
    assert incremental_text.count("<think>\nI should compute part") == 2  # kept as sampled
    assert "<think>" not in full_text
    assert incremental_text.endswith("<|im_start|>user\nAnd times 2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("name", list(FORMATS))
def test_turn_cut_before_its_eos_is_closed_by_the_template(tokenizers, name):
    """A turn without a sampled eos (token budget) gets the end-of-turn token as glue."""
    fmt, tok = FORMATS[name], tokenizers[name]
    *_, (ids, mask, messages, sampled) = episode(tok, fmt, False, 1)
    prompt = tok.apply_chat(INITIAL, tools=TOOLS, add_generation_prompt=True, **template_kwargs(fmt, False))
    cut = prompt + sampled[0][:-1]  # the first turn without its eos
    result = {"role": "tool", "name": "python", "content": "0"}
    closed, appended = tok.append_messages(cut, [result], tools=TOOLS, close_turn=True,
                                           **template_kwargs(fmt, False))
    assert appended[0] == tok.eos_token_ids[0]
    reference, _ = tok.append_messages(prompt + sampled[0], [result], tools=TOOLS, **template_kwargs(fmt, False))
    assert closed == reference


def test_template_kwargs_and_tools_reach_the_template(tokenizers, tmp_path):
    fmt = FORMATS["qwen3"]
    tok = tokenizers["qwen3"]
    assert tok.render_chat(INITIAL).endswith("<|im_start|>assistant\n")
    assert tok.render_chat(INITIAL, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert '"name": "calculator"' in tok.render_chat(INITIAL, tools=TOOLS)
    assert '"name": "calculator"' not in tok.render_chat(INITIAL)
    quiet = build_tokenizer(fmt, tmp_path / "quiet", chat_template_kwargs={"enable_thinking": False})
    assert quiet.render_chat(INITIAL).endswith("<think>\n\n</think>\n\n")
    assert quiet.apply_chat(INITIAL) == tok.apply_chat(INITIAL, enable_thinking=False)
    assert quiet.render_chat(INITIAL, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_llama_eos_ids_and_single_call_limit(tokenizers):
    tok = tokenizers["llama3.1"]
    vocab = tok.hf.convert_tokens_to_ids
    assert tok.eos_token_ids == (vocab("<|eot_id|>"), vocab("<|end_of_text|>"), vocab("<|eom_id|>"))
    assert tok.apply_chat(INITIAL)[0] == vocab("<|begin_of_text|>")
    two_calls = {"role": "assistant", "content": "", "tool_calls": [
        ToolCall("python", {"code": "1"}).message_form(), ToolCall("python", {"code": "2"}).message_form()]}
    with pytest.raises(Exception, match="one tool call per turn"):
        tok.render_chat([*INITIAL, two_calls])


@pytest.mark.parametrize("thinking", [True, False], ids=["think", "no_think"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_sft_record_of_a_conversation_equals_the_sampled_episode(tokenizers, name, thinking):
    """``conversation_ids`` (SFT records in the native layout) builds what the agent loop built."""
    fmt, tok = FORMATS[name], tokenizers[name]
    for num_turns in (1, 3):
        *_, (ids, mask, messages, _) = episode(tok, fmt, thinking, num_turns)
        assert tok.conversation_ids(messages, tools=TOOLS, **template_kwargs(fmt, thinking)) == (ids, mask)
    with pytest.raises(ValueError, match="no assistant message"):
        tok.conversation_ids(INITIAL)
    if not fmt.thinking_kwarg:  # the SFT record takes the tokenizer's own template kwargs
        record = conversation_to_record(tok, messages, tools=TOOLS)
        assert (record.token_ids, record.loss_mask) == (ids, mask)
