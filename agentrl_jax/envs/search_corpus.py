"""A synthetic knowledge base for the search environment: facts no model can know.

Fictional countries get a capital, a founding year, a currency and a president, one
passage per fact (title = the country), e.g. "The capital of Zorvia is Quellin." Names
are drawn from syllables, so an answer can only come from the corpus. Questions:

    single hop  "What is the capital of Zorvia?"                                  -> Quellin
    two hops    "What is the official currency of the country whose capital is Quellin?"
                (search the capital to find the country, then its currency)       -> Dravo

Train and held-out questions are disjoint: a hash of the country decides its split, so
held-out questions are about countries never asked about in training. Everything is a
pure function of (num_countries, seed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from agentrl_jax.envs.retrieval import Passage

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z", "th", "dr", "br")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io")
_CODAS = ("", "", "n", "r", "l", "s", "th")
_SUFFIX = {"country": ("ia", "land", "ovia", "estan", "ara"), "city": ("in", "ort", "eth", "ond", "is"),
           "currency": ("o", "ar", "en", "ik"), "person": ("a", "o", "en", "is")}


@dataclasses.dataclass(frozen=True)
class SearchCorpus:
    passages: list[Passage]
    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]


def _word(rng: np.random.Generator, syllables: int, kind: str) -> str:
    parts = [str(rng.choice(_ONSETS)) + str(rng.choice(_VOWELS)) + str(rng.choice(_CODAS)) for _ in range(syllables)]
    return ("".join(parts) + str(rng.choice(_SUFFIX[kind]))).capitalize()


def _unique_word(rng: np.random.Generator, syllables: int, kind: str, used: set[str]) -> str:
    for _ in range(1000):
        word = _word(rng, syllables, kind)
        if word.lower() not in used:
            used.add(word.lower())
            return word
    raise ValueError("ran out of distinct names; use fewer countries")


def _is_held_out(name: str, fraction: float) -> bool:
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def make_search_corpus(num_countries: int, *, seed: int, held_out_fraction: float = 0.2) -> SearchCorpus:
    """Passages for `num_countries` fictional countries and the questions about them.

    Each task: {"id", "question", "answer", "golden_answers", "hops", "support_ids", "split"};
    `support_ids` are the passages that together contain the answer.
    """
    if num_countries < 1 or not 0 <= held_out_fraction <= 1:
        raise ValueError(f"need num_countries >= 1 and held_out_fraction in [0, 1], got {num_countries}, "
                         f"{held_out_fraction}")
    rng = np.random.default_rng([seed, 17])
    used: set[str] = set()
    passages: list[Passage] = []
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "held_out": []}
    for index in range(num_countries):
        country = _unique_word(rng, 2, "country", used)
        capital = _unique_word(rng, 2, "city", used)
        currency = _unique_word(rng, 1, "currency", used)
        president = f"{_unique_word(rng, 1, 'person', used)} {_unique_word(rng, 2, 'person', used)}"
        founded, elected = int(rng.integers(1100, 1900)), int(rng.integers(1950, 2024))
        facts = {
            "capital": f"The capital of {country} is {capital}, its largest city and seat of government.",
            "founded": f"{country} was founded in {founded} by settlers from the eastern coast.",
            "currency": f"The official currency of {country} is the {currency}, issued by its central bank.",
            "president": f"{country} is governed by {president}, who was elected president in {elected}.",
        }
        ids = {relation: f"c{index}-{relation}" for relation in facts}
        passages += [Passage(id=ids[r], title=country, text=text) for r, text in facts.items()]
        split = "held_out" if _is_held_out(country, held_out_fraction) else "train"
        questions = [
            (f"What is the capital of {country}?", [capital], 1, ["capital"]),
            (f"In what year was {country} founded?", [str(founded)], 1, ["founded"]),
            (f"What is the official currency of {country}?", [currency, f"the {currency}"], 1, ["currency"]),
            (f"Who is the president of {country}?", [president], 1, ["president"]),
            (f"What is the official currency of the country whose capital is {capital}?",
             [currency, f"the {currency}"], 2, ["capital", "currency"]),
        ]
        for number, (question, answers, hops, support) in enumerate(questions):
            splits[split].append({"id": f"c{index}-q{number}", "question": question, "answer": answers[0],
                                  "golden_answers": answers, "hops": hops,
                                  "support_ids": [ids[r] for r in support], "split": split})
    return SearchCorpus(passages, splits["train"], splits["held_out"])


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_search_corpus(directory: str | Path, num_countries: int, *, seed: int,
                        held_out_fraction: float = 0.2) -> dict[str, Path]:
    """Writes corpus.jsonl ({"id", "title", "text"}), train.jsonl and eval.jsonl; returns their paths.

    Task files load with `data.format="aime"` (question + answer; other fields such as
    `golden_answers` are kept on the task).
    """
    data = make_search_corpus(num_countries, seed=seed, held_out_fraction=held_out_fraction)
    directory = Path(directory)
    return {
        "corpus": write_jsonl(directory / "corpus.jsonl",
                              [{"id": p.id, "title": p.title, "text": p.text} for p in data.passages]),
        "train": write_jsonl(directory / "train.jsonl", data.train),
        "eval": write_jsonl(directory / "eval.jsonl", data.held_out),
    }


__all__ = ["SearchCorpus", "make_search_corpus", "write_jsonl", "write_search_corpus"]
