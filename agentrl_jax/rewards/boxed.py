"""Final-answer extraction: the content of the last `\\boxed{...}` (nested braces allowed)."""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` closing the `{` at `open_index`, or None when unbalanced."""
    depth = 0
    for index in range(open_index, len(text)):
        char = text[index]
        if char == "{" and text[index - 1] != "\\":
            depth += 1
        elif char == "}" and text[index - 1] != "\\":
            depth -= 1
            if depth == 0:
                return index
    return None


def find_boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """All top-level boxed answers as (start, end, content); `\\boxed 5` counts too.

    A box inside another box is part of the outer content, not a separate answer.
    An unclosed `\\boxed{` is ignored.
    """
    spans = []
    position = 0
    pattern = re.compile(r"\\(?:boxed|fbox)\b")
    while (match := pattern.search(text, position)) is not None:
        index = match.end()
        while index < len(text) and text[index] == " ":
            index += 1
        if index < len(text) and text[index] == "{":
            close = _matching_brace(text, index)
            if close is None:
                position = match.end()
                continue
            spans.append((match.start(), close + 1, text[index + 1:close].strip()))
            position = close + 1
        else:  # "\boxed 42": the token up to whitespace or `$`
            token = re.match(r"[^\s$]+", text[index:])
            if token is None:
                position = match.end()
                continue
            spans.append((match.start(), index + token.end(), token.group(0)))
            position = index + token.end()
    return spans


def extract_boxed(text: str) -> str | None:
    """The last boxed answer of `text` (the ReTool / DAPO last-box rule), or None."""
    spans = find_boxed_spans(text)
    return spans[-1][2] if spans else None
