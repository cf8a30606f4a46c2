"""Passage retrieval for the search environment: a local BM25 index and a remote HTTP backend.

Both answer `await retriever.search(query, k) -> list[Passage]`, best first.

Local: BM25 Okapi (Robertson & Zaragoza, 2009, "The Probabilistic Relevance Framework:
BM25 and Beyond", eq. 3.15) over a JSONL corpus, scored per query term t of query q:

    score(d, q) = sum_{t in q} idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)      = log(1 + (N - n_t + 0.5) / (n_t + 0.5))

with N documents, n_t of them containing t, |d| the document length in tokens. The
`1 +` inside the log (Lucene's form) keeps idf positive for terms in more than half of
the documents. Defaults k1 = 0.9, b = 0.4 are Anserini/Pyserini's, the BM25 baseline of
Search-R1. A query term that occurs twice counts twice (Lucene sums one clause per
occurrence). Ties are broken by corpus order, so rankings are deterministic.

Remote: the retrieval server of Search-R1 (PeterGriffinJin/Search-R1,
`search_r1/search/retrieval_server.py`): POST {url} with
`{"queries": [q], "topk": k, "return_scores": true}` answers
`{"result": [[{"document": {"id": ..., "contents": "\\"Title\\"\\ntext"}, "score": s}, ...]]}`
(without scores each item is the document itself). Timeouts, connection errors, HTTP 5xx
and 429 are retried with exponential backoff; anything else fails at once. A failure
raises `RetrieverError`, which the environment turns into an observation.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import math
import re
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclasses.dataclass(frozen=True)
class Passage:
    """One retrieved document; `score` is the retriever's (BM25 or the server's), 0 if unknown."""

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        """The passage in the Search-R1 / FlashRAG wiki layout: a quoted title line, then the text."""
        return f'"{self.title}"\n{self.text}' if self.title else self.text


class RetrieverError(RuntimeError):
    """A search that failed after retries; `timed_out` when the last failure was a timeout."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class BadRecordError(ValueError):
    """A corpus line or a server answer that does not have the documented shape."""


class Retriever(Protocol):
    async def search(self, query: str, k: int) -> list[Passage]: ...

    async def close(self) -> None: ...


def tokenize(text: str) -> list[str]:
    """Lower-cased Unicode word tokens (`\\w+`); punctuation separates tokens and is dropped."""
    return _WORD.findall(text.lower())


def split_contents(contents: str) -> tuple[str, str]:
    """(title, text) from a `"Title"\\ntext` contents string; a single line is all text."""
    head, sep, rest = contents.partition("\n")
    if not sep:
        return "", contents.strip()
    return head.strip().strip('"'), rest.strip()


