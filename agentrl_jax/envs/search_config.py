"""The search environment's config section (``environment.name='search'``) and the retriever it builds.

The episodes are Search-R1 question answering (``envs/search.py``); the retriever is a
local BM25 index over a corpus or a remote retrieval server (``envs/retrieval.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar, Literal

from agentrl_jax.config import Config, ConfigError, EnvironmentConfig, config_field, register_environment, require
from agentrl_jax.envs.retrieval import LocalRetriever, RemoteRetriever, RemoteRetrieverConfig, Retriever
from agentrl_jax.envs.search import SearchConfig, SearchEnv
from agentrl_jax.envs.tools import NativeSearchEnv

logger = logging.getLogger(__name__)


@register_environment("search")
@dataclasses.dataclass(frozen=True)
class SearchEnvConfig(EnvironmentConfig):
    """Search-R1 question answering over a retriever (envs/search.py)."""

    name: str = config_field("search", "Which environment runs the episodes.")
    corpus_path: str = config_field("", "search: JSONL corpus ({id, title, text} per line) for the local BM25 "
                                        "retriever.")
    retriever_url: str = config_field("", "search: a Search-R1 retrieval server endpoint "
                                          "(http://host:8000/retrieve) used instead of the local index.")
    top_k: int = config_field(3, "search: passages returned per query.")
    answer_metric: Literal["em", "f1", "subem"] = config_field(
        "em", "search: answer score in the reward (exact match, token F1, substring match); "
              "environment.format_weight is the weight of the format term.")
    retriever_timeout_s: float = config_field(10.0, "search: HTTP timeout of one retrieval request (retried 3 "
                                                    "times).")

    layouts: ClassVar[tuple[str, ...]] = ("inline", "native")

    def validate(self) -> None:
        super().validate()
        require(self.top_k >= 1, self._path("top_k"), "must be >= 1")
        require(self.retriever_timeout_s > 0, self._path("retriever_timeout_s"), "must be > 0")
        require(not self.retriever_url or self.retriever_url.startswith(("http://", "https://")),
                self._path("retriever_url"), f"must start with http:// or https://, got {self.retriever_url!r}")
        require(not (self.corpus_path and self.retriever_url), "environment.corpus_path/retriever_url",
                "set one retriever: a local corpus or a remote server, not both")
        require(0 <= self.format_weight < 1, self._path("format_weight"),
                f"must be in [0, 1) for environment.name='search', got {self.format_weight}")

    def validate_in(self, config: Config) -> None:
        """The search reward is the answer score and the format term only: other shaping fails."""
        for key, value in (("overlong_buffer", self.overlong_buffer), ("tool_weight", self.tool_weight)):
            require(not value, f"environment.{key}",
                    f"({value}) has no effect with environment.name='search' (its reward is the answer "
                    "score and environment.format_weight only); set it to 0")

    def check_paths(self, config: Config) -> None:
        require(bool(self.corpus_path or self.retriever_url), "environment.corpus_path",
                "is required for environment.name='search' (set it with --set environment.corpus_path=corpus.jsonl, "
                "or use a retrieval server with --set environment.retriever_url=http://host:8000/retrieve)")
        require(bool(config.model.path), "model.path",
                f"is required for environment.name={self.name!r} (set it with --set model.path=...)")
        super().check_paths(config)

    def make_env_factory(self, config, *, pool, verifier, count_tokens):
        del pool, verifier  # a search episode runs no code and grades by string match
        retriever, settings = make_retriever(self), SearchConfig.from_config(config)
        if self.layout == "native":
            return lambda: NativeSearchEnv(retriever, settings, tool_format=self.tool_format,
                                           count_tokens=count_tokens)
        return lambda: SearchEnv(retriever, settings, count_tokens=count_tokens)


def make_retriever(section: SearchEnvConfig) -> Retriever:
    """The run's retriever (one per run): a remote server, or a BM25 index built from the corpus."""
    if section.retriever_url:
        return RemoteRetriever(RemoteRetrieverConfig(url=section.retriever_url, timeout_s=section.retriever_timeout_s))
    if not section.corpus_path:
        raise ConfigError("environment.corpus_path or environment.retriever_url is required for "
                          "environment.name='search'")
    retriever = LocalRetriever.from_corpus(section.corpus_path)
    logger.info("BM25 index over %s: %d passages", section.corpus_path, len(retriever.index))
    return retriever
