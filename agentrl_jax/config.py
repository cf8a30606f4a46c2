"""Typed, frozen, validated experiment configuration.

A config file is Python: ``configs/retool.py`` defines ``get_config() -> Config``. The
command line overrides any field with ``--set section.field=value``; the value is
converted to the field's declared type. Unknown keys, wrong types and impossible
combinations fail at load time with a :class:`ConfigError` that names the field and
what is allowed.

Every field carries its documentation in ``metadata["doc"]``; ``describe(Config)``
prints them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration error; the message names the field and the allowed values."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or a default_factory for mutable defaults")
    return field(default=default, metadata={"doc": doc, **kw})


def _section(default_factory: Any, doc: str) -> Any:
    return field(default_factory=default_factory, metadata={"doc": doc})


DType = Literal["float32", "bfloat16"]


class _Section:
    """Base of every config section: type checks every field after construction."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            coerced = _check_type(value, hints[f.name], self._path(f.name))
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """Section-level checks; subclasses raise ConfigError naming the field."""

    def _path(self, name: str) -> str:
        return f"{_SECTION_NAMES.get(type(self).__name__, type(self).__name__)}.{name}"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_type(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: got {value!r}; allowed values are {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for a in args:
            if a is type(None):
                if value is None:
                    return value
                continue
            try:
                return _check_type(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {value!r} matches none of {' | '.join(_type_name(a) for a in args)}")
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            raise ConfigError(f"{path}: expected a tuple, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_check_type(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a dict, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an int, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected a bool (true/false), got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise ConfigError(f"{path}: expected a {tp.__name__} section, got {type(value).__name__}")
        return value
    return value


def _require(cond: bool, path: str, msg: str) -> None:
    if not cond:
        sep = " " if msg.startswith("(") else ": "
        raise ConfigError(f"{path}{sep}{msg}")


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ScratchModelConfig(_Section):
    """A tiny model trained from scratch (used when model.path is empty)."""

    architecture: Literal["llama", "qwen2", "qwen3"] = _f("qwen3", "Decoder variant.")
    vocab_size: int = _f(384, "Tokenizer vocabulary, trained on the environment's corpus.")
    hidden_size: int = _f(128, "Model width D.")
    intermediate_size: int = _f(384, "SwiGLU width.")
    num_layers: int = _f(4, "Decoder layers.")
    num_heads: int = _f(4, "Query heads.")
    num_kv_heads: int = _f(2, "KV heads (GQA).")
    head_dim: int = _f(32, "Width of one head.")

    def validate(self) -> None:
        _require(self.num_heads % self.num_kv_heads == 0, self._path("num_kv_heads"),
                 f"({self.num_kv_heads}) must divide model.scratch.num_heads ({self.num_heads})")
        _require(self.vocab_size >= 300, self._path("vocab_size"),
                 "must be >= 300 (256 byte symbols + special tokens + merges)")


@dataclass(frozen=True)
class ModelConfig(_Section):
    path: str = _f("", "Local HF checkpoint directory of the policy; empty: train model.scratch from scratch.")
    tokenizer_path: str = _f("", "Local HF tokenizer directory; empty: the model path.")
    reference_path: str = _f("", "Checkpoint of the frozen reference; empty: the initial policy.")
    compute_dtype: DType = _f("bfloat16", "Activation / matmul dtype.")
    param_dtype: DType = _f("float32", "Dtype of the trained params (optimizer master copy).")
    reference_dtype: DType = _f("bfloat16", "Dtype of the frozen reference params.")
    attention_impl: Literal["auto", "xla", "cudnn"] = _f(
        "auto", "jax.nn.dot_product_attention implementation; auto lets JAX pick."
    )
    remat: Literal["none", "full", "dots_saveable"] = _f("full", "Rematerialization policy per layer.")
    scratch: ScratchModelConfig = _section(ScratchModelConfig, "Tiny from-scratch model (when path is empty).")

    def validate(self) -> None:
        _require(
            not (self.attention_impl == "cudnn" and self.compute_dtype == "float32"),
            self._path("attention_impl"),
            "'cudnn' needs model.compute_dtype='bfloat16' (cuDNN's fused attention takes 16-bit inputs)",
        )


@dataclass(frozen=True)
class MeshConfig(_Section):
    data: int = _f(1, "Size of the data-parallel axis (-1: fill with the remaining devices).")
    fsdp: int = _f(-1, "Size of the fully-sharded data-parallel axis (-1: fill).")
    tensor: int = _f(1, "Size of the tensor-parallel axis (-1: fill).")

    def validate(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for k, v in sizes.items():
            _require(v == -1 or v >= 1, self._path(k), f"must be >= 1 or -1 (fill), got {v}")
        _require(
            sum(v == -1 for v in sizes.values()) <= 1,
            "mesh",
            f"at most one of data/fsdp/tensor may be -1, got {sizes}",
        )

    def shape(self) -> dict[str, int]:
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclass(frozen=True)
class RolloutConfig(_Section):
    max_concurrent: int = _f(64, "Decode slots in the KV cache (trajectories in flight at once).")
    max_prompt_length: int = _f(1024, "Longest prompt (tokens) the engine prefills.")
    max_sequence_length: int = _f(4096, "KV-cache length per slot: prompt + all turns + observations.")
    max_new_tokens_per_turn: int = _f(1024, "Tokens the policy may write in one turn.")
    temperature: float = _f(1.0, "Sampling temperature; the trainer uses the same one for logprobs.")
    top_p: float = _f(1.0, "Nucleus sampling threshold (1.0: off).")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    steps_per_dispatch: int = _f(8, "Decode steps per jitted call (host stop checks in between).")
    cache_dtype: DType = _f("bfloat16", "KV-cache dtype.")
    page_size: int = _f(32, "Tokens per KV-cache page (a power of two; >= 16 for the GPU decode kernel).")
    kv_cache_bytes: int = _f(0, "KV page pool bytes per device (0: use kv_cache_memory_fraction).")
    kv_cache_memory_fraction: float = _f(
        0.0, "KV page pool as this fraction of the free device memory when the rollout state is built "
        "(0: the engine's default, 0.8; devices that report no memory, e.g. CPU, get every slot at full length)."
    )
    prefill_token_budget: int = _f(0, "New tokens prefilled per driver tick (0: 4 x max_prompt_length).")

    def engine_kwargs(self) -> dict:
        """The paged-cache arguments of `rollout.Engine` from this section."""
        return {
            "page_size": self.page_size,
            "kv_cache_bytes": self.kv_cache_bytes or None,
            "kv_cache_memory_fraction": self.kv_cache_memory_fraction or None,
        }

    def validate(self) -> None:
        _require(self.max_concurrent >= 1, self._path("max_concurrent"), "must be >= 1")
        _require(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            self._path("page_size"), f"must be a power of two, got {self.page_size}",
        )
        _require(
            self.page_size <= self.max_sequence_length, self._path("page_size"),
            f"({self.page_size}) must be <= rollout.max_sequence_length ({self.max_sequence_length})",
        )
        _require(self.kv_cache_bytes >= 0, self._path("kv_cache_bytes"), "must be >= 0 (0: use the fraction)")
        _require(
            0 <= self.kv_cache_memory_fraction <= 1, self._path("kv_cache_memory_fraction"),
            f"must be in [0, 1] (0: the default), got {self.kv_cache_memory_fraction}",
        )
        _require(
            self.prefill_token_budget == 0 or self.prefill_token_budget >= self.max_prompt_length,
            self._path("prefill_token_budget"),
            f"({self.prefill_token_budget}) must be 0 or >= rollout.max_prompt_length ({self.max_prompt_length})",
        )
        _require(self.temperature > 0, self._path("temperature"), "must be > 0 for RL (logprobs are tempered)")
        _require(0 < self.top_p <= 1, self._path("top_p"), f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, self._path("top_k"), "must be >= 0 (0: off)")
        _require(self.steps_per_dispatch >= 1, self._path("steps_per_dispatch"), "must be >= 1")
        _require(
            self.max_prompt_length < self.max_sequence_length,
            self._path("max_prompt_length"),
            f"({self.max_prompt_length}) must be < rollout.max_sequence_length ({self.max_sequence_length})",
        )


@dataclass(frozen=True)
class AlgorithmConfig(_Section):
    advantage: str = _f("grpo", "Advantage estimator name from the losses registry.")
    loss: str = _f("ppo", "Policy loss name from the losses registry.")
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = _f("token-mean", "How per-token losses are reduced.")
    group_size: int = _f(8, "Samples per prompt (G).")
    eps_low: float = _f(0.2, "PPO clip: lower bound 1 - eps_low.")
    eps_high: float = _f(0.28, "PPO clip: upper bound 1 + eps_high (clip-higher, DAPO).")
    dual_clip: float = _f(0.0, "Dual-clip constant c > 1 for negative advantages (0: off).")
    kl_coef: float = _f(0.0, "Weight of the KL to the reference (0: no reference forward).")
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator (Schulman's k1/k2/k3).")
    entropy_coef: float = _f(0.0, "Entropy bonus weight.")
    ppo_epochs: int = _f(1, "Passes over each batch.")
    minibatches: int = _f(1, "Optimizer updates per epoch (the batch is split into this many).")
    micro_batch_size: int = _f(0, "Rows per forward/backward (0: the whole minibatch).")
    correction: Literal["none", "tis", "mis", "icepop"] = _f(
        "none", "Off-policy correction of the old/rollout discrepancy (seeds/003)."
    )
    correction_level: Literal["token", "sequence"] = _f("token", "Level of the off-policy correction.")
    correction_cap: float = _f(2.0, "TIS truncation / MIS mask threshold / icepop upper bound.")
    correction_floor: float = _f(0.5, "icepop lower bound.")
    truncated_episodes: Literal["auto", "mask", "penalize"] = _f(
        "auto", "Episodes cut short by the context (finish max_tokens / context_overflow) before an answer: "
        "'mask' trains none of their tokens and leaves them out of the group baseline (DAPO's overlong "
        "filtering); 'penalize' scores them as a wrong answer (the environment's own score, plus overlong "
        "shaping if configured); 'auto': mask when a wrong answer scores below 0 (environment.outcome_scheme="
        "'pm1'), else penalize. Episodes whose environment raised are always masked.")
    dynamic_sampling: bool = _f(False, "DAPO: drop groups whose rewards are all equal and draw more.")
    max_sampling_rounds: int = _f(3, "Bound on extra draws with dynamic sampling.")
    loss_normalizer: float = _f(0.0, "Constant for seq-mean-token-sum-norm (0: max response length).")
    loss_hparams: tuple[tuple[str, float], ...] = _f(
        (), "Keyword hyper-parameters for the loss as (name, value) pairs, e.g. for a registered custom "
        "loss: --set 'algorithm.loss_hparams=[[\"beta\", 0.1]]'. Checked at load against the loss's keyword "
        "parameters; they override the ones the loss reads from the config (register_loss(hparams=...))."
    )

    def validate(self) -> None:
        _require(self.group_size >= 1, self._path("group_size"), "must be >= 1")
        names = [k for k, _ in self.loss_hparams]
        _require(len(names) == len(set(names)), self._path("loss_hparams"), f"names repeat: {names}")
        _require(self.eps_low > 0 and self.eps_high > 0, "algorithm.eps_low/eps_high", "must be > 0")
        _require(self.dual_clip == 0 or self.dual_clip > 1, self._path("dual_clip"), "must be 0 (off) or > 1")
        _require(self.kl_coef >= 0, self._path("kl_coef"), "must be >= 0")
        _require(self.ppo_epochs >= 1, self._path("ppo_epochs"), "must be >= 1")
        _require(self.minibatches >= 1, self._path("minibatches"), "must be >= 1")
        _require(self.micro_batch_size >= 0, self._path("micro_batch_size"), "must be >= 0")
        _require(
            self.correction_floor < 1 < self.correction_cap,
            "algorithm.correction_floor/correction_cap",
            f"need floor < 1 < cap, got {self.correction_floor}, {self.correction_cap}",
        )


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    learning_rate: float = _f(1e-6, "Peak learning rate (AdamW).")
    schedule: Literal["constant", "cosine"] = _f("constant", "Decay after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps.")
    min_lr_ratio: float = _f(0.0, "Final lr / peak lr for cosine.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    b1: float = _f(0.9, "Adam beta1.")
    b2: float = _f(0.999, "Adam beta2.")
    eps: float = _f(1e-8, "Adam epsilon.")
    grad_clip: float = _f(1.0, "Global-norm gradient clipping (0: off).")

    def validate(self) -> None:
        _require(self.learning_rate > 0, self._path("learning_rate"), "must be > 0")
        _require(self.warmup_steps >= 0, self._path("warmup_steps"), "must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, self._path("min_lr_ratio"), "must be in [0, 1]")
        _require(self.grad_clip >= 0, self._path("grad_clip"), "must be >= 0")


@dataclass(frozen=True)
class DataConfig(_Section):
    train_path: str = _f("", "Task records (JSONL or Parquet) for RL.")
    eval_path: str = _f("", "Held-out task records for evaluation.")
    format: Literal["tasks", "dapo", "aime"] = _f("tasks", "Schema of the task files.")
    sft_path: str = _f("", "SFT conversations (JSONL/Parquet) for the cold start.")
    deduplicate: bool = _f(True, "Drop repeated rows of train, eval and SFT files (first kept; same "
                                 "whitespace-normalized prompt: 'duplicate' with the same answer, "
                                 "'conflicting_answer' with another), counted in data/<split>/skipped/*.")
    drop_eval_overlap: bool = _f(True, "Drop training tasks whose prompt is also an eval prompt (counted as "
                                       "data/train/skipped/eval_overlap); False keeps them with a warning "
                                       "(counted as data/train/flagged/eval_overlap).")
    prompts_per_step: int = _f(8, "Prompts drawn per RL step (each sampled group_size times).")
    shuffle_seed: int = _f(0, "Seed of the per-epoch shuffle.")

    def validate(self) -> None:
        _require(self.prompts_per_step >= 1, self._path("prompts_per_step"), "must be >= 1")


@dataclass(frozen=True)
class SandboxConfig(_Section):
    backend: Literal["local", "remote"] = _f("local", "Local fork-server pool or a SandboxFusion server.")
    url: str = _f("", "SandboxFusion base URL for the remote backend.")
    workers: int = _f(8, "Concurrent executions.")
    timeout_s: float = _f(5.0, "Wall-clock limit per execution.")
    memory_mb: int = _f(1024, "Address-space limit (MB above the warm interpreter) per execution, and per "
                              "stateful session (all cells of an episode).")
    max_output_bytes: int = _f(16384, "Output cap; longer output is truncated with a marker.")
    require_isolation: bool = _f(False, "Local backend: refuse to start unless cells get their own uid and "
                                        "network and mount namespaces (root with CAP_SYS_ADMIN); by default "
                                        "a missing protection is logged and counted (sandbox/protections_missing).")

    def validate(self) -> None:
        _require(self.workers >= 1, self._path("workers"), "must be >= 1")
        _require(self.timeout_s > 0, self._path("timeout_s"), "must be > 0")
        _require(self.memory_mb >= 1, self._path("memory_mb"), "must be >= 1")
        _require(
            self.backend != "remote" or bool(self.url),
            self._path("url"),
            "is required when environment.sandbox.backend='remote'",
        )


@dataclass(frozen=True)
class EnvironmentConfig(_Section):
    name: Literal["arithmetic", "retool", "search"] = _f("arithmetic", "Which environment runs the episodes.")
    max_turns: int = _f(4, "Assistant turns per episode.")
    max_tool_calls: int = _f(3, "Tool calls (interpreter runs, searches) per episode; a call past it is not "
                                "run and asks for the final answer. 0: a no-tool baseline.")
    max_observation_tokens: int = _f(256, "Tokens of one interpreter answer (truncated with a marker).")
    system_prompt: str = _f("", "System message; empty: the environment's default.")
    outcome_scheme: Literal["pm1", "binary"] = _f("pm1", "Outcome reward: +1/-1 (ReTool) or 1/0.")
    format_weight: float = _f(0.0, "Weight of the format reward.")
    tool_weight: float = _f(0.0, "Weight of the (capped) tool-call shaping.")
    overlong_buffer: int = _f(0, "DAPO overlong shaping buffer in tokens (0: off).")
    min_digits: int = _f(2, "arithmetic: smallest operand width of generated tasks.")
    max_digits: int = _f(4, "arithmetic: largest operand width of generated tasks.")
    num_train_tasks: int = _f(4000, "arithmetic: generated training tasks (when data.train_path is empty).")
    num_eval_tasks: int = _f(200, "arithmetic: generated held-out tasks (when data.eval_path is empty).")
    demo_tool_fraction: float = _f(0.5, "arithmetic SFT: fraction of demonstrations that call the tool.")
    corpus_path: str = _f("", "search: JSONL corpus ({id, title, text} per line) for the local BM25 retriever.")
    retriever_url: str = _f("", "search: a Search-R1 retrieval server endpoint (http://host:8000/retrieve) "
                                "used instead of the local index.")
    top_k: int = _f(3, "search: passages returned per query.")
    answer_metric: Literal["em", "f1", "subem"] = _f(
        "em", "search: answer score in the reward (exact match, token F1, substring match); "
              "environment.format_weight is the weight of the format term.")
    retriever_timeout_s: float = _f(10.0, "search: HTTP timeout of one retrieval request (retried 3 times).")
    sandbox: SandboxConfig = _section(SandboxConfig, "The code-execution sandbox.")

    def validate(self) -> None:
        _require(self.max_turns >= 1, self._path("max_turns"), "must be >= 1")
        _require(self.top_k >= 1, self._path("top_k"), "must be >= 1")
        _require(self.retriever_timeout_s > 0, self._path("retriever_timeout_s"), "must be > 0")
        _require(not self.retriever_url or self.retriever_url.startswith(("http://", "https://")),
                 self._path("retriever_url"), f"must start with http:// or https://, got {self.retriever_url!r}")
        _require(not (self.corpus_path and self.retriever_url), "environment.corpus_path/retriever_url",
                 "set one retriever: a local corpus or a remote server, not both")
        if self.name == "search":
            _require(0 <= self.format_weight < 1, self._path("format_weight"),
                     f"must be in [0, 1) for environment.name='search', got {self.format_weight}")
        _require(self.max_tool_calls >= 0, self._path("max_tool_calls"), "must be >= 0")
        _require(1 <= self.min_digits <= self.max_digits, "environment.min_digits/max_digits",
                 f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        _require(0 <= self.demo_tool_fraction <= 1, self._path("demo_tool_fraction"), "must be in [0, 1]")


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    every_steps: int = _f(0, "Save every N RL steps (0: only at the end and on SIGTERM).")
    max_to_keep: int = _f(3, "Checkpoints kept.")
    async_save: bool = _f(True, "Write checkpoints in the background.")
    resume: bool = _f(True, "Resume from the latest checkpoint in the output directory.")
    export_hf: bool = _f(False, "Export the final policy as an HF directory.")

    def validate(self) -> None:
        _require(self.every_steps >= 0, self._path("every_steps"), "must be >= 0")
        _require(self.max_to_keep >= 1, self._path("max_to_keep"), "must be >= 1")


@dataclass(frozen=True)
class LoggingConfig(_Section):
    tensorboard: bool = _f(True, "Write tensorboardX event files.")
    log_every: int = _f(1, "Write metrics every N steps.")
    sample_trajectories: int = _f(2, "Trajectories written as text per logged step.")
    progress: bool = _f(True, "Console progress line with ETA.")


@dataclass(frozen=True)
class EvalConfig(_Section):
    every_steps: int = _f(0, "Evaluate every N RL steps (0: only at start and end).")
    num_tasks: int = _f(64, "Held-out tasks per evaluation (0: all).")
    samples_per_task: int = _f(1, "k for pass@k / avg@k.")
    temperature: float = _f(1.0, "Sampling temperature for evaluation (greedy if samples_per_task=1 and 0).")

    def validate(self) -> None:
        _require(self.samples_per_task >= 1, self._path("samples_per_task"), "must be >= 1")
        _require(self.temperature >= 0, self._path("temperature"), "must be >= 0")


@dataclass(frozen=True)
class SFTConfig(_Section):
    steps: int = _f(0, "SFT cold-start steps before RL (0: skip).")
    batch_size: int = _f(16, "Conversations per SFT step.")
    learning_rate: float = _f(1e-5, "SFT peak learning rate.")
    max_length: int = _f(512, "Tokens per SFT row (packed).")

    def validate(self) -> None:
        _require(self.steps >= 0, self._path("steps"), "must be >= 0")
        _require(self.batch_size >= 1, self._path("batch_size"), "must be >= 1")


JUDGE_FIELDS = ("problem", "trajectory", "outcome", "reward", "reference_answer")


@dataclass(frozen=True)
class HybridConfig(_Section):
    """Teacher, on-policy distillation, PRM judge and hindsight bridge thoughts (seeds/000).

    mode "opd": A_t = tea_t - old_t on every trajectory (pure on-policy distillation).
    mode "hybrid": A_t = A_group + lam * (tea_t - old_t) on trajectories with a teacher
    signal (a judge hint; every trajectory when judge="none"), pure A_group elsewhere.
    With a judge, the teacher scores the response under [prompt + bridge thought + response].
    """

    mode: Literal["none", "opd", "hybrid"] = _f("none", "Teacher signal in the advantage: off, pure OPD, or hybrid.")
    lam: float = _f(1.0, "lambda: weight of the OPD term in the hybrid advantage A_group + lambda * A_opd.")
    teacher: Literal["reference", "checkpoint"] = _f(
        "reference", "The teacher: the frozen reference (model.reference_path if set, else the starting "
        "policy; no extra memory when the dtypes match) or the HF checkpoint at hybrid.teacher_path.")
    teacher_path: str = _f("", "HF checkpoint of the teacher when hybrid.teacher='checkpoint'.")
    teacher_dtype: DType = _f("bfloat16", "Dtype of the frozen teacher params.")
    judge: Literal["none", "policy", "reference", "teacher", "oracle"] = _f(
        "none", "Who writes bridge thoughts / PRM scores after an episode: nobody, a model through the "
        "rollout driver (current policy, reference or teacher params), or a scripted oracle (arithmetic only).")
    judge_template: str = _f("", "Judge prompt with {problem} {trajectory} {outcome} {reward} {reference_answer}; "
                                 "empty: the built-in template (agentrl_jax.train.hindsight).")
    judge_max_new_tokens: int = _f(256, "Decoding budget of one judge answer.")
    judge_temperature: float = _f(0.0, "Judge sampling temperature (0: greedy).")
    max_hint_tokens: int = _f(64, "A bridge thought longer than this many tokens is rejected (counted).")
    hint_placement: Literal["user_message", "assistant_prefix"] = _f(
        "user_message", "Where the teacher context carries the hint: appended to the last user message "
        "(prompt re-templated) or as tokens right after the generation prompt, before the response.")
    hint_format: str = _f("\n\nHint: {hint}", "Text inserted for a hint; must contain {hint}.")
    prm_weight: float = _f(0.0, "Weight of the judge's PRM score (in [0, 1]) added to the reward (0: off).")
    sample_hints: int = _f(4, "Hints written as tensorboard text per logged step.")

    def validate(self) -> None:
        _require(self.lam >= 0, self._path("lam"), "must be >= 0")
        _require(self.teacher != "checkpoint" or bool(self.teacher_path), self._path("teacher_path"),
                 "is required when hybrid.teacher='checkpoint'")
        _require(self.max_hint_tokens >= 1, self._path("max_hint_tokens"), "must be >= 1")
        _require(self.judge_max_new_tokens >= 1, self._path("judge_max_new_tokens"), "must be >= 1")
        _require(self.judge_temperature >= 0, self._path("judge_temperature"), "must be >= 0")
        _require(self.prm_weight >= 0, self._path("prm_weight"), "must be >= 0")
        _require("{hint}" in self.hint_format, self._path("hint_format"), "must contain {hint}")
        if self.judge_template:
            import string

            try:
                names = {f for _, f, _, _ in string.Formatter().parse(self.judge_template) if f is not None}
            except ValueError as e:
                raise ConfigError(f"hybrid.judge_template: not a format string ({e})") from None
            unknown = names - set(JUDGE_FIELDS)
            _require(not unknown, self._path("judge_template"),
                     f"unknown fields {sorted(unknown)}; allowed: {', '.join(JUDGE_FIELDS)} "
                     "(write literal braces as {{ }})")
            _require("trajectory" in names, self._path("judge_template"), "must contain {trajectory}")
        _require(self.prm_weight == 0 or self.judge != "none", self._path("prm_weight"),
                 "needs a judge (hybrid.judge != 'none')")


@dataclass(frozen=True)
class AsyncConfig(_Section):
    """Asynchronous rollouts with bounded staleness (seeds/003, seeds/004; docs/async.md).

    Off (the default): each step rolls out, then trains, then syncs the weights. On: rollouts
    of later steps run while the trainer updates (a producer/consumer pipeline); a batch
    trained at params version k holds only tokens sampled by versions >= k - max_staleness,
    enforced by admission (a step's rollouts start only once version >= step - max_staleness;
    finished work is never discarded). In-flight trajectories continue on new weights
    (partial rollouts) with per-token versions.
    """

    enabled: bool = _f(False, "Overlap rollouts of later steps with training (async RL).")
    max_staleness: int = _f(1, "Versions a trained token may lag the params being updated (0: on-policy; "
                               "the async pipeline then reproduces the synchronous run).")
    placement: Literal["colocated", "disaggregated"] = _f(
        "colocated", "colocated: rollout and training share every device (time-shared); disaggregated: the "
        "devices split into a rollout mesh and a training mesh, weights move by device_put.")
    rollout_devices: int = _f(0, "disaggregated: devices given to the rollout engine (0: half of them); "
                                 "the training mesh (mesh.*) gets the rest.")
    old_logprobs: Literal["recompute", "snapshot", "ewma"] = _f(
        "recompute", "The 'old' policy of the PPO ratio: recompute (the params being trained, before the "
        "update), snapshot (exact: the params of the version that sampled each token, kept while queued "
        "data references them), ewma (PPO-EWMA proximal policy: an EWMA of the params).")
    ewma_decay: float = _f(0.5, "old_logprobs='ewma': theta_ewma <- decay * theta_ewma + (1 - decay) * theta "
                                "after every step.")
    ewma_reset_every: int = _f(0, "old_logprobs='ewma': reset the EWMA to the params every N steps (0: never).")
    ewma_min_kept: float = _f(0.0, "old_logprobs='ewma': reset when the off-policy correction keeps less than "
                                   "this share of the loss tokens (seeds/003's automatic reset; 0: off).")
    offload_optimizer: bool = _f(False, "Synchronous colocated runs: keep the optimizer state in host memory "
                                        "during rollouts (moved back for the update).")
    release_kv_cache: bool = _f(True, "Synchronous runs: free the rollout KV cache after each rollout so the "
                                      "update has the memory (it is re-created for the next rollout).")

    def validate(self) -> None:
        _require(self.max_staleness >= 0, self._path("max_staleness"), "must be >= 0")
        _require(self.rollout_devices >= 0, self._path("rollout_devices"), "must be >= 0 (0: half)")
        _require(0.0 <= self.ewma_decay < 1.0, self._path("ewma_decay"), f"must be in [0, 1), got {self.ewma_decay}")
        _require(self.ewma_reset_every >= 0, self._path("ewma_reset_every"), "must be >= 0 (0: never)")
        _require(0.0 <= self.ewma_min_kept <= 1.0, self._path("ewma_min_kept"), "must be in [0, 1]")
        _require(self.placement == "colocated" or self.enabled, self._path("placement"),
                 "'disaggregated' needs async_rl.enabled=true (a synchronous step would leave one half idle)")
        _require(not (self.offload_optimizer and self.enabled), self._path("offload_optimizer"),
                 "applies to synchronous runs only (async rollouts run while the optimizer works)")


@dataclass(frozen=True)
class Config(_Section):
    name: str = _f("experiment", "Run name (used in the output directory).")
    seed: int = _f(0, "Global seed: init, sampling, data order.")
    output_dir: str = _f("runs/experiment", "Checkpoints, metrics and exports go here.")
    total_steps: int = _f(100, "RL steps.")
    model: ModelConfig = _section(ModelConfig, "Policy / reference checkpoints and numerics.")
    mesh: MeshConfig = _section(MeshConfig, "Device mesh.")
    rollout: RolloutConfig = _section(RolloutConfig, "Rollout engine.")
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "Advantages, loss, corrections.")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "Optimizer and schedule.")
    data: DataConfig = _section(DataConfig, "Datasets.")
    environment: EnvironmentConfig = _section(EnvironmentConfig, "Environment, tools and rewards.")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = _section(LoggingConfig, "Metrics and logs.")
    eval: EvalConfig = _section(EvalConfig, "Evaluation.")
    sft: SFTConfig = _section(SFTConfig, "Supervised cold start.")
    hybrid: HybridConfig = _section(HybridConfig, "Teacher, OPD, PRM judge and hindsight hints (seeds/000).")
    async_rl: AsyncConfig = _section(AsyncConfig, "Asynchronous rollouts, staleness bound, old-logit source.")

    def validate(self) -> None:
        _require(self.total_steps >= 0, "total_steps", "must be >= 0")
        algo = self.algorithm
        # The loss and estimator names, their hyper-parameters and the group size, through the
        # registries (a custom loss registered before the Config is built is checked the same way).
        check_registered_names(self)
        trajectories = self.data.prompts_per_step * algo.group_size
        _require(
            trajectories % algo.minibatches == 0,
            "algorithm.minibatches",
            f"({algo.minibatches}) must divide data.prompts_per_step * algorithm.group_size ({trajectories})",
        )
        if algo.micro_batch_size:
            per_minibatch = trajectories // algo.minibatches
            _require(
                per_minibatch % algo.micro_batch_size == 0,
                "algorithm.micro_batch_size",
                f"({algo.micro_batch_size}) must divide the trajectories per minibatch ({per_minibatch})",
            )


        _require(not self.model.reference_path or algo.kl_coef > 0, "model.reference_path",
                 "is loaded only for the KL term (algorithm.kl_coef > 0); with kl_coef=0 nothing would use it "
                 "(a teacher or judge 'reference' would silently be a copy of the initial policy instead)")

        hybrid = self.hybrid
        _require(hybrid.judge != "oracle" or self.environment.name == "arithmetic", "hybrid.judge",
                 "'oracle' is a scripted judge of the arithmetic environment only")
        _require(hybrid.judge != "teacher" or hybrid.mode != "none", "hybrid.judge",
                 "'teacher' needs a teacher (hybrid.mode 'opd' or 'hybrid')")
        a = self.async_rl
        if a.enabled:
            _require(hybrid.judge == "none", "hybrid.judge",
                     f"{hybrid.judge!r} with async_rl.enabled=true: the async pipeline does not run a judge (a "
                     "model judge decodes through the rollout driver between steps, which async rollouts keep "
                     "busy), so training would go on without verdicts: no hints (hybrid.mode='hybrid' would "
                     "distill on every trajectory) and no PRM reward. Use async_rl.enabled=false, or "
                     "hybrid.judge='none' (docs/async.md)")
            _require(a.max_staleness == 0 or a.old_logprobs == "snapshot" or algo.correction != "none",
                     "algorithm.correction",
                     f"async_rl.max_staleness={a.max_staleness} with old_logprobs={a.old_logprobs!r}: the 'old' "
                     "policy is not the one that sampled the tokens, so the discrepancy old/mu must be corrected "
                     "(set algorithm.correction to 'tis', 'mis' or 'icepop'; or async_rl.old_logprobs='snapshot')")

        self._validate_reward_shaping()

    def _validate_reward_shaping(self) -> None:
        """Shaping the chosen environment would ignore, or could not compute, fails here."""
        env = self.environment
        for key in ("format_weight", "tool_weight", "overlong_buffer"):
            _require(getattr(env, key) >= 0, f"environment.{key}", f"must be >= 0, got {getattr(env, key)}")
        if env.name == "search":
            for key, value in (("overlong_buffer", env.overlong_buffer), ("tool_weight", env.tool_weight)):
                _require(not value, f"environment.{key}",
                         f"({value}) has no effect with environment.name='search' (its reward is the answer "
                         "score and environment.format_weight only); set it to 0")
            return
        if env.overlong_buffer:
            limit = overlong_max_tokens(self)
            _require(env.overlong_buffer <= limit, "environment.overlong_buffer",
                     f"({env.overlong_buffer}) must be <= the longest response ({limit} tokens: "
                     "min(rollout.max_new_tokens_per_turn * environment.max_turns, rollout.max_sequence_length "
                     "- rollout.max_prompt_length)); the soft overlong penalty starts that many tokens before it")
        margin = 1.0 if env.outcome_scheme == "binary" else 2.0  # right minus wrong answer
        _require(env.tool_weight * TOOL_REWARD_CAP < margin, "environment.tool_weight",
                 f"({env.tool_weight}) times the tool bonus cap {TOOL_REWARD_CAP} must stay below the outcome "
                 f"margin {margin}, or tool calls could outweigh a correct answer")

    def _path(self, name: str) -> str:
        return name


#: rewards.shaping.RewardWeights.tool_cap as the trainer builds it (train/setup.py).
TOOL_REWARD_CAP = 0.3


def overlong_max_tokens(config: Config) -> int:
    """L_max of DAPO's overlong shaping: the most tokens the policy can write in one episode.

    The per-turn budget times the turns, but never more than the context leaves after a
    full-length prompt: with a 16k context and 16 turns of 4k tokens, the episode is cut by
    the context long before 64k, and an L_max of 64k would never shape anything.
    """
    r = config.rollout
    return min(r.max_new_tokens_per_turn * config.environment.max_turns, r.max_sequence_length - r.max_prompt_length)


_SECTION_NAMES = {
    "ModelConfig": "model",
    "ScratchModelConfig": "model.scratch",
    "MeshConfig": "mesh",
    "RolloutConfig": "rollout",
    "AlgorithmConfig": "algorithm",
    "OptimizerConfig": "optimizer",
    "DataConfig": "data",
    "SandboxConfig": "environment.sandbox",
    "EnvironmentConfig": "environment",
    "CheckpointConfig": "checkpoint",
    "LoggingConfig": "logging",
    "EvalConfig": "eval",
    "SFTConfig": "sft",
    "HybridConfig": "hybrid",
    "AsyncConfig": "async_rl",
}


# --------------------------------------------------------------------------- overrides


def _parse_value(text: str, tp: Any, path: str) -> Any:
    """Convert a command-line string to the field's type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _parse_value(text, a, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: cannot parse {text!r} as {tp}")
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return a
        raise ConfigError(f"{path}: got {text!r}; allowed values are {', '.join(map(repr, args))}")
    if tp is bool:
        low = text.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected a bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{path}: expected an int, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{path}: expected a float, got {text!r}") from None
    if tp is str:
        return text
    if origin in (tuple, dict):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"{path}: expected JSON for a {origin.__name__}, got {text!r}") from None
    raise ConfigError(f"{path}: cannot be set from the command line (type {tp})")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def apply_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """Return ``config`` with ``section.field=value`` overrides applied (and validated).

    Raises:
      ConfigError: naming the key for an unknown key, a malformed item or a bad value.
    """
    raw: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. optimizer.learning_rate=1e-6")
        key, text = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        cls: type = Config
        for i, part in enumerate(parts):
            fields = _fields(cls)
            if part not in fields:
                where = ".".join(parts[:i]) or "the top level"
                raise ConfigError(
                    f"override {key!r}: unknown key {part!r} in {where}; known keys: {', '.join(sorted(fields))}"
                )
            tp = typing.get_type_hints(cls)[part]
            if i < len(parts) - 1:
                if not dataclasses.is_dataclass(tp):
                    raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section")
                cls = tp
            else:
                if dataclasses.is_dataclass(tp):
                    raise ConfigError(f"override {key!r}: is a section; set one of its fields")
                raw[key] = _parse_value(text.strip(), tp, key)
    return _replace_nested(config, raw)


def _replace_nested(obj: Any, updates: dict[str, Any]) -> Any:
    direct = {k: v for k, v in updates.items() if "." not in k}
    nested: dict[str, dict[str, Any]] = {}
    for k, v in updates.items():
        if "." in k:
            head, rest = k.split(".", 1)
            nested.setdefault(head, {})[rest] = v
    for head, sub in nested.items():
        direct[head] = _replace_nested(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct) if direct else obj


def from_dict(data: dict[str, Any], cls: type = Config, prefix: str = "") -> Any:
    """Build a config from a nested dict (e.g. a checkpoint's saved config), strictly."""
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{path}: unknown key; known keys: {', '.join(sorted(fields))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{path}: expected a section (dict), got {type(value).__name__}")
            value = from_dict(value, tp, prefix=f"{path}.")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def to_dict(config: Any) -> dict[str, Any]:
    """The config as a JSON-serializable nested dict."""
    return dataclasses.asdict(config)


# --------------------------------------------------------------------------- loading


_CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parent.parent / "configs")


def resolve_config_path(name: str) -> Path:
    """Find a config file: a path as given, or a bare name (``retool`` / ``retool.py``) in configs/."""
    path = Path(name)
    if path.is_file():
        return path
    candidates = [name] if name.endswith(".py") else [name, name + ".py"]
    for d in _CONFIG_DIRS:
        for c in candidates:
            p = d / Path(c).name
            if p.is_file():
                return p
    known = sorted({p.stem for d in _CONFIG_DIRS if d.is_dir() for p in d.glob("*.py")})
    raise ConfigError(f"config file {name!r} not found; known configs: {', '.join(known) or '(none)'}")


def load_config(name: str, overrides: Sequence[str] = ()) -> Config:
    """Load ``get_config()`` from a Python config file, apply overrides, validate.

    Names from the losses registry (``algorithm.loss``, ``algorithm.advantage``) are
    checked when the Config is built, after the file's imports ran, so a config file may
    import (or define) a module that registers a custom loss.
    """
    path = resolve_config_path(name)
    spec = importlib.util.spec_from_file_location(f"agentrl_jax_config_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path}: defines no get_config() function")
    config = module.get_config()
    if not isinstance(config, Config):
        raise ConfigError(f"config file {path}: get_config() returned {type(config).__name__}, not Config")
    config = apply_overrides(config, overrides)
    check_required_paths(config)
    return config


def check_required_paths(config: Config) -> None:
    """Paths a run needs but a config file may leave to the command line.

    Checked after overrides (a config file cannot know where the data lives).
    """
    if config.environment.name == "arithmetic":
        return
    if config.environment.name == "search":
        _require(bool(config.environment.corpus_path or config.environment.retriever_url),
                 "environment.corpus_path", "is required for environment.name='search' (set it with "
                 "--set environment.corpus_path=corpus.jsonl, or use a retrieval server with "
                 "--set environment.retriever_url=http://host:8000/retrieve)")
    for key, value in (
        ("model.path", config.model.path),
        ("data.train_path", config.data.train_path),
        ("data.eval_path", config.data.eval_path),
    ):
        _require(bool(value), key, f"is required for environment.name={config.environment.name!r} "
                                   f"(set it with --set {key}=...)")


def check_registered_names(config: Config) -> None:
    """Check the loss and advantage against the losses registry (``Config.validate`` runs it).

    Unknown names fail with the registered ones; so do an estimator or a loss the trainer
    could not call with what it passes (rewards, group_ids, loss_mask, num_groups; the
    arrays, the packed layout and the hyper-parameters from ``registry.loss_hparams``), an
    ``algorithm.loss_hparams`` key the loss does not take, and a group size the estimator
    is not defined for.
    """
    try:
        from agentrl_jax.losses import registry
    except ImportError:  # the losses package is optional for config-only use
        return
    for key, value, known in (
        ("algorithm.loss", config.algorithm.loss, registry.known_losses()),
        ("algorithm.advantage", config.algorithm.advantage, registry.known_advantages()),
    ):
        if value not in known:
            raise ConfigError(f"{key}: unknown name {value!r}; registered: {', '.join(sorted(known))}")
    # The trainer calls the estimator and the loss with these arguments only
    # (train/episodes.py compute_advantages, train/step.py); one that needs more (a critic's
    # values, teacher logprobs, a hyper-parameter without default) would fail at the first update.
    a = config.algorithm
    min_group_size, note = registry.advantage_info(a.advantage)
    needs = _required_parameters(registry.get_advantage(a.advantage), positional=3,
                                 keywords={"num_groups", "sequence_ids"})
    _require(not needs, "algorithm.advantage", f"{a.advantage!r} {note}" if note else
             f"{a.advantage!r} requires {sorted(needs)}, which the RL trainer does not pass (it passes rewards, "
             "group_ids, loss_mask, num_groups); use a sequence estimator (grpo, drgrpo, rloo, reinforce_pp)")
    _require(a.group_size >= min_group_size, "algorithm.group_size",
             f"must be >= {min_group_size} for the group estimator {a.advantage!r} (got {a.group_size})")
    errors = registry.loss_hparam_errors(a.loss, config)
    _require(not errors, "algorithm.loss_hparams", "; ".join(errors))
    needs = _required_parameters(registry.get_loss(a.loss), positional=4,
                                 keywords={"sequence_ids", "num_sequences", *registry.loss_hparams(a.loss, config)})
    _require(not needs, "algorithm.loss_hparams",
             f"loss {a.loss!r} requires {sorted(needs)}, which have no defaults; set them with "
             "--set 'algorithm.loss_hparams=[[\"name\", value]]'")


def _required_parameters(fn: Any, *, positional: int, keywords: set[str]) -> set[str]:
    """Parameters of ``fn`` without a default that a call with ``positional`` positional
    arguments and the ``keywords`` does not fill."""
    import inspect

    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no inspectable signature: nothing to check
        return set()
    filled = 0
    needs = set()
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and filled < positional:
            filled += 1
            continue
        if p.default is inspect.Parameter.empty and p.name not in keywords:
            needs.add(p.name)
    return needs


def describe(cls: type = Config, prefix: str = "") -> str:
    """Every field with its type, default and documentation (for --help)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(describe(tp, prefix=f"{prefix}{f.name}."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else "(required)"
            lines.append(f"{prefix}{f.name} = {default!r}  # {f.metadata.get('doc', '')}")
    return "\n".join(lines)
