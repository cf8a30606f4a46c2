"""From a Config to the pieces a run needs: tasks, environments, SFT data, model assets.

Everything here is host-side preparation; the trainer (``train/rl.py``) owns the loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from agentrl_jax.config import TOOL_REWARD_CAP, Config, ConfigError, overlong_max_tokens
from agentrl_jax.envs import (
    ArithmeticEnv,
    Environment,
    ReToolConfig,
    ReToolEnv,
    SandboxConfig,
    SandboxPool,
    arithmetic_config,
    demonstration,
    make_tasks,
)
from agentrl_jax.envs.retrieval import LocalRetriever, RemoteRetriever, RemoteRetrieverConfig
from agentrl_jax.envs.search import SearchConfig, SearchEnv
from agentrl_jax.envs.retool import initial_messages
from agentrl_jax.rewards.shaping import RewardWeights
from agentrl_jax.rewards.verifier import MathVerifier

logger = logging.getLogger(__name__)


def load_tasks(config: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) task dicts with at least ``question`` and ``answer``.

    From ``data.train_path`` / ``data.eval_path`` when set; for the arithmetic environment
    the missing ones are generated (disjoint by construction).
    """
    env = config.environment
    train: list[dict[str, Any]] | None = None
    held_out: list[dict[str, Any]] | None = None
    if config.data.train_path:
        train = _read_tasks(config.data.train_path, config.data.format)
    if config.data.eval_path:
        held_out = _read_tasks(config.data.eval_path, "aime" if config.data.format == "dapo" else config.data.format)
    if env.name == "arithmetic":
        widths = range(env.min_digits, env.max_digits + 1)
        if train is None:
            per = -(-env.num_train_tasks // len(widths))
            train = [t for d in widths for t in make_tasks(per, d, seed=config.seed, split="train")]
        if held_out is None:
            per = -(-env.num_eval_tasks // len(widths))
            held_out = [t for d in widths for t in make_tasks(per, d, seed=config.seed, split="held_out")]
    if train is None:
        raise ConfigError(f"data.train_path is required for environment.name={env.name!r}")
    if held_out is None:
        raise ConfigError(f"data.eval_path is required for environment.name={env.name!r}")
    return train, held_out


def _read_tasks(path: str, fmt: str) -> list[dict[str, Any]]:
    from agentrl_jax.data import load_task_records

    records, stats = load_task_records(path, format={"tasks": "task", "dapo": "dapo_math"}.get(fmt, fmt))
    logger.info("tasks from %s: %s", path, stats.summary())
    return [{"question": r.prompt, "answer": r.answer, "id": r.id, **dict(r.metadata or {})} for r in records]


def reward_weights(config: Config) -> RewardWeights:
    env = config.environment
    return RewardWeights(
        outcome_scheme=env.outcome_scheme,
        format=env.format_weight,
        tool=env.tool_weight,
        overlong=1.0 if env.overlong_buffer else 0.0,
        max_tokens=overlong_max_tokens(config) if env.overlong_buffer else None,
        tool_cap=TOOL_REWARD_CAP,
        overlong_cache_tokens=max(env.overlong_buffer, 1),
    )


def env_config(config: Config) -> ReToolConfig:
    env = config.environment
    common = dict(
        max_turns=env.max_turns,
        max_tool_calls=max(env.max_tool_calls, 1),
        max_observation_chars=max(env.max_observation_tokens * 4, 16),
        max_observation_tokens=env.max_observation_tokens,
        tool_timeout_s=env.sandbox.timeout_s,
        reward_weights=reward_weights(config),
    )
    if env.name == "arithmetic":
        return arithmetic_config(**common)
    system = env.system_prompt or ReToolConfig().system_prompt
    return ReToolConfig(system_prompt=system, **common)


def make_sandbox(config: Config):
    sb = config.environment.sandbox
    if sb.backend == "remote":
        from agentrl_jax.envs import RemoteSandbox, RemoteSandboxConfig

        return RemoteSandbox(RemoteSandboxConfig(base_url=sb.url, timeout_s=sb.timeout_s, memory_mb=sb.memory_mb,
                                                 max_concurrency=sb.workers))
    return SandboxPool(
        SandboxConfig(
            max_concurrency=sb.workers,
            timeout_s=sb.timeout_s,
            memory_mb=sb.memory_mb,
            output_limit_bytes=sb.max_output_bytes,
        )
    )


def search_env_config(config: Config) -> SearchConfig:
    env = config.environment
    return SearchConfig(
        top_k=env.top_k,
        max_turns=env.max_turns,
        max_searches=max(env.max_tool_calls, 1),
        max_observation_chars=max(env.max_observation_tokens * 4, 16),
        max_observation_tokens=env.max_observation_tokens,
        answer_metric=env.answer_metric,
        format_score=env.format_weight,
        outcome_scheme=env.outcome_scheme,
        system_prompt=env.system_prompt or None,
    )


def make_retriever(config: Config):
    """The search environment's retriever: a remote server, or a BM25 index built from the corpus."""
    env = config.environment
    if env.retriever_url:
        return RemoteRetriever(RemoteRetrieverConfig(url=env.retriever_url, timeout_s=env.retriever_timeout_s))
    if not env.corpus_path:
        raise ConfigError("environment.corpus_path or environment.retriever_url is required for "
                          "environment.name='search'")
    retriever = LocalRetriever.from_corpus(env.corpus_path)
    logger.info("BM25 index over %s: %d passages", env.corpus_path, len(retriever.index))
    return retriever


def env_factory(config: Config, pool: Any, verifier: MathVerifier, count_tokens=None) -> Callable[[], Environment]:
    """A zero-argument constructor of a fresh environment (one per trajectory).

    The search environment uses neither `pool` nor `verifier`; its retriever (one per
    run) is built here.
    """
    if config.environment.name == "search":
        retriever, search_cfg = make_retriever(config), search_env_config(config)
        return lambda: SearchEnv(retriever, search_cfg, count_tokens=count_tokens)
    cfg = env_config(config)
    if config.environment.name == "arithmetic":
        return lambda: ArithmeticEnv(pool, verifier, cfg, count_tokens=count_tokens)
    return lambda: ReToolEnv(pool, verifier, cfg, count_tokens=count_tokens)


def arithmetic_demonstrations(config: Config, tasks: list[dict[str, Any]]) -> list[list[dict[str, str]]]:
    """SFT conversations for the arithmetic demo: a mix of tool use and answers from memory.

    A ``demo_tool_fraction`` of demonstrations call the interpreter and copy its result;
    the rest answer directly, right on easy tasks and often wrong on long numbers. The
    style is drawn independently of the task, so the SFT policy calls the tool about as
    often as the demonstrator did, whatever the difficulty: RL has to learn when the tool
    pays off. The SFT stage itself is not weakened.
    """
    rng = np.random.default_rng([config.seed, 7])
    env_cfg = env_config(config)
    conversations = []
    for task in tasks:
        style = "tool" if rng.random() < config.environment.demo_tool_fraction else "memory"
        turns = demonstration(task, style, rng, fenced=env_cfg.fenced)
        conversations.append(initial_messages(env_cfg, task) + turns)
    return conversations


def prepare_model_assets(config: Config, corpus: list[str]) -> tuple[str, str]:
    """(model dir, tokenizer dir): the configured checkpoint, or a fresh scratch model.

    A scratch model gets a byte-level BPE tokenizer trained on ``corpus`` (digits split
    into single tokens, as Llama 3 and Qwen do) and random-init weights from
    ``transformers``, both saved as HF directories under ``output_dir/init`` — the rest of
    the run loads them exactly like a downloaded checkpoint.
    """
    m = config.model
    if m.path:
        if not os.path.isfile(os.path.join(m.path, "config.json")):
            raise ConfigError(f"model.path: {m.path!r} has no config.json (expected a local HF checkpoint)")
        return m.path, m.tokenizer_path or m.path
    from agentrl_jax.models.tiny import save_tiny_hf_checkpoint, train_tiny_tokenizer

    root = Path(config.output_dir) / "init"
    tok_dir, model_dir = root / "tokenizer", root / "model"
    if not (tok_dir / "tokenizer_config.json").exists():
        train_tiny_tokenizer(tok_dir, corpus, m.scratch.vocab_size, individual_digits=True)
    if not (model_dir / "config.json").exists():
        from agentrl_jax.models.tokenizer import Tokenizer

        vocab = Tokenizer(str(tok_dir)).vocab_size
        s = m.scratch
        save_tiny_hf_checkpoint(
            model_dir,
            s.architecture,
            vocab_size=vocab,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_layers=s.num_layers,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            tie_word_embeddings=True,
            seed=config.seed,
        )
    return str(model_dir), str(tok_dir)
