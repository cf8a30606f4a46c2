"""Stop strings, checked on the host without detokenizing after every token.

A stop string ends a turn when it appears in the text of the turn's tokens. Its last
character has to come from the token that completes it, so a token whose own text does
not contain that character cannot complete it, and nothing needs decoding. Token texts
are cached per token id (`TokenTexts`: one `detokenize([id])` per distinct id, shared by
every request of a driver), and only a token that could complete a stop string triggers
the real check: decoding a bounded tail of the sequence in context.

A single token's text can differ from its text in context (byte-fallback pieces of one
UTF-8 character, SentencePiece's leading space), so tokens whose own text is empty or
holds a replacement character always get the full check, and so does every token when a
stop string ends in whitespace.

A stop string may also be given as its tokens (`StopMatcher(sequences=)`, the tokenizer's
encoding of the string: ReTool's ``</code>`` is several tokens). A sequence's newest tokens
equal to them end the turn there too, before any text is decoded; with decode lanes the
device checks the same sequences (`DecodeState.stop_seqs`) and stops the sequence at the
same token, without waiting for the host. Text written with other tokens is still found by
the text check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TokenTexts:
    """``detokenize([token])`` per token id, computed once each."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str]):
        self.detokenize = detokenize
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.detokenize([token])
        return text


class StopMatcher:
    """Finds the first stop string completed by a sequence's newest token.

    Args:
      stop_strings: the strings (non-empty).
      texts: the driver's `TokenTexts`.
      tail_tokens: tokens decoded per full check beyond the longest stop string's length
        in characters (a token is at least one character except for byte-fallback pieces,
        which the extra tokens cover).
      sequences: per stop string, its tokens (the tokenizer's encoding of it), or empty: a
        turn whose newest tokens are those ends at that string.

    Attributes:
      full_checks: how many times a tail was detokenized (the rest were skipped).
    """

    def __init__(self, stop_strings: Sequence[str], texts: TokenTexts, tail_tokens: int = 4,
                 sequences: Sequence[Sequence[int]] = ()):
        if any(not s for s in stop_strings):
            raise ValueError("stop_strings: an empty stop string would stop at once")
        if sequences and len(sequences) != len(stop_strings):
            raise ValueError(f"stop_strings: {len(sequences)} token sequences for {len(stop_strings)} strings")
        self.stop_strings = tuple(stop_strings)
        self.sequences = tuple(tuple(int(t) for t in q) for q in sequences)
        self._by_last = {}  # a sequence's last token -> [(sequence, its string)]
        for q, stop in zip(self.sequences, self.stop_strings):
            if q:
                self._by_last.setdefault(q[-1], []).append((q, stop))
        self._longest = max((len(q) for q in self.sequences), default=0)
        self._texts = texts
        self._last_chars = frozenset(s[-1] for s in stop_strings)
        self._always = any(c.isspace() for c in self._last_chars)
        self._window = max(len(s) for s in stop_strings) + tail_tokens
        self.full_checks = 0

    def could_complete(self, token: int) -> bool:
        """False only when ``token`` cannot be the one that completes a stop string."""
        if self._always:
            return True
        text = self._texts(token)
        return not text or "\ufffd" in text or any(c in text for c in self._last_chars)

    def match(self, tokens: Sequence[int]) -> str | None:
        """The stop string that ``tokens`` end with (as its token sequence) or whose text they contain
        near their end, or None."""
        stop = self._sequence_stop(tokens)
        if stop is not None:
            return stop
        if not self.could_complete(tokens[-1]):
            return None
        return self._check(tokens[-self._window :])

    def first_match(self, before: Sequence[int], new: Sequence[int]) -> tuple[int | None, str | None]:
        """The first of ``new`` (appended to ``before``) that completes a stop string: ``(index in new, stop)``,
        or ``(None, None)``. Equals calling `match` after each appended token, one dispatch at a time."""
        for i, token in enumerate(new):
            if token in self._by_last:
                n = self._longest
                stop = self._sequence_stop(list(before[-n:]) + list(new[max(i + 1 - n, 0): i + 1]))
                if stop is not None:
                    return i, stop
            if self.could_complete(token):
                tail = list(before[-self._window :]) + list(new[: i + 1])
                stop = self._check(tail[-self._window :])
                if stop is not None:
                    return i, stop
        return None, None

    def _sequence_stop(self, tokens: Sequence[int]) -> str | None:
        """The stop string whose token sequence ``tokens`` end with, or None."""
        for q, stop in self._by_last.get(tokens[-1], ()) if len(tokens) else ():
            if len(tokens) >= len(q) and tuple(tokens[-len(q):]) == q:
                return stop
        return None

    def _check(self, tail: Sequence[int]) -> str | None:
        self.full_checks += 1
        text = self._texts.detokenize(tail)
        for stop in self.stop_strings:
            if stop in text:
                return stop
        return None
