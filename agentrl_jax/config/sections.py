"""The sections of an experiment's Config: model, mesh, rollout, algorithm, ..., and Config.

Each section is a frozen dataclass whose fields carry their documentation; the section
base and type checks are in ``config/core.py`` (overrides and loading beside it), the
environment section's base (each environment registers its own subclass, chosen by
``environment.name``) in ``config/environments.py``, and the two largest sections in
``config/rollout.py`` and ``config/hybrid.py`` (the async section in ``config/async_rl.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agentrl_jax.config.async_rl import AsyncConfig
from agentrl_jax.config.core import SECTION_PATHS, DType, _f, _require, _section, _Section
from agentrl_jax.config.critic import CriticConfig
from agentrl_jax.config.registries import run_config_checks
from agentrl_jax.config.environments import EnvironmentConfig
from agentrl_jax.config.hybrid import HybridConfig
from agentrl_jax.config.lora import LoraConfig
from agentrl_jax.config.policies import MultiPolicyConfig  # registers its check of the policies' configs
from agentrl_jax.config.rollout import RolloutConfig


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
    path: str = _f("", "The policy: a local HF checkpoint directory or a .gguf file; empty: train model.scratch from scratch.")
    tokenizer_path: str = _f("", "Local HF tokenizer directory; empty: the model path.")
    reference_path: str = _f("", "Checkpoint of the frozen reference; empty: the initial policy.")
    compute_dtype: DType = _f("bfloat16", "Activation / matmul dtype.")
    param_dtype: DType = _f("float32", "Dtype of the trained params (optimizer master copy).")
    reference_dtype: DType = _f("bfloat16", "Dtype of the frozen reference params.")
    attention_impl: Literal["auto", "xla", "cudnn", "splash"] = _f(
        "auto", "jax.nn.dot_product_attention implementation; auto: cuDNN on GPUs in bfloat16, splash on TPUs, "
        "else JAX's pick; splash: Pallas splash attention with segment ids for the trainer's forwards, TPU only "
        "(refused on other backends; checked only in Pallas's interpreter so far; models/splash.py)."
    )
    remat: Literal["none", "full", "dots_saveable", "attention_saveable", "dots_attention_saveable"] = _f(
        "full", "Rematerialization policy per layer (what the backward pass keeps instead of recomputing; "
        "docs/benchmarks.md, 'Train step', compares them).")
    lm_head_dtype: Literal["param", "compute"] = _f(
        "param", "Inputs of the logits matmul (trainer and engine alike; float32 logits either way): the output "
        "embedding as stored (param) or cast to compute_dtype like every other weight (compute: faster "
        "on GPUs with float32 params and bfloat16 compute; docs/benchmarks.md, 'Train step').")
    scratch: ScratchModelConfig = _section(ScratchModelConfig, "Tiny from-scratch model (when path is empty).")
    lora: LoraConfig = _section(LoraConfig, "LoRA adapters instead of full fine-tuning (docs/lora.md).")
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"doc": (
        "Variables every chat-template render gets (prompts, appended tool messages, SFT records), e.g. "
        "{\"enable_thinking\": false} for Qwen3; JSON on the command line.")})

    def validate(self) -> None:
        reserved = sorted(set(self.chat_template_kwargs) & {"messages", "tools", "add_generation_prompt",
                                                              "tokenize"})
        _require(not reserved, self._path("chat_template_kwargs"),
                 f"sets {reserved}, which each render passes itself; remove them")
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
    pack_rows: bool = _f(
        False, "Pack several trajectories per row of pack_row_tokens tokens (segment ids, positions restarting) for "
        "every forward pass and the update; micro-batches then count tokens (micro_batch_tokens), not rows. "
        "Same loss and gradients as padded rows, without the padding's compute (train/packing.py).")
    pack_row_tokens: int = _f(4096, "pack_rows: tokens per packed row (a longer trajectory gets a row of its own, "
                              "bucketed).")
    micro_batch_tokens: int = _f(0, "pack_rows: token budget of one forward/backward (a whole number of rows; "
                                 "0: the whole minibatch at once).")
    logprob_chunk_tokens: int = _f(
        1024, "Tokens per chunk of the chunked logprobs (every forward and the update; a chunk is the same "
        "span of positions of every row, at least one): the largest float32 logits buffer is [chunk, vocab] "
        "(0.6 MB per token at a 152k vocabulary), and larger chunks mean fewer, larger lm-head matmuls "
        "(docs/benchmarks.md, 'Train step').")
    correction: Literal["none", "tis", "mis", "icepop"] = _f(
        "none", "Off-policy correction of the old/rollout discrepancy (arXiv:2605.12070)."
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
        _require(self.pack_row_tokens >= 1, self._path("pack_row_tokens"), "must be >= 1")
        _require(self.micro_batch_tokens >= 0, self._path("micro_batch_tokens"), "must be >= 0")
        _require(self.logprob_chunk_tokens >= 1, self._path("logprob_chunk_tokens"), "must be >= 1")
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
    every_host: bool = _f(False, "Several hosts: every host writes its metrics (process i > 0 to "
                                 "metrics_host<i>/ beside metrics/) and, at the end, the sha256 of its copy "
                                 "of every weight (params_digest/host<i>.json), to check that the hosts agree.")


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
    critic: CriticConfig = _section(CriticConfig, "The value model of algorithm.advantage='gae' (PPO with a critic).")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "Optimizer and schedule.")
    data: DataConfig = _section(DataConfig, "Datasets.")
    environment: EnvironmentConfig = _section(EnvironmentConfig, "Environment, tools and rewards.")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "Checkpointing.")
    logging: LoggingConfig = _section(LoggingConfig, "Metrics and logs.")
    eval: EvalConfig = _section(EvalConfig, "Evaluation.")
    sft: SFTConfig = _section(SFTConfig, "Supervised cold start.")
    hybrid: HybridConfig = _section(HybridConfig, "Teacher, OPD, PRM judge and hindsight hints (docs/hybrid.md).")
    async_rl: AsyncConfig = _section(AsyncConfig, "Asynchronous rollouts, staleness bound, old-logit source.")
    multi_policy: MultiPolicyConfig = _section(MultiPolicyConfig, "Policies sharing an episode (docs/multi_policy.md).")

    def validate(self) -> None:
        _require(self.total_steps >= 0, "total_steps", "must be >= 0")
        algo = self.algorithm
        # The loss and estimator names, their hyper-parameters and the group size, by the checks
        # the losses registry registers (a custom loss registered before the Config is built is
        # checked the same way).
        run_config_checks(self)
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
        _require(hybrid.judge != "oracle" or self.environment.name in ("arithmetic", "retool_small"), "hybrid.judge",
                 "'oracle' is a scripted judge of the arithmetic and retool_small (program task) environments only")
        _require(hybrid.judge != "teacher" or hybrid.mode != "none", "hybrid.judge",
                 "'teacher' needs a teacher (hybrid.mode 'opd' or 'hybrid')")
        async_rl = self.async_rl
        if async_rl.enabled:
            _require(hybrid.judge == "none", "hybrid.judge",
                     f"{hybrid.judge!r} with async_rl.enabled=true: the async pipeline does not run a judge (a "
                     "model judge decodes through the rollout driver between steps, which async rollouts keep "
                     "busy), so training would go on without verdicts: no hints (hybrid.mode='hybrid' would "
                     "distill on every trajectory) and no PRM reward. Use async_rl.enabled=false, or "
                     "hybrid.judge='none' (docs/async.md)")
            _require(async_rl.max_staleness == 0 or async_rl.old_logprobs == "snapshot"
                     or algo.correction != "none", "algorithm.correction",
                     f"async_rl.max_staleness={async_rl.max_staleness} with old_logprobs={async_rl.old_logprobs!r}: "
                     "the 'old' policy is not the one that sampled the tokens, so the discrepancy old/mu must be "
                     "corrected (set algorithm.correction to 'tis', 'mis' or 'icepop'; or async_rl.old_logprobs='snapshot')")

        self.environment.validate_in(self)

    def _path(self, name: str) -> str:
        return name


SECTION_PATHS.update({
    "ModelConfig": "model", "ScratchModelConfig": "model.scratch",
    "MeshConfig": "mesh",
    "RolloutConfig": "rollout",
    "AlgorithmConfig": "algorithm",
    "CriticConfig": "critic",
    "OptimizerConfig": "optimizer",
    "DataConfig": "data",
    "CheckpointConfig": "checkpoint",
    "LoggingConfig": "logging",
    "EvalConfig": "eval",
    "SFTConfig": "sft",
    "HybridConfig": "hybrid",
    "AsyncConfig": "async_rl",
})
