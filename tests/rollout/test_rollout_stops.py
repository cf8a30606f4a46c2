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
