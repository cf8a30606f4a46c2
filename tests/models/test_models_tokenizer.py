"""Tokenizer wrapper: chat rendering, appending messages without re-tokenizing, eos/pad ids."""

import json
import os

import pytest

from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer

TEXTS = [
    "What is 2 + 3? The answer is 5.",
    "def f(x):\n    return x * 2\n",
    "Let me compute this with code. <code>print(2 + 3)</code>",
    "<interpreter>5</interpreter> So the final answer is \\boxed{5}.",
] * 10

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is 2 + 3?"}
ASSISTANT = {
    "role": "assistant",
    "content": "Let me compute this with code. <code>print(2 + 3)</code>",
}
TOOL = {"role": "tool", "content": "<interpreter>5</interpreter>"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok", TEXTS, vocab_size=300)
    return Tokenizer(path)


def test_saved_directory_has_chatml_template_and_special_tokens(tokenizer):
    config = json.load(open(os.path.join(tokenizer.path, "tokenizer_config.json")))
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>"
    assert tokenizer.hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]


def test_eos_and_pad_ids(tokenizer, tmp_path):
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.pad_token_id == 0
    extra = Tokenizer(tokenizer.path, extra_eos_tokens=["<|endoftext|>"])
    assert extra.eos_token_ids == (2, 0)
    with pytest.raises(ValueError, match="extra eos token '<nope>' is not in the vocabulary"):
        Tokenizer(tokenizer.path, extra_eos_tokens=["<nope>"])


def test_encode_decode_round_trip(tokenizer):
    text = "Let me compute 2 + 3 with code.\n<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[-1] == 2  # the special token is parsed, not spelled out
    assert tokenizer.decode(ids) == text


def test_apply_chat_matches_apply_chat_template(tokenizer):
    messages = [SYSTEM, USER]
    ids = tokenizer.apply_chat(messages)
    raw = tokenizer.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    raw = raw["input_ids"] if not isinstance(raw, list) else raw
    assert ids == list(raw)
    text = tokenizer.render_chat(messages)
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tokenizer.encode(text)
    assert tokenizer.apply_chat(messages, add_generation_prompt=False) == tokenizer.encode(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    )


def test_append_after_generated_turn_equals_rerendering(tokenizer):
    prompt = tokenizer.apply_chat([SYSTEM, USER])
    generated = tokenizer.encode(ASSISTANT["content"]) + [tokenizer.eos_token_ids[0]]
    so_far = prompt + generated
    new_ids, appended = tokenizer.append_message(so_far, TOOL, add_generation_prompt=True)
    full = tokenizer.apply_chat([SYSTEM, USER, ASSISTANT, TOOL], add_generation_prompt=True)
    assert new_ids == full
    assert new_ids[: len(so_far)] == so_far and new_ids[len(so_far) :] == appended
    assert (
        tokenizer.decode(appended)
        == "\n<|im_start|>tool\n<interpreter>5</interpreter><|im_end|>\n<|im_start|>assistant\n"
    )


def test_append_after_rendered_turn_and_without_generation_prompt(tokenizer):
    ids = tokenizer.apply_chat([SYSTEM, USER], add_generation_prompt=False)
    second = {"role": "user", "content": "And 2 * 3?"}
    new_ids, appended = tokenizer.append_message(ids, second, add_generation_prompt=False)
    assert new_ids == tokenizer.apply_chat([SYSTEM, USER, second], add_generation_prompt=False)
    assert tokenizer.decode(appended).startswith("<|im_start|>user\n")


def test_template_that_rerenders_history_is_rejected(tmp_path):
    template = (
        "{{ messages|length }}{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    path = train_tiny_tokenizer(tmp_path / "bad", TEXTS, vocab_size=280, chat_template=template)
    with pytest.raises(ValueError, match="renders the first user message differently"):
        Tokenizer(path).append_message([5, 2], {"role": "user", "content": "hi"})
