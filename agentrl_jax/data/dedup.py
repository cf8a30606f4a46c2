"""Which rows are the same: deduplication within a dataset and train/eval overlap.

Public math sets repeat themselves: BytedTsinghua-SIA/DAPO-Math-17k's parquet holds each of
its ~17k problems about a hundred times, so an "epoch" is a hundred epochs and pass@k on a
repeated eval set counts one problem several times. The rules:

- Two task records are the same when their prompts are equal after whitespace
  normalization (runs of spaces/newlines -> one space, ends stripped); case and LaTeX are
  kept, because `$X$` and `$x$` can be different problems.
- The first occurrence (file order) is kept. A later one with the same (normalized)
  answer is a `duplicate`. A later one with a different answer is a `conflicting_answer`
  and is dropped too: the same question rewarded for two answers teaches noise, and the
  first-seen answer is the only deterministic choice. Both are counted and the conflicts
  logged (file:line of both rows, both answers).
- SFT conversations are the same when every message (role and text) is identical; the
  trainer sees exact tokens, so no normalization.
- A training task whose prompt is also an eval prompt (any answer) is an `eval_overlap`:
  contamination of the held-out score. It is dropped from train and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from agentrl_jax.data.records import SFTRecord, TaskRecord

Item = TypeVar("Item")

DUPLICATE = "duplicate"
CONFLICTING_ANSWER = "conflicting_answer"
EVAL_OVERLAP = "eval_overlap"


def normalize_text(text: str) -> str:
    """Whitespace-normalized text: the identity used to compare prompts and answers."""
    return " ".join(text.split())


class Deduplicator:
    """Streaming first-occurrence-wins deduplication over task or SFT records.

    Only the first occurrence of each prompt is remembered (its answer and location),
    so memory grows with the unique rows, not with the file.
    """

    def __init__(self):
        self._first: dict[Any, tuple[str, str]] = {}

    def check(self, record: TaskRecord | SFTRecord, location: str) -> tuple[str, str] | None:
        """None for a new record (now remembered), else (reason, message) for a dropped one.

        Args:
          record: the parsed record.
          location: its "file:line", quoted in the message of a later repeat.

        Returns:
          None, or (`DUPLICATE` | `CONFLICTING_ANSWER`, a human-readable explanation).
        """
        if isinstance(record, SFTRecord):
            key, answer = record.messages, ""
        else:
            key, answer = normalize_text(record.prompt), normalize_text(record.answer)
        first = self._first.get(key)
        if first is None:
            self._first[key] = (answer, location)
            return None
        first_answer, first_location = first
        if first_answer == answer:
            return DUPLICATE, f"same row as {first_location}"
        return CONFLICTING_ANSWER, (f"same prompt as {first_location} but answer {answer!r} instead of "
                                    f"{first_answer!r}; the first one is kept")

    def __len__(self) -> int:
        return len(self._first)


def split_overlap(train: Sequence[Item], held_out: Sequence[Item],
                  prompt: Callable[[Item], str]) -> tuple[list[Item], list[Item]]:
    """(train items whose prompt is not a held-out prompt, those that are), order kept.

    Prompts compare whitespace-normalized (see `normalize_text`); answers are ignored.
    """
    held_out_prompts = {normalize_text(prompt(item)) for item in held_out}
    clean, overlap = [], []
    for item in train:
        (overlap if normalize_text(prompt(item)) in held_out_prompts else clean).append(item)
    return clean, overlap
