"""Builds what the RL loop uses, once, before the first step: the models by role, the jitted
step functions (``StepFunctions``) and ``RL``.

The frozen models (reference, teacher, judge) come from the policy RL starts from (the
loaded checkpoint, or the post-SFT policy), never from the trained state: a resumed run
rebuilds them from the same starting policy (``train/run.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.losses.registry import loss_hparams, needs_critic
from agentrl_jax.models import split_params
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models.lora import LoraParams
from agentrl_jax.sharding import DEFAULT_RULES
from agentrl_jax.train.critic import build_critic
from agentrl_jax.train.episodes import truncation_rule
from agentrl_jax.train.guidance.hindsight import ArithmeticOracleJudge, ModelJudge
from agentrl_jax.train.guidance.program_oracle import ProgramOracleJudge
from agentrl_jax.train.guidance.old_policy import OldPolicy
from agentrl_jax.train.guidance.teacher import Teacher
from agentrl_jax.train.multihost import put_replicated
from agentrl_jax.train.packing import MAX_SEGMENTS
from agentrl_jax.train.rl.roles import RL, Roles, StepFunctions
from agentrl_jax.train.setup import checkpoint_directory
from agentrl_jax.train.step import LossSettings, TrainState, make_logprob_fn, make_optimizer, make_update_fn

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The fields that fix the param tree's structure and shapes.
_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm")


def attention_implementation(setting: str, compute_dtype: str, backend: str | None = None) -> str | None:
    """``model.attention_impl`` -> the decoder's: "auto" is cuDNN on GPU in bf16, the splash
    kernel on TPU, else JAX's choice.

    JAX's own choice (None) keeps the XLA kernel on GPU for the trainer's causal attention,
    slower than cuDNN's fused kernel (docs/benchmarks.md, "Train step"). cuDNN's
    fused attention takes only 16-bit inputs, so float32 compute stays on XLA. On TPU JAX's
    choice is XLA with a ``[B, 1, T, T]`` mask for packed rows; the splash kernel
    (``models.splash``) takes segment ids instead.

    Args:
      backend: the JAX backend (default ``jax.default_backend()``).

    Raises:
      ConfigError: "splash" off TPU (the kernel would run in Pallas interpret mode).
    """
    backend = jax.default_backend() if backend is None else backend
    if setting == "splash" and backend != "tpu":
        raise ConfigError(f"model.attention_impl: 'splash' is a TPU kernel and the JAX backend is {backend!r} "
                          "(it would run in Pallas interpret mode, far too slow to train); use 'auto' or 'xla'")
    if setting != "auto":
        return setting
    if backend == "tpu":
        return "splash"
    return "cudnn" if backend == "gpu" and compute_dtype == "bfloat16" else None


def build_rl(config: Config, *, roles: Roles, state: TrainState, tokenizer, driver, env_factory,
             train_tasks: list[dict], eval_tasks: list[dict], writer, checkpointer=None, mesh=None,
             engine_params=None, data_state: Any = None) -> RL:
    """Everything the RL loop uses, from the config and the run's components.

    ``state``: the policy's train state (the update keeps its shardings). ``data_state``: the
    prompt iterator's position to start from (a resumed run's).
    """
    from agentrl_jax.data import BatchIterator

    optimizer, schedule = make_optimizer(config.optimizer, config.total_steps)
    # data.prompts_per_step is global; each host draws its share of every global batch.
    data = BatchIterator(train_tasks, batch_size=config.data.prompts_per_step // jax.process_count(),
                         seed=config.data.shuffle_seed, shard_index=jax.process_index(),
                         shard_count=jax.process_count())
    if data_state:
        data.set_state(data_state)
    async_rl = config.async_rl
    return RL(
        config=config, roles=roles, tokenizer=tokenizer, driver=driver,
        agent_loop=AgentLoop(driver, tokenizer, max_new_tokens_per_turn=config.rollout.max_new_tokens_per_turn,
                             max_total_tokens=config.rollout.max_sequence_length,
                             truncation=truncation_rule(config)),
        env_factory=env_factory, data=data, eval_tasks=eval_tasks, writer=writer, checkpointer=checkpointer,
        engine_params=engine_params or (lambda params: params), schedule=schedule,
        old_policy=OldPolicy(async_rl, async_rl.max_staleness if async_rl.enabled else 0),
        steps=build_step_functions(config, roles.policy, optimizer, state, mesh, tokenizer.pad_token_id),
    )


def build_step_functions(config: Config, graphdef, optimizer, state: TrainState, mesh,
                         pad_token_id: int) -> StepFunctions:
    """The jitted functions of the RL step (``train/step.py``), built once: the logprob forward
    of every model and the policy's minibatch update (its state keeps ``state``'s shardings)."""
    settings = loss_settings(config)
    put = functools.partial(put_replicated, mesh=mesh)
    algorithm = config.algorithm
    return StepFunctions(
        logprobs=make_logprob_fn(settings, put=put, pad_token_id=pad_token_id, row_tokens=algorithm.pack_row_tokens,
                                 micro_batch_tokens=algorithm.micro_batch_tokens, mesh=mesh),
        update=make_update_fn(graphdef, optimizer, settings, mesh=mesh, pad_token_id=pad_token_id,
                              state_sharding=None if mesh is None else jax.tree.map(lambda x: x.sharding, state)),
        put=put,
    )


def loss_settings(config: Config) -> LossSettings:
    """The static objective of the update, from the algorithm config.

    The loss's hyper-parameters are the ones it declared at registration, read from the
    config, plus ``algorithm.loss_hparams`` (``losses.registry.loss_hparams``).
    """
    algorithm = config.algorithm
    correction_hparams: dict[str, Any] = {}
    if algorithm.correction in ("tis", "mis"):
        correction_hparams = {"cap": algorithm.correction_cap, "level": algorithm.correction_level}
    elif algorithm.correction == "icepop":
        correction_hparams = {"low": algorithm.correction_floor, "high": algorithm.correction_cap,
                              "level": algorithm.correction_level}
    return LossSettings(
        loss=algorithm.loss,
        hparams=tuple(sorted(loss_hparams(algorithm.loss, config).items())),
        aggregation=algorithm.aggregation,
        temperature=config.rollout.temperature,
        kl_coef=algorithm.kl_coef,
        kl_kind=algorithm.kl_estimator,
        entropy_coef=algorithm.entropy_coef,
        correction=algorithm.correction,
        correction_hparams=tuple(sorted(correction_hparams.items())),
        packed=algorithm.pack_rows,
        max_segments=MAX_SEGMENTS if algorithm.pack_rows else 0,
        chunk_size=algorithm.logprob_chunk_tokens,
    )


def build_roles(config: Config, graphdef, initial_params, mesh, *, tokenizer, driver, start_step: int,
                policy_params=None) -> Roles:
    """The policy (``graphdef``) and the frozen models ``config`` asks for, from ``initial_params``.

    Reference: ``model.reference_path`` if set, else a copy of the starting policy (with LoRA the
    policy's own frozen base, ``policy_params.base``, not a copy). Teacher:
    the frozen reference, an HF checkpoint, the current policy or a lagged copy of it
    (``hybrid.teacher``, ``guidance.teacher.Teacher``; a lagged teacher starts at
    ``policy_params``, the params RL continues from, default ``initial_params``). Judge: the oracle, or a
    model judge decoding with the reference / teacher / current policy (``hybrid.judge``). Critic (an
    estimator that needs one): a value model whose trunk starts at ``initial_params`` or ``critic.path``
    (a resumed run then restores its train state from the checkpoint).
    """
    h, m = config.hybrid, config.model
    # LoRA: the base with the adapters off is the starting policy; it is frozen already, so it serves
    # as reference, teacher and judge as it is, in its own dtype (no copy).
    lora_base = policy_params.base if isinstance(policy_params, LoraParams) and not m.reference_path else None
    if lora_base is not None:
        reference = lora_base if config.algorithm.kl_coef > 0 else None
    else:
        reference = reference_params(config, initial_params, mesh) if config.algorithm.kl_coef > 0 else None
    copies = {} if reference is None else {m.reference_dtype: reference}
    # "reference" is the run's frozen reference: model.reference_path when set (config validation
    # guarantees it is loaded then), else the starting policy, in the dtype each role asks for.
    source = reference if m.reference_path else initial_params

    def frozen(dtype: str):
        """The frozen reference in ``dtype``: one copy per dtype, shared by reference, teacher, judge."""
        if lora_base is not None:
            return lora_base
        if dtype not in copies:
            copies[dtype] = frozen_copy(source, dtype)
        return copies[dtype]

    teacher = None
    if h.mode != "none" and h.teacher == "checkpoint":
        teacher_graphdef, teacher_params = split_params(load_hf_checkpoint(
            checkpoint_directory("hybrid.teacher_path", h.teacher_path), dtype=DTYPES[h.teacher_dtype],
            compute_dtype=DTYPES[m.compute_dtype], mesh=mesh,
            rules=DEFAULT_RULES, attention_impl=attention_implementation(m.attention_impl, m.compute_dtype),
            remat="none", lm_head_dtype=m.lm_head_dtype))
        teacher = Teacher(teacher_graphdef, "checkpoint", frozen=teacher_params)
    elif h.mode != "none" and h.teacher == "reference":
        teacher = Teacher(graphdef, "reference", frozen=frozen(h.teacher_dtype))
    elif h.mode != "none":  # the policy itself, or a lagged copy of it starting at the starting policy
        start = initial_params if policy_params is None else policy_params
        teacher = Teacher(graphdef, h.teacher, initial=start if h.teacher == "lagged" else None,
                          lag_steps=h.teacher_lag_steps, ema_decay=h.teacher_ema_decay)
    critic = None
    if needs_critic(config.algorithm.advantage):
        critic = build_critic(config, graphdef, initial_params, loss_settings(config), mesh=mesh,
                              pad_token_id=tokenizer.pad_token_id, put=functools.partial(put_replicated, mesh=mesh),
                              load_trunk=lambda path: _load_params(config, "critic.path", path, m.param_dtype, mesh))
    judge = None
    if h.judge == "oracle":  # config validation allows it for these two environments only
        oracle = ProgramOracleJudge if config.environment.name == "retool_small" else ArithmeticOracleJudge
        judge = oracle(lambda s: len(tokenizer.encode(s)), max_hint_tokens=h.max_hint_tokens)
    elif h.judge != "none":
        params = {"reference": lambda: frozen(m.reference_dtype), "teacher": lambda: teacher.params}.get(
            h.judge, lambda: None)()
        # one call per step: a resumed run draws the seeds it would have
        judge = ModelJudge(driver, tokenizer, template=h.judge_template, max_new_tokens=h.judge_max_new_tokens,
                           temperature=h.judge_temperature, max_hint_tokens=h.max_hint_tokens, params=params,
                           seed=config.seed, calls=start_step)
    return Roles(policy=graphdef, reference=reference, teacher=teacher, judge=judge, critic=critic)


def reference_params(config: Config, initial_params, mesh):
    """The frozen reference: ``model.reference_path`` if set, else a copy of the starting policy."""
    m = config.model
    if not m.reference_path:
        return frozen_copy(initial_params, m.reference_dtype)
    params = _load_params(config, "model.reference_path", m.reference_path, m.reference_dtype, mesh)
    if jax.tree.structure(params) != jax.tree.structure(initial_params):
        raise ConfigError(f"model.reference_path: {m.reference_path!r} has a different architecture than the policy")
    return params


def _load_params(config: Config, key: str, path: str, dtype: str, mesh):
    """The params of the HF checkpoint at ``path`` (the config field ``key``), in ``dtype`` on ``mesh``."""
    m = config.model
    model = load_hf_checkpoint(checkpoint_directory(key, path), dtype=DTYPES[dtype],
                               compute_dtype=DTYPES[m.compute_dtype], mesh=mesh, rules=DEFAULT_RULES,
                               attention_impl=attention_implementation(m.attention_impl, m.compute_dtype))
    return split_params(model)[1]


def check_reference_architecture(config: Config, policy_config) -> None:
    """``model.reference_path`` must fit the policy; checked from its config.json before SFT, not after it."""
    if not config.model.reference_path:
        return
    from agentrl_jax.models import DecoderConfig

    directory = checkpoint_directory("model.reference_path", config.model.reference_path)
    try:
        reference = DecoderConfig.from_hf(directory)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.reference_path: cannot read the checkpoint's config.json: {e}") from e
    diff = {f: (getattr(reference, f), getattr(policy_config, f)) for f in _SHAPE_FIELDS
            if getattr(reference, f) != getattr(policy_config, f)}
    if diff:
        details = ", ".join(f"{f}: {r!r} vs the policy's {p!r}" for f, (r, p) in diff.items())
        raise ConfigError(f"model.reference_path: {config.model.reference_path!r} has a different architecture "
                          f"than the policy ({details})")


def frozen_copy(params, dtype: str):
    """A frozen copy of ``params`` in ``dtype`` that owns its buffers.

    ``astype`` to the same dtype returns the very same arrays, which the donating update
    step would then delete under the frozen model; those leaves are copied instead.
    """
    target = DTYPES[dtype]
    return jax.tree.map(lambda x: x.astype(target) if x.dtype != target else jnp.copy(x), params)


def uses_initial_policy(config: Config) -> bool:
    """Whether a frozen copy of the starting policy serves as reference, teacher or judge."""
    h = config.hybrid
    return ((config.algorithm.kl_coef > 0 and not config.model.reference_path)
            or (h.mode != "none" and h.teacher == "reference") or h.judge == "reference"
            or config.model.lora.rank > 0)  # the LoRA base: a resumed run needs the post-SFT one