def passage_from_record(row: dict[str, Any], default_id: str, score: float = 0.0) -> Passage:
    """A corpus or server record -> Passage: {"title", "text"} or {"contents"}, optional "id"/"docid".

    Raises:
      BadRecordError: naming the missing or mistyped field.
    """
    if not isinstance(row, dict):
        raise BadRecordError(f"expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("text"), str):
        title, text = row.get("title") or "", row["text"]
        if not isinstance(title, str):
            raise BadRecordError(f"field 'title' must be a string, got {type(title).__name__}")
    elif isinstance(row.get("contents"), str):
        title, text = split_contents(row["contents"])
    else:
        raise BadRecordError("needs a string field 'text' (with optional 'title') or 'contents'")
    doc_id = row.get("id", row.get("docid", default_id))
    return Passage(id=str(doc_id), title=title.strip(), text=text.strip(), score=float(score))


def load_corpus(path: str | Path, max_logged: int = 5) -> list[Passage]:
    """Reads a JSONL corpus ({"id", "title", "text"} or {"id", "contents"} per line).

    Bad lines are skipped, counted and logged (the first `max_logged` verbatim).

    Raises:
      FileNotFoundError: no such file. ValueError: the file has no usable line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"search corpus {str(path)!r} does not exist (expected a JSONL file of "
                                '{"id", "title", "text"} records)')
    passages, bad = [], 0
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                passages.append(passage_from_record(json.loads(line), default_id=f"{path.name}:{line_number}"))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                bad += 1
                if bad <= max_logged:
                    logger.warning("corpus %s line %d skipped: %s", path, line_number, e)
    if bad:
        logger.warning("corpus %s: %d bad lines skipped, %d passages loaded", path, bad, len(passages))
    if not passages:
        raise ValueError(f"search corpus {str(path)!r} has no usable passage ({bad} bad lines)")
    return passages


class BM25Index:
    """BM25 Okapi over passages (module docstring); per-posting weights are precomputed.

    Args:
      passages: the corpus; title and text are indexed together.
      k1: term-frequency saturation (> 0). b: length normalization in [0, 1].
    """

    def __init__(self, passages: Sequence[Passage], *, k1: float = 0.9, b: float = 0.4):
        if not passages:
            raise ValueError("BM25Index needs at least one passage")
        if k1 <= 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25Index needs k1 > 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.passages = list(passages)
        self.k1, self.b = k1, b
        documents = [tokenize(f"{p.title} {p.text}") for p in self.passages]
        self.doc_lengths = np.asarray([len(d) for d in documents], np.float64)
        self.avgdl = float(self.doc_lengths.mean()) or 1.0
        raw: dict[str, tuple[list[int], list[int]]] = collections.defaultdict(lambda: ([], []))
        for doc, tokens in enumerate(documents):
            for term, tf in collections.Counter(tokens).items():
                raw[term][0].append(doc)
                raw[term][1].append(tf)
        num_docs = len(documents)
        self.idf: dict[str, float] = {}
        self.postings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for term, (docs, tfs) in raw.items():
            doc_ids = np.asarray(docs, np.int64)
            tf = np.asarray(tfs, np.float64)
            idf = math.log(1.0 + (num_docs - len(docs) + 0.5) / (len(docs) + 0.5))
            norm = k1 * (1.0 - b + b * self.doc_lengths[doc_ids] / self.avgdl)
            self.idf[term] = idf
            self.postings[term] = (doc_ids, idf * tf * (k1 + 1.0) / (tf + norm))

    def __len__(self) -> int:
        return len(self.passages)

    @classmethod
    def from_jsonl(cls, path: str | Path, **kwargs: float) -> BM25Index:
        return cls(load_corpus(path), **kwargs)

    def scores(self, query: str) -> np.ndarray:
        """float64 [N]: the BM25 score of every passage for `query` (0 where no term matches)."""
        scores = np.zeros(len(self.passages), np.float64)
        for term in tokenize(query):
            if term in self.postings:
                doc_ids, weights = self.postings[term]
                scores[doc_ids] += weights  # doc_ids are unique within one posting list
        return scores

    def search(self, query: str, k: int) -> list[Passage]:
        """The `k` best passages that share at least one term with `query`, best first."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        scores = self.scores(query)
        matched = np.flatnonzero(scores > 0)
        order = matched[np.lexsort((matched, -scores[matched]))][:k]
        return [dataclasses.replace(self.passages[i], score=float(scores[i])) for i in order]


class LocalRetriever:
    """`BM25Index` behind the async interface; searches run in a worker thread."""

    def __init__(self, index: BM25Index):
        self.index = index

    @classmethod
    def from_corpus(cls, path: str | Path, **kwargs: float) -> LocalRetriever:
        return cls(BM25Index.from_jsonl(path, **kwargs))

    async def search(self, query: str, k: int) -> list[Passage]:
        return await asyncio.to_thread(self.index.search, query, k)

    async def close(self) -> None:
        """Nothing to release (API parity with RemoteRetriever)."""


@dataclasses.dataclass(frozen=True)
class RemoteRetrieverConfig:
    url: str  # the full endpoint, e.g. "http://127.0.0.1:8000/retrieve"
    timeout_s: float = 10.0  # per HTTP request
    max_retries: int = 3
    backoff_s: float = 0.5  # first retry delay; doubles each time
    max_concurrency: int = 32

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteRetrieverConfig.url must be http(s)://..., got {self.url!r}")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.max_concurrency < 1 or self.backoff_s < 0:
            raise ValueError("RemoteRetrieverConfig needs timeout_s > 0, max_retries >= 0, backoff_s >= 0 "
                             "and max_concurrency >= 1")


class _Retryable(Exception):
    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def parse_retrieval_response(payload: Any) -> list[Passage]:
    """The passages of the first (only) query in a Search-R1 `/retrieve` response.

    Raises:
      BadRecordError: the payload does not have the documented shape.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list) or not payload["result"]:
        raise BadRecordError("retrieval response must be {'result': [[...]]}")
    items = payload["result"][0]
    if not isinstance(items, list):
        raise BadRecordError(f"retrieval response 'result[0]' must be a list, got {type(items).__name__}")
    passages = []
    for rank, item in enumerate(items):
        if isinstance(item, dict) and isinstance(item.get("document"), dict):
            score = item.get("score", 0.0)
            passages.append(passage_from_record(item["document"], default_id=str(rank),
                                                score=float(score) if isinstance(score, (int, float)) else 0.0))
        else:
            passages.append(passage_from_record(item, default_id=str(rank)))
    return passages


class RemoteRetriever:
    """A Search-R1-style retrieval server over HTTP (stdlib urllib in worker threads)."""

    def __init__(self, config: RemoteRetrieverConfig):
        self.config = config
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self.counts: collections.Counter = collections.Counter()

    def _post(self, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(self.config.url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code == 429:
                raise _Retryable(f"HTTP {e.code}") from e
            raise
        except TimeoutError as e:
            raise _Retryable(f"timed out after {self.config.timeout_s}s", timed_out=True) from e
        except (urllib.error.URLError, ConnectionError) as e:
            timed_out = isinstance(getattr(e, "reason", None), TimeoutError)
            raise _Retryable(f"{type(e).__name__}: {getattr(e, 'reason', e)}", timed_out=timed_out) from e

    async def search(self, query: str, k: int) -> list[Passage]:
        """Top-`k` passages from the server.

        Raises:
          RetrieverError: after `max_retries` retries, or at once for a 4xx or a malformed answer.
        """
        body = {"queries": [query], "topk": int(k), "return_scores": True}
        error, timed_out = "no attempt", False
        async with self._semaphore:
            for attempt in range(self.config.max_retries + 1):
                if attempt:
                    self.counts["retries"] += 1
                    await asyncio.sleep(self.config.backoff_s * 2 ** (attempt - 1))
                try:
                    self.counts["requests"] += 1
                    return parse_retrieval_response(await asyncio.to_thread(self._post, body))[:k]
                except _Retryable as e:
                    error, timed_out = str(e), e.timed_out
                except (urllib.error.HTTPError, ValueError) as e:  # a 4xx or a bad answer: retrying cannot help
                    self.counts["failures"] += 1
                    raise RetrieverError(f"retrieval server: {type(e).__name__}: {e}") from e
        self.counts["failures"] += 1
        raise RetrieverError(f"retrieval server: {error} (after {self.config.max_retries} retries)", timed_out)

    async def close(self) -> None:
        """Nothing to release: each request opens its own connection."""


def format_passages(passages: Iterable[Passage]) -> str:
    """`Doc i(Title: t) text` lines, the layout Search-R1 trains and evaluates with."""
    return "\n".join(f"Doc {i}(Title: {p.title}) {p.text}" for i, p in enumerate(passages, 1))


__all__ = [
    "BM25Index", "BadRecordError", "LocalRetriever", "Passage", "RemoteRetriever", "RemoteRetrieverConfig", "Retriever",
    "RetrieverError", "format_passages", "load_corpus", "parse_retrieval_response", "passage_from_record",
    "split_contents", "tokenize",
]
