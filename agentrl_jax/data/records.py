"""Typed task and SFT records, and the validation that turns a raw row into one.

A raw row is a dict read from a JSONL line or a Parquet row. `parse_task_row` and
`parse_sft_row` either return a record or raise `BadRowError` naming the field and the
reason; the readers count those errors per reason and skip the row (see `readers.py`).

Field names are matched case-insensitively at every level (`Problem`/`Answer` columns,
`reward_model.Ground_Truth`, `messages[].Role`): datasets on the Hub spell them both
ways. Two keys of one object that differ only in case are an `ambiguous_field` error
naming both, never a silent pick.

Task row:  {"prompt": str, "answer": str | int | float, "id"?: str | int, "metadata"?: dict},
           the prompt and answer under any of the names public sets use (`TASK_PROMPT_FIELDS`,
           `TASK_ANSWER_FIELDS`: GSM8K's question/answer, MATH's problem, input/target)
SFT row:   {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
            "id"?: str | int, "metadata"?: dict}
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class BadRowError(ValueError):
    """A row that cannot become a record.

    Attributes:
      kind: short category, e.g. "missing_field", "wrong_type", "empty", "bad_role".
      field: the offending field path, e.g. "prompt" or "messages[2].role".
      detail: a human-readable explanation.
    """

    def __init__(self, kind: str, field: str, detail: str):
        super().__init__(f"{kind} {field!r}: {detail}")
        self.kind = kind
        self.field = field
        self.detail = detail

    @property
    def reason(self) -> str:
        """The counter key used by `DataStats`, e.g. "missing_field:prompt"."""
        return f"{self.kind}:{self.field}"


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One RL / evaluation task: a prompt and its verifiable answer.

    Attributes:
      prompt: the user-facing question text (never empty).
      answer: the ground-truth answer as a string (numbers are converted with `str`).
      id: stable identifier; "<file name>:<line>" when the row has none.
      metadata: free-form extra fields (data source, difficulty, ...), JSON-like.
    """

    prompt: str
    answer: str
    id: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One chat turn. `role` is one of `ROLES`."""

    role: str
    content: str


@dataclasses.dataclass(frozen=True)
class SFTRecord:
    """One supervised conversation; the SFT trainer trains on assistant turns only.

    Attributes:
      messages: the turns in order; at least one has role "assistant".
      id: stable identifier; "<file name>:<line>" when the row has none.
      metadata: free-form extra fields.
    """

    messages: tuple[ChatMessage, ...]
    id: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=4096)
def _keys_by_lower_name(keys: tuple[Any, ...]) -> dict[str, tuple[str, ...]]:
    """Lower-cased name -> the keys spelling it. Cached: the rows of one file share their keys."""
    index: dict[str, tuple[str, ...]] = {}
    for key in keys:
        if isinstance(key, str):
            index[key.lower()] = index.get(key.lower(), ()) + (key,)
    return index


def check_keys(keys: Any, where: str) -> None:
    """Raises `BadRowError("ambiguous_field")` when two of `keys` differ only in case.

    Args:
      keys: column names, or an object whose keys are checked.
      where: what the names are, for the message ("columns", "keys").
    """
    clashes = sorted(group for group in _keys_by_lower_name(tuple(keys)).values() if len(group) > 1)
    if clashes:
        listed = "; ".join(" and ".join(map(repr, sorted(group))) for group in clashes)
        raise BadRowError("ambiguous_field", clashes[0][0].lower(),
                          f"{where} {listed} differ only in case (names are matched ignoring case); "
                          "rename or drop one")


def get_field(row: Mapping[str, Any], field: str, path: str | None = None) -> Any:
    """`row[field]` with the key matched ignoring case, or None when absent.

    Args:
      row: a decoded object.
      field: the lower-case field name.
      path: the field's path for error messages (default `field`).

    Raises:
      BadRowError: ("ambiguous_field") when two keys match, e.g. "Answer" and "answer".
    """
    matches = _keys_by_lower_name(tuple(row)).get(field)
    if matches is None:
        return None
    if len(matches) > 1:
        raise BadRowError("ambiguous_field", path or field,
                          f"keys {', '.join(map(repr, sorted(matches)))} differ only in case; rename or drop one")
    return row[matches[0]]


def require_field(row: Mapping[str, Any], field: str, path: str | None = None) -> Any:
    """Returns `row[field]` (matched ignoring case), or raises `BadRowError("missing_field", ...)`."""
    if not isinstance(row, Mapping):
        raise BadRowError("wrong_type", path or "<row>", f"expected an object, got {type(row).__name__}")
    value = get_field(row, field, path)
    if value is None:
        raise BadRowError("missing_field", path or field, f"the row has no {field!r}")
    return value


def require_text(value: Any, field: str, *, allow_empty: bool = False) -> str:
    """Checks that `value` is a string (non-blank unless `allow_empty`)."""
    if not isinstance(value, str):
        raise BadRowError("wrong_type", field, f"expected a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRowError("empty", field, "the text is empty")
    return value


def answer_text(value: Any, field: str = "answer") -> str:
    """Normalizes a ground-truth answer to a non-empty string.

    Strings pass through; ints and floats (AIME files often store 204, not "204")
    become `str(value)`. Booleans, lists and objects are rejected: an answer of that
    type is almost always a column mix-up.
    """
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral, numbers.Real)):
        raise BadRowError("wrong_type", field, f"expected a string or number, got {type(value).__name__}")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise BadRowError("empty", field, "the answer is empty")
    return text.strip()


def record_id(row: Mapping[str, Any], default_id: str, field: str = "id") -> str:
    """The row's id as a string, or `default_id` when it has none."""
    value = get_field(row, field)
    if value is None:
        return default_id
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Integral)):
        raise BadRowError("wrong_type", field, f"expected a string or integer, got {type(value).__name__}")
    return str(value)


