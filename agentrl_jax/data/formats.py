"""Public dataset shapes -> `TaskRecord` / `SFTRecord`, from local files.

Task formats (`load_task_records(paths, format=...)`):
  "task"       {"prompt": str, "answer": str|number, "id"?, "metadata"?}; the prompt may also be named
               "question", "problem" or "input", the answer "final_answer" or "target" (GSM8K rows
               load as they are; their "... #### 72" answers become "72"), see `records.py`.
  "dapo_math"  DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k): {"prompt": [{"role": "user",
               "content": ...}], "reward_model": {"ground_truth": ...}, "data_source"?, "ability"?,
               "extra_info"?: {"index": ...}}; also its flattened copies {"prompt": str, "label": ...}.
               The DAPO instruction wrapper ("Solve the following math problem step by step ... after
               \"Answer:\".") is stripped by default, because the environment states its own answer
               format (\\boxed{}); pass `strip_instruction=False` to keep it. The published parquet repeats
               each problem about a hundred times; the loaders deduplicate by default (`dedup.py`).
  "aime"       AIME-style eval files: {"problem" | "question" | "prompt": str, "answer" | "label": str|int,
               "id" | "ID"?, other fields -> metadata}.

Field names match ignoring case in every format (`Problem`/`Answer`, `reward_model.Ground_Truth`);
two keys that differ only in case are an error naming both (see `records.py`).

SFT formats (`load_sft_records(paths, format=...)`):
  "chat"       {"messages": [{"role", "content"}, ...]} with roles system/user/assistant/tool.
  "retool_sft" JoeYing/ReTool-SFT. Raw shape: two messages, a user prompt and one assistant string in
               which the model's `<code>```python ...```</code>` calls alternate with the interpreter's
               `<interpreter>...</interpreter>` output and a final `<answer>\\boxed{..}</answer>`. It is
               split into alternating assistant / tool turns: each `<interpreter>...</interpreter>` block
               (tags included) becomes a tool turn, everything else stays in assistant turns, so the
               contents concatenated in order reproduce the original response exactly and the tool
               output is masked out of the loss. The converted shape (assistant turns with
               OpenAI-style `tool_calls` to `code_interpreter` with {"code": ...}, then "tool" turns) is
               rendered back into the same tagged text. `question_only=True` keeps only the text after
               ReTool's "*user question:*" marker in the prompt.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentrl_jax.data.readers import DataStats, read_records
from agentrl_jax.data.records import (
    BadRowError,
    ChatMessage,
    SFTRecord,
    TaskRecord,
    answer_text,
    first_field,
    get_field,
    parse_messages,
    parse_sft_row,
    parse_task_row,
    record_id,
    record_metadata,
    require_field,
    require_text,
)

DAPO_PREFIX = "Solve the following math problem step by step."
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
RETOOL_QUESTION_MARKER = "*user question:*"
RETOOL_ANSWER_FORMAT_MARKER = "Remember to place the final answer in the last part using the format:"
INTERPRETER_OPEN, INTERPRETER_CLOSE = "<interpreter>", "</interpreter>"


def strip_dapo_instruction(text: str) -> str:
    """Removes DAPO's "Solve the following ... Answer:" wrapper; other text is returned as is."""
    if text.startswith(DAPO_PREFIX):
        _, sep, body = text.partition("\n\n")
        if sep:
            text = body
    if DAPO_SUFFIX in text:
        text = text.rsplit(DAPO_SUFFIX, 1)[0]
    return text.strip()


def parse_dapo_math_row(row: Mapping[str, Any], default_id: str, *, strip_instruction: bool = True) -> TaskRecord:
    """DAPO-Math-17k row -> `TaskRecord` (see the module docstring for the shape)."""
    prompt = require_field(row, "prompt")
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, Mapping) and get_field(m, "role", "prompt[].role") == "user"]
        if not users:
            raise BadRowError("missing_field", "prompt[].content", "the prompt list has no user message")
        prompt = require_text(get_field(users[-1], "content", "prompt[-1].content"), "prompt[-1].content")
    prompt = require_text(prompt, "prompt")
    if strip_instruction:
        prompt = require_text(strip_dapo_instruction(prompt), "prompt")
    reward_model = get_field(row, "reward_model")
    if reward_model is not None:
        if not isinstance(reward_model, Mapping):
            raise BadRowError("wrong_type", "reward_model", f"expected an object, got {type(reward_model).__name__}")
        answer = answer_text(require_field(reward_model, "ground_truth", "reward_model.ground_truth"),
                             "reward_model.ground_truth")
    else:
        answer = answer_text(require_field(row, "label"), "label")
    extra_info = get_field(row, "extra_info")
    index = get_field(extra_info, "index", "extra_info.index") if isinstance(extra_info, Mapping) else None
    metadata = {k: v for k in ("data_source", "ability") if (v := get_field(row, k)) is not None}
    metadata.update(record_metadata(row))
    return TaskRecord(prompt=prompt, answer=answer,
                      id=str(index) if index is not None else record_id(row, default_id), metadata=metadata)


