"""Parsers for the native tool-call formats instruct models are trained on.

- ``hermes`` (Hermes, Qwen2.5, Qwen3): one block per call, after optional text::

      Let me compute it.
      <tool_call>
      {"name": "python", "arguments": {"code": "print(2**10)"}}
      </tool_call>

- ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calls): the whole turn is one JSON object,
  optionally after ``<|python_tag|>``::

      {"name": "python", "parameters": {"code": "print(2**10)"}}

A parser never raises: a call it cannot read becomes a :class:`MalformedCall` (kind
``bad_json``), which the tool environment answers with an error observation. Whether the
name is a known tool and the arguments fit its schema is the registry's check
(``unknown_tool``, ``bad_arguments``; envs/tools/registry.py).

:func:`format_calls` writes calls the way the chat templates render an assistant message's
``tool_calls``, so a turn parsed into a message renders back to the sampled text.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

#: The ways a tool call can be malformed; each becomes an error observation, counted.
MALFORMED_KINDS = ("bad_json", "unknown_tool", "bad_arguments")
TOOL_FORMATS = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: a tool name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def message_form(self) -> dict[str, Any]:
        """The entry of an assistant message's ``tool_calls`` that chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A call that was attempted but cannot run. kind: one of MALFORMED_KINDS; reason: for the model."""

    kind: str
    reason: str
    name: str = ""


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn: its text outside the calls, and the calls in order."""

    content: str
    calls: tuple[ToolCall | MalformedCall, ...] = ()

    def assistant_message(self) -> dict[str, Any]:
        """The turn as a chat message (malformed calls are not rendered: they have no structure)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        calls = [c.message_form() for c in self.calls if isinstance(c, ToolCall)]
        if calls:
            message["tool_calls"] = calls
        return message


def _read_call(body: str, arguments_keys: Sequence[str]) -> ToolCall | MalformedCall:
    """A ToolCall from the JSON text of one call, or why it is not one."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall("bad_json", f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column "
                                         f"{e.colno})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return MalformedCall("bad_json", 'the tool call must be a JSON object with a "name" string')
    arguments: Any = {}
    for key in arguments_keys:
        if key in data:
            arguments = data[key]
            break
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedCall("bad_arguments", f'"{arguments_keys[0]}" must be a JSON object, got '
                                              f"{type(arguments).__name__}", name=data["name"])
    return ToolCall(data["name"], arguments)


def parse_hermes(text: str) -> ParsedTurn:
    """Calls in ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    The content is the text before the first block (the newline the template puts before a
    block removed); text between and after blocks is not part of any message. An opened
    but never closed block is a malformed call.
    """
    matches = list(_HERMES.finditer(text))
    calls: list[ToolCall | MalformedCall] = [_read_call(m.group(1).strip(), ("arguments", "parameters"))
                                             for m in matches]
    starts = [m.start() for m in matches]
    unclosed = text.find("<tool_call>", matches[-1].end() if matches else 0)
    if unclosed >= 0:
        calls.append(MalformedCall("bad_json", "<tool_call> was not closed with </tool_call>"))
        starts.append(unclosed)
    if not calls:
        return ParsedTurn(text)
    content = text[:min(starts)]
    if content.endswith("\n"):
        content = content[:-1]
    return ParsedTurn(content, tuple(calls))


def parse_llama3(text: str) -> ParsedTurn:
    """A Llama 3.x JSON tool call: the turn (after an optional ``<|python_tag|>``) is one object.

    A turn that starts with ``{`` and mentions ``"name"`` is a call attempt; anything else is
    plain content (the final answer).
    """
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    if not (tagged or (body.startswith("{") and '"name"' in body)):
        return ParsedTurn(text)
    return ParsedTurn("", (_read_call(body, ("parameters", "arguments")),))


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes, "llama3": parse_llama3}


def format_calls(calls: Sequence[ToolCall], tool_format: str, content: str = "") -> str:
    """The text of an assistant turn with ``calls``, as the chat templates render it."""
    if tool_format == "hermes":
        blocks = [f'<tool_call>\n{{"name": "{c.name}", "arguments": {json.dumps(c.arguments, ensure_ascii=False)}}}'
                  "\n</tool_call>" for c in calls]
        return "\n".join(([content] if content else []) + blocks)
    if tool_format == "llama3":
        if len(calls) != 1 or content:
            raise ValueError("format_calls: the llama3 format has exactly one call and no text per turn")
        return f'{{"name": "{calls[0].name}", "parameters": {json.dumps(calls[0].arguments, ensure_ascii=False)}}}'
    raise ValueError(f"format_calls: tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")


def parser_for(tool_format: str) -> Callable[[str], ParsedTurn]:
    if tool_format not in PARSERS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    return PARSERS[tool_format]
