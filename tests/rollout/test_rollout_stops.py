"""Stop strings: found exactly where a full decode finds them, with far fewer decodes."""

import pytest

from agentrl_jax.rollout.stops import StopMatcher, TokenTexts

VOCAB = ["a", "b", "</", "code", ">", "x>", "\ufffd", "", " "]


def test_stop_matcher_equals_a_full_decode_and_skips_most_tokens():
    calls = []

    def detokenize(ids):
        calls.append(len(ids))
        return "".join(VOCAB[i] for i in ids)

    texts = TokenTexts(detokenize)
    matcher = StopMatcher(["</code>", "bx>"], texts)
    tokens, found = [], []
    sequence = [0, 1, 0, 1, 0, 2, 3, 1, 0, 0, 1, 5, 0, 0, 2, 3, 4, 0]
    for token in sequence:
        tokens.append(token)
        found.append(matcher.match(tokens))
    text = lambda n: "".join(VOCAB[i] for i in sequence[:n])  # noqa: E731
    first = {stop: min(n for n in range(1, len(sequence) + 1) if stop in text(n)) for stop in ("bx>", "</code>")}
    assert found[first["bx>"] - 1] == "bx>" and found[first["</code>"] - 1] == "</code>"
    assert sum(f is not None for f in found) == 2
    assert matcher.full_checks == 2  # only the tokens holding ">" were decoded in context
    assert len([c for c in calls if c > 1]) == 2 and len([c for c in calls if c == 1]) == len(set(sequence))


def test_stop_matcher_always_checks_pieces_it_cannot_judge():
    texts = TokenTexts(lambda ids: "".join(VOCAB[i] for i in ids))
    matcher = StopMatcher(["</code>"], texts)
    assert not matcher.could_complete(0)
    assert matcher.could_complete(6) and matcher.could_complete(7)  # byte-fallback piece, empty text
    assert StopMatcher(["end "], texts).could_complete(0)  # a stop ending in whitespace: every token
    with pytest.raises(ValueError, match="empty stop string"):
        StopMatcher([""], texts)


def token_by_token(matcher, before, new):
    """``(index in new, stop)`` of the first of ``new`` at which `match` finds a stop, or ``(None, None)``."""
    for i in range(len(new)):
        stop = matcher.match(before + new[: i + 1])
        if stop is not None:
            return i, stop
    return None, None


def test_first_match_over_a_dispatch_equals_matching_token_by_token():
    """The driver checks a whole dispatch's tokens per slot at once; the answer (where the first
    stop string completes, and which) must be the one a token-by-token check gives."""
    import numpy as np

    texts = TokenTexts(lambda ids: "".join(VOCAB[i] for i in ids))
    rng = np.random.default_rng(0)
    for trial in range(200):
        sequence = rng.integers(0, len(VOCAB), 40).tolist()
        cut = int(rng.integers(0, 40))
        before, new = sequence[:cut], sequence[cut:]
        expected = token_by_token(StopMatcher(["</code>", "bx>", "a b"], texts), before, new)
        batched = StopMatcher(["</code>", "bx>", "a b"], texts)
        assert batched.first_match(before, new) == expected, trial


def test_a_stop_strings_tokens_end_the_turn_where_its_text_would_and_without_decoding():
    """Given "</code>" as its tokens [2, 3, 4]: those tokens end the turn at the ">" token, with no
    text decoded; "</code>" written with other tokens ("</" "code" "x>" has no "</code>", but
    "</" "code" ">" does) is still found in the text; the sequence also completes across the
    tokens already held (``before``) and a dispatch's new ones, as token by token."""
    import numpy as np

    calls = []

    def detokenize(ids):
        calls.append(len(ids))
        return "".join(VOCAB[i] for i in ids)

    matcher = StopMatcher(["</code>", "bx>"], TokenTexts(detokenize), sequences=[(2, 3, 4), ()])
    assert matcher.sequences == ((2, 3, 4), ())
    assert matcher.first_match([0, 2], [3, 4, 0]) == (1, "</code>")
    assert matcher.full_checks == 0  # found by its tokens: nothing decoded in context
    assert matcher.match([1, 2, 3, 4]) == "</code>" and matcher.full_checks == 0
    assert matcher.first_match([], [0, 1, 5]) == (2, "bx>")  # no sequence given: the text finds it
    texts = TokenTexts(lambda ids: "".join(VOCAB[i] for i in ids))
    rng = np.random.default_rng(1)
    for trial in range(200):  # batched over a dispatch == token by token, sequences and text together
        sequence = rng.choice([0, 1, 2, 3, 4, 5], 30).tolist()
        cut = int(rng.integers(0, 30))
        before, new = sequence[:cut], sequence[cut:]
        expected = token_by_token(StopMatcher(["</code>", "bx>"], texts, sequences=[(2, 3, 4), (1, 5)]), before, new)
        batched = StopMatcher(["</code>", "bx>"], texts, sequences=[(2, 3, 4), (1, 5)])
        assert batched.first_match(before, new) == expected, trial
    with pytest.raises(ValueError, match="token sequences"):
        StopMatcher(["</code>", "bx>"], texts, sequences=[(2, 3, 4)])