def record_metadata(row: Mapping[str, Any], field: str = "metadata") -> dict[str, Any]:
    """The row's metadata dict (empty when absent)."""
    value = get_field(row, field)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadRowError("wrong_type", field, f"expected an object, got {type(value).__name__}")
    return dict(value)


#: The names of a task's prompt and of its answer in public datasets, in order of preference.
#: A worked solution ("solution" in MATH) is not an answer: the verifier compares final answers.
TASK_PROMPT_FIELDS = ("prompt", "question", "problem", "input")
TASK_ANSWER_FIELDS = ("answer", "final_answer", "target")


def first_field(row: Mapping[str, Any], fields: tuple[str, ...]) -> tuple[str, Any]:
    """(name, value) of the first of `fields` that `row` has (matched ignoring case, not None).

    Raises:
      BadRowError: ("missing_field", the first name) when the row has none of them.
    """
    if not isinstance(row, Mapping):
        raise BadRowError("wrong_type", "<row>", f"expected an object, got {type(row).__name__}")
    for name in fields:
        value = get_field(row, name)
        if value is not None:
            return name, value
    raise BadRowError("missing_field", fields[0], f"the row has none of {fields}")


def final_answer(text: str) -> str:
    """The final answer of a GSM8K answer, whose last line is ``#### 72`` after the reasoning
    (here "72"); any other text unchanged."""
    head, marker, tail = text.rpartition("####")
    if marker and tail.strip() and (not head or head.endswith("\n")):
        return tail.strip()
    return text


def parse_task_row(row: Mapping[str, Any], default_id: str) -> TaskRecord:
    """Validates a generic task row into a `TaskRecord`.

    Args:
      row: {"prompt": str, "answer": str|number, "id"?: str|int, "metadata"?: dict}; the
        prompt may be named after any of `TASK_PROMPT_FIELDS` and the answer after any of
        `TASK_ANSWER_FIELDS` (the first present wins). A GSM8K answer ("... #### 72")
        becomes its final answer.
      default_id: the id to use when the row has none (the reader passes "file:line").

    Returns:
      The record.

    Raises:
      BadRowError: naming the missing / mistyped / empty field.
    """
    prompt_field, prompt = first_field(row, TASK_PROMPT_FIELDS)
    prompt = require_text(prompt, prompt_field)
    answer_field, answer = first_field(row, TASK_ANSWER_FIELDS)
    answer = final_answer(answer_text(answer, answer_field))
    return TaskRecord(
        prompt=prompt, answer=answer, id=record_id(row, default_id), metadata=record_metadata(row)
    )


def parse_messages(messages: Any, field: str = "messages") -> tuple[ChatMessage, ...]:
    """Validates a chat list: roles from `ROLES`, string contents, >= 1 assistant turn.

    Empty contents are allowed except on assistant turns, which must carry text to
    train on. Extra keys other than "role"/"content" (e.g. "tool_calls") are rejected,
    because ignoring them would silently drop training signal: convert such rows
    with a format normalizer first (see `formats.py`).
    """
    if not isinstance(messages, list):
        raise BadRowError("wrong_type", field, f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise BadRowError("empty", field, "the conversation has no messages")
    parsed = []
    for i, message in enumerate(messages):
        path = f"{field}[{i}]"
        if not isinstance(message, Mapping):
            raise BadRowError("wrong_type", path, f"expected an object, got {type(message).__name__}")
        role = require_field(message, "role", f"{path}.role")
        if role not in ROLES:
            raise BadRowError("bad_role", f"{path}.role", f"{role!r} is not one of {ROLES}")
        extra = sorted(str(k) for k in message if str(k).lower() not in ("role", "content") and message[k] is not None)
        if extra:
            raise BadRowError("unsupported_field", f"{path}.{extra[0]}", "only role/content are read here")
        content = require_text(
            require_field(message, "content", f"{path}.content"),
            f"{path}.content",
            allow_empty=role != "assistant",
        )
        parsed.append(ChatMessage(role=role, content=content))
    if not any(m.role == "assistant" for m in parsed):
        raise BadRowError("no_assistant", field, "no assistant turn to train on")
    return tuple(parsed)


def parse_sft_row(row: Mapping[str, Any], default_id: str) -> SFTRecord:
    """Validates a chat-format SFT row into an `SFTRecord` (see `parse_messages`)."""
    messages = parse_messages(require_field(row, "messages"))
    return SFTRecord(messages=messages, id=record_id(row, default_id), metadata=record_metadata(row))
