"""Chat-template fixtures of three model families, written for these tests from the families'
documented prompt formats (Qwen2.5 and Qwen3 function calling in Hermes style, Llama 3.1 JSON
tool calling), each with a tiny BPE tokenizer trained with `tokenizers` on the family's
special tokens and pre-tokenizer split pattern.

They reproduce the formats' observable behaviour, including the parts the trainer must cope
with: Qwen3 drops the `<think>` block of an assistant turn that is no longer the latest (and
adds an empty one to the generation prompt when thinking is off), Llama 3.1 renders a tool
call turn as the bare JSON object and trims message contents.
"""

from __future__ import annotations

import dataclasses

from agentrl_jax.models.tiny import train_tiny_tokenizer
from agentrl_jax.models.tokenizer import Tokenizer

# Every piece of output is a {{ '...' }} expression: transformers renders templates with
# trim_blocks and lstrip_blocks, so literal text next to a tag would lose its newlines.
# The Hermes-style tools preamble both Qwen generations put in the system turn.
_HERMES_TOOLS = (
    "{%- macro tools_block(tools) -%}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>' -}}"
    "{%- endmacro -%}"
    "{%- macro call_json(call) -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\n</tool_call>' -}}"
    "{%- endmacro -%}"
    # Consecutive tool results share one user turn, each in <tool_response> tags.
    "{%- macro tool_turn(messages, i) -%}"
    "{%- if i == 0 or messages[i - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + messages[i].content + '\n</tool_response>' -}}"
    "{%- if i + 1 == messages | length or messages[i + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endmacro -%}"
)

QWEN25_TEMPLATE = _HERMES_TOOLS + (
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{{- messages[0].content if has_system else 'You are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.' -}}"
    "{%- if tools -%}{{- '\n\n' + tools_block(tools) -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- for m in messages -%}{%- set i = loop.index0 -%}"
    "{%- if i == 0 and has_system -%}"
    "{%- elif m.role == 'tool' -%}{{- tool_turn(messages, i) -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}{{- '<|im_start|>assistant' -}}"
    "{%- if m.content -%}{{- '\n' + m.content -}}{%- endif -%}"
    "{%- for call in m.tool_calls -%}{{- '\n' + call_json(call) -}}{%- endfor -%}{{- '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

QWEN3_TEMPLATE = _HERMES_TOOLS + (
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}{{- '<|im_start|>system\n' -}}"
    "{%- if has_system -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}"
    "{{- tools_block(tools) + '<|im_end|>\n' -}}"
    "{%- elif has_system -%}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}{%- endif -%}"
    # The latest real user query: tool results wrapped as user turns do not count.
    "{%- set state = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' and not (m.content.startswith('<tool_response>') "
    "and m.content.endswith('</tool_response>')) -%}{%- set state.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set i = loop.index0 -%}"
    "{%- if i == 0 and has_system -%}"
    "{%- elif m.role == 'tool' -%}{{- tool_turn(messages, i) -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set text = m.content if m.content is string else '' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}"
    "{%- if not reasoning and '</think>' in text -%}"
    "{%- set reasoning = text.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set text = text.split('</think>')[-1] -%}{%- endif -%}"
    "{%- set reasoning = reasoning.strip('\n') -%}{%- set text = text.lstrip('\n') -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    # Thinking is shown only in turns after the latest query, and only while it is
    # non-empty or the turn is the last message: earlier turns are rendered without it.
    "{%- if i > state.last_query and (loop.last or reasoning) -%}"
    "{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}{%- endif -%}"
    "{{- text -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}{{- call_json(call) -}}"
    "{%- endfor -%}{{- '<|im_end|>\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

LLAMA31_TEMPLATE = (
    "{%- set today = date_string if date_string is defined else '26 Jul 2024' -%}"
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{{- bos_token + '<|start_header_id|>system<|end_header_id|>\n\n' -}}"
    "{%- if tools -%}{{- 'Environment: ipython\n' -}}{%- endif -%}"
    "{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + today + '\n\n' -}}"
    "{{- (messages[0].content | trim if has_system else '') + '<|eot_id|>' -}}"
    "{%- set state = namespace(tools_shown=false) -%}"
    "{%- for m in messages -%}{%- set i = loop.index0 -%}"
    "{%- if i == 0 and has_system -%}"
    "{%- elif m.role == 'user' -%}{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}"
    # JSON tool calling: the tool list goes into the first user message.
    "{%- if tools and not state.tools_shown -%}{%- set state.tools_shown = true -%}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n' -}}"
    "{%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\n\n' -}}{%- endfor -%}{%- endif -%}"
    "{{- (m.content | trim) + '<|eot_id|>' -}}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{%- if m.tool_calls | length != 1 -%}{{- raise_exception('Llama 3.1 makes one tool call per turn') -}}"
    "{%- endif -%}"
    "{%- set f = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"' + f.name + '\", \"parameters\": ' -}}"
    "{{- (f.arguments | tojson) + '}<|eot_id|>' -}}"
    "{%- elif m.role in ('tool', 'ipython') -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' -}}"
    "{%- else -%}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)

# Pre-tokenizer split patterns of the families' tokenizer.json (Qwen2 splits digits singly).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
                "</think>")
LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    name: str
    template: str
    tool_format: str  # envs/tools parser: "hermes" or "llama3"
    thinking_kwarg: bool  # the template reads enable_thinking
    tokenizer_kwargs: dict


FORMATS = {
    "qwen2.5": ChatFormat("qwen2.5", QWEN25_TEMPLATE, "hermes", False,
                          dict(special_tokens=QWEN_SPECIAL, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               split_pattern=QWEN2_SPLIT, generation_eos_tokens=("<|im_end|>", "<|endoftext|>"))),
    "qwen3": ChatFormat("qwen3", QWEN3_TEMPLATE, "hermes", True,
                        dict(special_tokens=QWEN_SPECIAL, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                             split_pattern=QWEN2_SPLIT, generation_eos_tokens=("<|im_end|>", "<|endoftext|>"))),
    "llama3.1": ChatFormat("llama3.1", LLAMA31_TEMPLATE, "llama3", False,
                           dict(special_tokens=LLAMA_SPECIAL, eos_token="<|eot_id|>",
                                pad_token="<|finetune_right_pad_id|>", bos_token="<|begin_of_text|>",
                                split_pattern=LLAMA3_SPLIT,
                                generation_eos_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))),
}

CORPUS = [
    "What is 12 * 34? Let me compute it with the python tool. The answer is \\boxed{408}.",
    'def f(x):\n    return x * 2\nprint(f(21))\n{"name": "python", "arguments": {"code": "print(1)"}}',
    "<tool_response>\n408\n</tool_response> Cutting Knowledge Date: December 2023 Today Date",
    "You may call one or more functions to assist with the user query. Given the following functions",
    "The capital of Zorvia is Quellin. Search results: Doc 1(Title: Zorvia) a small country.",
] * 20


def build_tokenizer(fmt: ChatFormat, path, *, individual_digits: bool = False, texts=CORPUS,
                    vocab_size: int = 400, **tokenizer_kwargs) -> Tokenizer:
    """A tiny tokenizer of ``fmt``'s family with its chat template, loaded as our Tokenizer."""
    train_tiny_tokenizer(path, texts, vocab_size, chat_template=fmt.template, individual_digits=individual_digits,
                         **fmt.tokenizer_kwargs)
    return Tokenizer(path, **tokenizer_kwargs)