_AIME_PROMPT_KEYS = ("problem", "question", "prompt")
_AIME_ANSWER_KEYS = ("answer", "label")


def parse_aime_row(row: Mapping[str, Any], default_id: str) -> TaskRecord:
    """AIME-style eval row -> `TaskRecord`; unused fields (year, url, solution, ...) go to metadata.

    Field names match ignoring case, so `{"ID", "Problem", "Answer"}` files load as well.
    """
    prompt_key, prompt = first_field(row, _AIME_PROMPT_KEYS)
    answer_key, answer = first_field(row, _AIME_ANSWER_KEYS)
    prompt = require_text(prompt, prompt_key)
    answer = answer_text(answer, answer_key)
    used = {prompt_key, answer_key, "id", "metadata"}
    metadata = {k: v for k, v in row.items() if str(k).lower() not in used and v is not None}
    metadata.update(record_metadata(row))
    return TaskRecord(prompt=prompt, answer=answer, id=record_id(row, default_id), metadata=metadata)


def split_interpreter_blocks(response: str, field: str) -> list[ChatMessage]:
    """Splits a ReTool response into assistant turns and `<interpreter>` tool turns.

    Contents concatenated in order equal `response`. Empty assistant text between
    two blocks is dropped (it carries no tokens).

    Raises:
      BadRowError: an `<interpreter>` without its closing tag, or a stray closing tag.
    """
    turns: list[ChatMessage] = []
    rest = response
    while rest:
        start = rest.find(INTERPRETER_OPEN)
        stray = rest.find(INTERPRETER_CLOSE)
        if stray != -1 and (start == -1 or stray < start):
            raise BadRowError("malformed", field, f"{INTERPRETER_CLOSE} without a matching {INTERPRETER_OPEN}")
        if start == -1:
            turns.append(ChatMessage("assistant", rest))
            break
        end = rest.find(INTERPRETER_CLOSE, start)
        if end == -1:
            raise BadRowError("malformed", field, f"{INTERPRETER_OPEN} without a closing {INTERPRETER_CLOSE}")
        end += len(INTERPRETER_CLOSE)
        if rest[:start]:
            turns.append(ChatMessage("assistant", rest[:start]))
        turns.append(ChatMessage("tool", rest[start:end]))
        rest = rest[end:]
    return turns


def retool_question(prompt: str) -> str:
    """The question inside ReTool's instruction template (the prompt itself if absent)."""
    if RETOOL_QUESTION_MARKER not in prompt:
        return prompt
    question = prompt.split(RETOOL_QUESTION_MARKER, 1)[1]
    question = question.split(RETOOL_ANSWER_FORMAT_MARKER, 1)[0]
    return question.replace("<answer>", "").replace("</answer>", "").strip()


