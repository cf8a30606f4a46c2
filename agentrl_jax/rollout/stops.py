"""Stop strings, checked on the host after each sampled token.

A stop string ends a turn when it appears in the text of the turn's tokens. Decoding the
whole turn after every token is quadratic; decoding a short tail is not. The matcher
keeps the text of the tokens it has seen (`detokenize` of a bounded tail only) and looks
for a stop string in the part that the newest token can have completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopMatcher:
    """Finds the first stop string completed by a sequence's newest token.

    Args:
      stop_strings: the strings (non-empty).
      detokenize: ``token_ids -> str``.
      tail_tokens: tokens decoded per check, beyond the longest stop string's length in
        characters (a token is at least one character except for byte-fallback pieces,
        which the extra tokens cover).
    """

    def __init__(self, stop_strings: Sequence[str], detokenize: Callable[[Sequence[int]], str], tail_tokens: int = 4):
        if any(not s for s in stop_strings):
            raise ValueError("stop_strings: an empty stop string would stop at once")
        self.stop_strings = tuple(stop_strings)
        self._detokenize = detokenize
        self._window = max(len(s) for s in stop_strings) + tail_tokens

    def match(self, tokens: Sequence[int]) -> str | None:
        """The stop string that the text of ``tokens`` contains near its end, or None."""
        tail = self._detokenize(tokens[-self._window :])
        for stop in self.stop_strings:
            if stop in tail:
                return stop
        return None
