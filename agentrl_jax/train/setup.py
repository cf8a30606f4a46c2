"""From a Config to the pieces a run needs: tasks, environments, SFT data, model assets.

Everything here is host-side preparation; the RL loop (``train/rl/loop.py``) runs the steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.envs import Environment
from agentrl_jax.envs.sandbox import make_sandbox  # noqa: F401  (re-exported: train/run.py calls setup.make_sandbox)
from agentrl_jax.rewards.verifier import MathVerifier

if TYPE_CHECKING:  # the data package imports grain: loaded when data is, not with this module
    from agentrl_jax.data import DataStats

logger = logging.getLogger(__name__)


class TaskData(NamedTuple):
    """The run's tasks and what loading them counted.

    Attributes:
      train: training task dicts (``question``, ``answer``, ``id`` and the record's metadata).
      held_out: evaluation task dicts.
      stats: a ``DataStats`` per split, "train" and "eval" (generated tasks: all kept).
    """

    train: list[dict[str, Any]]
    held_out: list[dict[str, Any]]
    stats: dict[str, DataStats]


def load_task_data(config: Config) -> TaskData:
    """(train, held-out) task dicts with at least ``question`` and ``answer``, and their counts.

    From ``data.train_path`` / ``data.eval_path`` when set, deduplicated with
    ``data.deduplicate``; the missing ones come from the environment section's
    ``make_tasks`` (the arithmetic environment generates them, disjoint by construction).
    A training task whose prompt is also a held-out prompt is
    dropped with ``data.drop_eval_overlap`` (else kept with a warning), and counted.

    Raises:
      ConfigError: a missing path, or no training task left after the overlap check.
      DataError: a path that matches nothing, or a file with no valid row (naming the key).
    """
    from agentrl_jax.data import DataStats
    from agentrl_jax.data.dedup import EVAL_OVERLAP, split_overlap

    env, data = config.environment, config.data
    train: list[dict[str, Any]] | None = None
    held_out: list[dict[str, Any]] | None = None
    stats: dict[str, DataStats] = {}
    if data.train_path:
        train, stats["train"] = _read_tasks("data.train_path", data.train_path, data.format, data.deduplicate)
    if data.eval_path:
        held_out, stats["eval"] = _read_tasks("data.eval_path", data.eval_path,
                                              "aime" if data.format == "dapo" else data.format, data.deduplicate)
    if train is None:
        train = env.make_tasks(config, "train")
    if held_out is None:
        held_out = env.make_tasks(config, "eval")
    if train is None:
        raise ConfigError(f"data.train_path is required for environment.name={env.name!r}")
    if held_out is None:
        raise ConfigError(f"data.eval_path is required for environment.name={env.name!r}")
    for split, tasks in (("train", train), ("eval", held_out)):
        stats.setdefault(split, DataStats(rows_read=len(tasks), rows_kept=len(tasks)))
    clean, overlap = split_overlap(train, held_out, lambda task: task["question"])
    if overlap:
        logger.warning("%d training tasks have the prompt of an eval task (e.g. %r)%s", len(overlap),
                       overlap[0]["question"][:200], "; dropped from train (data.drop_eval_overlap)"
                       if data.drop_eval_overlap else "; kept because data.drop_eval_overlap=false: "
                       "the held-out score is contaminated")
    if not data.drop_eval_overlap:
        stats["train"].flagged_by_reason[EVAL_OVERLAP] += len(overlap)
    else:
        stats["train"].drop_kept(EVAL_OVERLAP, len(overlap))
        train = clean
        if not train:
            raise ConfigError(f"data.train_path: every training task also appears in data.eval_path "
                              f"({data.eval_path!r}); set data.drop_eval_overlap=false to train on them anyway")
    return TaskData(train, held_out, stats)


def load_tasks(config: Config) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) task dicts; see `load_task_data`, which also returns the counts."""
    train, held_out, _ = load_task_data(config)
    return train, held_out


def _read_tasks(key: str, path: str, fmt: str, deduplicate: bool) -> tuple[list[dict[str, Any]], DataStats]:
    from agentrl_jax.data import DataError, load_task_records

    try:
        records, stats = load_task_records(path, format={"tasks": "task", "dapo": "dapo_math"}.get(fmt, fmt),
                                           deduplicate=deduplicate)
    except DataError as e:
        raise DataError(f"{key}: {e}") from None
    logger.info("tasks from %s: %s", path, stats.summary())
    return [{"question": r.prompt, "answer": r.answer, "id": r.id, **dict(r.metadata or {})} for r in records], stats


def load_sft_conversations(config: Config) -> tuple[list[list[dict[str, str]]], DataStats]:
    """The cold-start conversations of ``data.sft_path`` (ReTool-SFT format) and their counts."""
    from agentrl_jax.data import DataError, load_sft_records

    if not config.data.sft_path:
        raise ConfigError("data.sft_path is required when sft.steps > 0 for this environment")
    try:
        records, stats = load_sft_records(config.data.sft_path, format="retool_sft",
                                          deduplicate=config.data.deduplicate)
    except DataError as e:
        raise DataError(f"data.sft_path: {e}") from None
    logger.info("SFT records: %s", stats.summary())
    return [[{"role": msg.role, "content": msg.content} for msg in r.messages] for r in records], stats


def data_metrics(stats: Mapping[str, DataStats]) -> dict[str, int]:
    """Row counts per split for the metrics writer: ``data/<split>/rows_read``, ``rows_kept``,
    ``rows_skipped`` and ``data/<split>/skipped/<reason>`` (e.g. ``data/train/skipped/duplicate``)."""
    metrics: dict[str, int] = {}
    for split, split_stats in stats.items():
        metrics.update(split_stats.as_metrics(prefix=f"data/{split}/"))
    return metrics


def env_factory(config: Config, pool: Any, verifier: MathVerifier, count_tokens=None) -> Callable[[], Environment]:
    """A zero-argument constructor of a fresh environment (one per trajectory), built by the
    environment's own config section (``config.environment.make_env_factory``)."""
    return config.environment.make_env_factory(config, pool=pool, verifier=verifier, count_tokens=count_tokens)


def checkpoint_directory(key: str, path: str) -> str:
    """The HF directory of the checkpoint path of config field ``key``: ``path``, or for a ``.gguf``
    file its float32 conversion, made once per file in the user cache (``models/gguf_cache.py``)."""
    from agentrl_jax.models.gguf import GGUFError
    from agentrl_jax.models.gguf_cache import hf_directory

    try:
        return hf_directory(path)
    except GGUFError as e:
        raise ConfigError(f"{key}: {e}") from e


def prepare_model_assets(config: Config, corpus: list[str]) -> tuple[str, str]:
    """(model dir, tokenizer dir): the configured checkpoint, or a fresh scratch model.

    A ``.gguf`` model path (or tokenizer, reference or teacher path) is converted to an HF
    directory once and cached by the file's sha256 (``checkpoint_directory``).

    A scratch model gets a byte-level BPE tokenizer trained on ``corpus`` (digits split
    into single tokens, as Llama 3 and Qwen do) and random-init weights (JAX, no PyTorch
    needed), both saved as HF directories under ``output_dir/init`` — the rest of the run
    loads them exactly like a downloaded checkpoint.
    """
    m = config.model
    if m.path:
        model_dir = checkpoint_directory("model.path", m.path)
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ConfigError(f"model.path: {m.path!r} has no config.json (expected a local HF checkpoint "
                              "or a .gguf file)")
        tokenizer_dir = checkpoint_directory("model.tokenizer_path", m.tokenizer_path) if m.tokenizer_path else None
        # converted here, on the host that prepares assets, so that loading them later finds them cached
        checkpoint_directory("model.reference_path", m.reference_path)
        checkpoint_directory("hybrid.teacher_path", config.hybrid.teacher_path)
        return model_dir, tokenizer_dir or model_dir
    from agentrl_jax.models import DecoderConfig
    from agentrl_jax.models.tiny import save_scratch_checkpoint, train_tiny_tokenizer

    root = Path(config.output_dir) / "init"
    tok_dir, model_dir = root / "tokenizer", root / "model"
    if not (tok_dir / "tokenizer_config.json").exists():
        train_tiny_tokenizer(tok_dir, corpus, m.scratch.vocab_size, individual_digits=True)
    if not (model_dir / "config.json").exists():
        from agentrl_jax.models.tokenizer import Tokenizer

        vocab = Tokenizer(str(tok_dir)).vocab_size
        s = m.scratch
        decoder = DecoderConfig(
            architecture=s.architecture,
            vocab_size=vocab,
            hidden_size=s.hidden_size,
            intermediate_size=s.intermediate_size,
            num_layers=s.num_layers,
            num_heads=s.num_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            tie_word_embeddings=True,
            attention_bias=s.architecture == "qwen2",
            qk_norm=s.architecture == "qwen3",
            max_position_embeddings=512,
        )
        save_scratch_checkpoint(model_dir, decoder, seed=config.seed)
    return str(model_dir), str(tok_dir)


async def warm_up_rollout(config: Config, driver: Any, engine_mesh: Any) -> dict[str, Any] | None:
    """``rollout.warmup``: compiles every rollout program of ``driver``'s engine before the first
    rollout, so no step compiles mid-rollout; its report, or None where it does not run. "auto"
    warms up on accelerators only: a CPU run meets few of the shapes, and compiling all of them
    would cost it more than it saves. Call it after the frozen models are placed: the warm-up
    builds the KV pool, sized from the free memory."""
    from agentrl_jax.rollout.sampling import SamplingParams

    r = config.rollout
    if not (r.warmup == "on" or (r.warmup == "auto" and engine_mesh.devices.flat[0].platform != "cpu")):
        return None
    # evaluation samples without top-k / top-p: the truncating programs are the training rollout's
    truncation = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p).truncates
    return await driver.warmup(truncation=truncation)