def _tool_call_code(message: Mapping[str, Any], path: str) -> str:
    calls = get_field(message, "tool_calls", f"{path}.tool_calls")
    if not isinstance(calls, list) or len(calls) != 1:
        raise BadRowError("malformed", f"{path}.tool_calls", "expected exactly one code_interpreter call")
    call_path = f"{path}.tool_calls[0]"
    function = get_field(calls[0], "function", f"{call_path}.function") if isinstance(calls[0], Mapping) else None
    if not isinstance(function, Mapping):
        raise BadRowError("missing_field", f"{call_path}.function", "no function object")
    arguments = get_field(function, "arguments", f"{call_path}.function.arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise BadRowError("malformed", f"{path}.tool_calls[0].function.arguments", str(e)) from e
    if not isinstance(arguments, Mapping):
        raise BadRowError("wrong_type", f"{path}.tool_calls[0].function.arguments", "expected an object")
    code_path = f"{call_path}.function.arguments.code"
    return require_text(get_field(arguments, "code", code_path), code_path)


def render_tool_call_messages(messages: Sequence[Any], field: str = "messages") -> list[dict[str, str]]:
    """Converted ReTool rows (OpenAI-style tool_calls) -> plain role/content dicts in the tagged text.

    An assistant turn with a call becomes `content + "\\n<code>\\n```python\\n{code}\\n```\\n</code>\\n"`
    and a tool turn `"<interpreter>\\n{output}\\n</interpreter>\\n"`, the text shape of the raw
    ReTool-SFT responses. Turns without `tool_calls` are passed through.
    """
    rendered = []
    for i, message in enumerate(messages):
        path = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise BadRowError("wrong_type", path, f"expected an object, got {type(message).__name__}")
        role = get_field(message, "role", f"{path}.role")
        content = get_field(message, "content", f"{path}.content") or ""
        if role == "assistant" and get_field(message, "tool_calls", f"{path}.tool_calls"):
            code = _tool_call_code(message, path)
            text = require_text(content, f"{path}.content", allow_empty=True)
            content = f"{text}\n<code>\n```python\n{code}\n```\n</code>\n".lstrip("\n")
        elif role == "tool" and not str(content).startswith(INTERPRETER_OPEN):
            text = require_text(content, f"{path}.content", allow_empty=True)
            content = f"{INTERPRETER_OPEN}\n{text}\n{INTERPRETER_CLOSE}\n"
        rendered.append({"role": role, "content": content})
    return rendered


def parse_retool_sft_row(row: Mapping[str, Any], default_id: str, *, question_only: bool = False) -> SFTRecord:
    """ReTool-SFT row (raw or converted, see the module docstring) -> `SFTRecord`."""
    messages = require_field(row, "messages")
    if not isinstance(messages, list):
        raise BadRowError("wrong_type", "messages", f"expected a list, got {type(messages).__name__}")
    plain = render_tool_call_messages(messages)
    turns: list[ChatMessage] = []
    for i, message in enumerate(plain):
        role, content = message["role"], message["content"]
        if role == "assistant" and isinstance(content, str) and (INTERPRETER_OPEN in content or INTERPRETER_CLOSE in content):
            turns.extend(split_interpreter_blocks(content, f"messages[{i}].content"))
        elif role == "user" and question_only and isinstance(content, str):
            turns.append(ChatMessage("user", retool_question(content)))
        else:
            turns.append(ChatMessage(role, content))
    checked = parse_messages([{"role": t.role, "content": t.content} for t in turns])
    return SFTRecord(messages=checked, id=record_id(row, default_id), metadata=record_metadata(row))


TASK_FORMATS: dict[str, Callable[..., TaskRecord]] = {
    "task": parse_task_row,
    "dapo_math": parse_dapo_math_row,
    "aime": parse_aime_row,
}
SFT_FORMATS: dict[str, Callable[..., SFTRecord]] = {
    "chat": parse_sft_row,
    "retool_sft": parse_retool_sft_row,
}


def _row_parser(formats: Mapping[str, Callable[..., Any]], name: str, options: Mapping[str, Any]):
    if name not in formats:
        raise ValueError(f"unknown data format {name!r}; known formats: {sorted(formats)}")
    return functools.partial(formats[name], **options) if options else formats[name]


def load_task_records(paths: str | os.PathLike | Sequence[str | os.PathLike], format: str = "task",
                      max_examples: int = 5, deduplicate: bool = True,
                      **options: Any) -> tuple[list[TaskRecord], DataStats]:
    """Loads task records from local files (.jsonl / .json / .parquet, dirs, globs).

    Args:
      paths: file(s), directories or glob patterns.
      format: one of `TASK_FORMATS` ("task", "dapo_math", "aime").
      max_examples: bad rows logged verbatim per file.
      deduplicate: drop (and count) records whose whitespace-normalized prompt equals an
        earlier one's: "duplicate" with the same answer, "conflicting_answer" with another
        (the first is kept). BytedTsinghua-SIA/DAPO-Math-17k's parquet repeats each problem.
      **options: format options, e.g. `strip_instruction=False` for "dapo_math".

    Returns:
      (records, stats). Bad rows are skipped, counted in `stats` and logged.

    Raises:
      ValueError: an unknown format. DataError: no file, or a file with no good row.
    """
    return read_records(paths, _row_parser(TASK_FORMATS, format, options), max_examples=max_examples,
                        deduplicate=deduplicate)


def load_sft_records(paths: str | os.PathLike | Sequence[str | os.PathLike], format: str = "chat",
                     max_examples: int = 5, deduplicate: bool = True,
                     **options: Any) -> tuple[list[SFTRecord], DataStats]:
    """Loads SFT conversations; like `load_task_records` with `SFT_FORMATS` ("chat", "retool_sft").

    With `deduplicate`, a conversation identical (every role and text) to an earlier one
    is dropped and counted as "duplicate"."""
    return read_records(paths, _row_parser(SFT_FORMATS, format, options), max_examples=max_examples,
                        deduplicate=deduplicate)
