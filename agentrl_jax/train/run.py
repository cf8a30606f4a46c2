"""``train(config)``: the whole job behind ``launch/tpu_pod.py``.

1. tasks, model assets (a configured HF checkpoint, or a scratch model + tokenizer);
2. the policy on the mesh, the rollout engine and driver, the sandbox pool;
3. optional SFT cold start, then an evaluation of the starting policy;
4. RL steps (``train/rl.py``) with checkpoints, metrics and periodic evaluation;
5. a final evaluation; ``results.json`` and a printed table (start vs end).

Lifecycle (docs/running.md, "Checkpoints and restarts"). Checkpoints are saved every
``checkpoint.every_steps`` steps and on a preemption request; the last step is saved once, after the final evaluation,
with the results in its extra. Resume (``checkpoint.resume`` and a checkpoint in
``output_dir/checkpoints``): the train state, data position, params version and the start
evaluation are restored, SFT is skipped, the metrics of steps after the checkpoint are
dropped, and the frozen models (reference, teacher, judge) are rebuilt from the policy RL
started from: the loaded checkpoint, or the post-SFT policy saved under
``output_dir/init/sft_policy``. Resumed from the final checkpoint, the run only writes
``results.json`` (and the export). Without a checkpoint the run starts over: what an
earlier run left in ``output_dir`` is removed. So a run killed at any point and started
again with the same command ends with the same outputs as one never interrupted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from agentrl_jax.config import Config
from agentrl_jax.envs.base import Environment
from agentrl_jax.models import split_params
from agentrl_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.rewards.verifier import MathVerifier
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.sharding import DEFAULT_RULES, make_mesh
from agentrl_jax.train import multihost, setup
from agentrl_jax.train.checkpoint import Checkpointer, RestoredCheckpoint, restore_pytree, save_pytree
from agentrl_jax.train.hindsight import ArithmeticOracleJudge, ModelJudge
from agentrl_jax.train.metrics import MetricsWriter
from agentrl_jax.train.evaluation import results_table
from agentrl_jax.train.rl import RLTrainer
from agentrl_jax.train.sft import conversation_to_record, run_sft
from agentrl_jax.train.step import init_train_state, make_optimizer

logger = logging.getLogger(__name__)

# make_env(config, sandbox pool, math verifier, tokenizer) -> zero-argument Environment constructor
MakeEnv = Callable[[Config, Any, MathVerifier, Tokenizer], Callable[[], Environment]]
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TABLE_KEYS = ["pass_at_1", "tool_use_rate", "mean_response_tokens"]
# The post-SFT policy, kept for the frozen copies (reference, teacher, judge) of a resumed run.
INITIAL_POLICY_DIR = "init/sft_policy"
# What a run that starts over (no checkpoint to resume from) removes from output_dir.
_RUN_OUTPUTS = ("checkpoints", "metrics", "sft_metrics", "init", "export", "results.json")


def train(config: Config, *, make_env: MakeEnv | None = None) -> dict[str, Any]:
    """Run the configured job; returns the results dict also written to results.json.

    From code that already runs an event loop (a Jupyter/Colab cell), ``await
    train_async(config)`` instead.

    Args:
      config: the experiment.
      make_env: your own environment: ``make_env(config, pool, verifier, tokenizer)`` returns a
        zero-argument constructor of a fresh ``Environment`` (one per trajectory), used instead
        of ``environment.name``'s. Tasks still come from the configured data (``data.*``, or
        the generated arithmetic tasks), and the sandbox pool and math verifier are yours to use.
    """
    return asyncio.run(train_async(config, make_env=make_env))


def attention_implementation(setting: str, compute_dtype: str) -> str | None:
    """``model.attention_impl`` -> the decoder's: "auto" is cuDNN on GPU in bf16, else JAX's choice.

    JAX's own choice (None) keeps the XLA kernel on GPU for the trainer's causal attention,
    2x slower than cuDNN's fused kernel at the 1.7B shape (docs/benchmarks.md). cuDNN's
    fused attention takes only 16-bit inputs, so float32 compute stays on XLA.
    """
    if setting != "auto":
        return setting
    return "cudnn" if jax.default_backend() == "gpu" and compute_dtype == "bfloat16" else None


async def train_async(config: Config, *, make_env: MakeEnv | None = None) -> dict[str, Any]:
    """The coroutine behind :func:`train`."""
    t_start = time.perf_counter()
    out = Path(config.output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    train_tasks, eval_tasks, data_stats = setup.load_task_data(config)
    sft_conversations = None
    if config.sft.steps and config.environment.name == "arithmetic" and not config.data.sft_path:
        sft_conversations = setup.arithmetic_demonstrations(config, train_tasks)
    elif config.sft.steps:
        sft_conversations, data_stats["sft"] = setup.load_sft_conversations(config)
    corpus = [m["content"] for conv in (sft_conversations or []) for m in conv] or [
        t["question"] for t in train_tasks
    ]
    _check_multihost(config)
    resume_step = _resume_step(config, out)
    if jax.process_index() == 0:  # hosts may share output_dir: one writes, the others wait
        if resume_step is None:
            _start_over(out)
        setup.prepare_model_assets(config, corpus)
    multihost.barrier("model assets")
    model_path, tokenizer_path = setup.prepare_model_assets(config, corpus)
    tokenizer = Tokenizer(tokenizer_path)

    mesh, engine_mesh = make_meshes(config)

    def engine_params(p):
        return multihost.local_replica(p, mesh, engine_mesh)

    m = config.model
    policy = load_hf_checkpoint(
        model_path,
        dtype=_DTYPES[m.param_dtype],
        compute_dtype=_DTYPES[m.compute_dtype],
        mesh=mesh,
        rules=DEFAULT_RULES,
        attention_impl=attention_implementation(m.attention_impl, m.compute_dtype),
        remat=m.remat,
    )
    graphdef, params = split_params(policy)
    _check_reference_architecture(config, policy.config)
    r = config.rollout
    engine = Engine(
        policy,
        mesh=engine_mesh,
        max_concurrent_decodes=r.max_concurrent,
        max_target_length=r.max_sequence_length,
        max_prefill_length=r.max_prompt_length,
        cache_dtype=_DTYPES[r.cache_dtype],
        **r.engine_kwargs(),
    )
    # Resuming at step s: the rows a killed run logged after its checkpoint (steps > s) go.
    writer = MetricsWriter(out / "metrics", total_steps=config.total_steps,
                           purge_step=None if resume_step is None else resume_step + 1)
    if resume_step is None:  # a resumed run keeps the first run's step-0 rows
        writer.write(0, setup.data_metrics(data_stats), timed=False)  # rows kept / skipped per split and reason
    checkpointer = Checkpointer(out / "checkpoints", max_to_keep=config.checkpoint.max_to_keep,
                                async_save=config.checkpoint.async_save)
    if threading.current_thread() is threading.main_thread():
        checkpointer.install_sigterm_handler()
    else:
        logger.info("not on the main thread: no SIGTERM handler (preemption saves are off)")
    verifier = MathVerifier(num_workers=2)
    results: dict[str, Any] = {"config": config.name, "seed": config.seed}
    finished = False  # resumed from the final checkpoint: only the outputs are left to write
    async with setup.make_sandbox(config) as pool:
        driver = Driver(
            engine,
            engine_params(params),
            eos_token_ids=tokenizer.eos_token_ids,
            detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            steps_per_dispatch=r.steps_per_dispatch,
            seed=config.seed,
            prefill_token_budget=r.prefill_token_budget or None,
        )
        async with driver:
            if make_env is not None:
                env_factory = make_env(config, pool, verifier, tokenizer)
            else:
                env_factory = setup.env_factory(config, pool, verifier,
                                                count_tokens=lambda s: len(tokenizer.encode(s)))
            trainer = RLTrainer(
                config,
                graphdef=graphdef,
                params=params,
                tokenizer=tokenizer,
                driver=driver,
                env_factory=env_factory,
                train_tasks=train_tasks,
                eval_tasks=eval_tasks,
                metrics_writer=writer,
                checkpointer=checkpointer,
                mesh=mesh,
                engine_params=engine_params,
            )
            restored = await _maybe_resume(config, trainer, checkpointer)
            start_step = 0 if restored is None else restored.step
            if restored is None:
                if sft_conversations:
                    t0 = time.perf_counter()
                    with MetricsWriter(out / "sft_metrics", total_steps=config.sft.steps) as sft_writer:
                        params = _sft(config, graphdef, params, tokenizer, sft_conversations, sft_writer, mesh)
                    results["sft_seconds"] = time.perf_counter() - t0
                    if _uses_initial_policy(config):
                        save_pytree(out / INITIAL_POLICY_DIR, params)
                    trainer.state = init_train_state(params, trainer.optimizer, config.seed)
                    await trainer.driver.update_params(engine_params(params), 0)
                results["start"] = await trainer.evaluate(eval_tasks, label="start (after SFT)" if
                                                          sft_conversations else "start")
                writer.write(0, {f"eval/{k}": v for k, v in results["start"].items()})
            else:
                results.update(json.loads(restored.extra.get("results", "{}")))
                finished = "end" in results and start_step == config.total_steps
                if not finished:
                    results.pop("end", None)  # a finished run's, continued to a larger total_steps
                if sft_conversations and _uses_initial_policy(config) and not finished:
                    params = _restore_initial_policy(out, params)
            # Every checkpoint carries the start evaluation, so a resumed run reports it too.
            trainer.checkpoint_extra = {"results": json.dumps(results)}
            if not finished:
                # The frozen models come from the policy RL started from (`params`: the loaded
                # checkpoint, or the saved post-SFT policy on resume), never the trained state.
                if config.algorithm.kl_coef > 0:
                    trainer.reference_params = _reference_params(config, params, mesh)
                _attach_teacher_and_judge(config, trainer, params, mesh, tokenizer, start_step)
                del params  # the frozen copies are made; the trained policy is trainer.state
                t0 = time.perf_counter()
                await trainer.run(start_step)
                results["rl_seconds"] = time.perf_counter() - t0
            if trainer.preempted:
                logger.warning("stopped by a preemption request after a checkpoint; run the same command to resume")
            elif not finished:
                results["end"] = await trainer.evaluate(eval_tasks, label="end (after RL)")
                writer.write(config.total_steps, {f"eval/{k}": v for k, v in results["end"].items()})
                if start_step < config.total_steps:  # else: the step is on disk already (nothing trained since)
                    trainer.save(config.total_steps, extra={"results": json.dumps(results)})
    checkpointer.wait_until_finished()
    checkpointer.close()
    writer.close()
    verifier.close()
    results["total_seconds"] = time.perf_counter() - t_start
    if trainer.preempted:
        return results
    if config.checkpoint.export_hf and multihost.is_multihost():
        logger.warning("checkpoint.export_hf: not supported on several hosts yet; convert a checkpoint instead")
    elif config.checkpoint.export_hf:
        save_hf_checkpoint(trainer.state.params, policy.config, out / "export")
        tokenizer.hf.save_pretrained(str(out / "export"))
    rows = {k: results[k] for k in ("start", "end") if k in results}
    table = results_table(rows, TABLE_KEYS + [k for k in next(iter(rows.values()), {}) if k.startswith("pass_at_")
                                            and k != "pass_at_1"])
    results["table"] = table
    if jax.process_index() == 0:
        (out / "results.json.tmp").write_text(json.dumps(results, indent=2))
        os.replace(out / "results.json.tmp", out / "results.json")  # whole or absent, whenever a kill comes
        n_eval = int(results.get("end", results.get("start", {})).get("num_tasks", 0))
        print(f"\nheld-out evaluation ({n_eval} tasks, {config.eval.samples_per_task} samples each):")
        print(table)
        print(f"results: {out / 'results.json'}  ({results['total_seconds']:.0f} s)")
    return results


def make_meshes(config: Config) -> tuple[Mesh, Mesh]:
    """(training mesh, rollout-engine mesh).

    One host: the same mesh (colocated), or with ``async_rl.placement='disaggregated'`` the
    first ``rollout_devices`` devices (default half) for the engine (slots over ``data``,
    ``mesh.tensor``-way tensor parallel when it divides them) and the rest for training
    (``mesh.*``). Several hosts: rollouts are host-local (multihost.py), so the engine gets
    this host's devices.
    """
    a = config.async_rl
    if a.enabled and a.placement == "disaggregated":
        from agentrl_jax.config import ConfigError

        devices = jax.devices()
        n = a.rollout_devices or len(devices) // 2
        if not 1 <= n < len(devices):
            raise ConfigError(f"async_rl.rollout_devices: {n} rollout devices out of {len(devices)} leaves "
                              "none for one side; disaggregated placement needs >= 2 devices")
        tensor = config.mesh.tensor if config.mesh.tensor > 0 and n % config.mesh.tensor == 0 else 1
        train_mesh = make_mesh(config.mesh.shape(), devices=devices[n:])
        engine_mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": tensor}, devices=devices[:n])
        logger.info("disaggregated placement: %d rollout device(s), %d training device(s)", n, len(devices) - n)
        return train_mesh, engine_mesh
    mesh = make_mesh(config.mesh.shape())
    return mesh, (multihost.local_mesh(config.mesh.tensor) if multihost.is_multihost() else mesh)


def _check_multihost(config: Config) -> None:
    """What several hosts do not support yet fails before anything starts."""
    if not multihost.is_multihost():
        return
    from agentrl_jax.config import ConfigError

    n = jax.process_count()
    if config.data.prompts_per_step % n:
        raise ConfigError(f"data.prompts_per_step ({config.data.prompts_per_step}) must be divisible by the "
                          f"number of hosts ({n}): each host rolls out its share")
    if config.hybrid.mode != "none" or config.hybrid.judge != "none":
        raise ConfigError("hybrid.mode / hybrid.judge: not supported on several hosts yet")
    if config.algorithm.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling: not supported on several hosts yet")
    if config.async_rl.enabled:
        raise ConfigError("async_rl.enabled: not supported on several hosts yet (every host would need to "
                          "agree on which batch trains when)")


def _sft(config, graphdef, params, tokenizer, conversations, writer, mesh):
    records = [conversation_to_record(tokenizer, conv) for conv in conversations]
    too_long = [r for r in records if len(r.token_ids) > config.sft.max_length]
    if too_long:
        logger.warning("SFT: %d of %d conversations exceed sft.max_length=%d tokens and are skipped",
                       len(too_long), len(records), config.sft.max_length)
        records = [r for r in records if len(r.token_ids) <= config.sft.max_length]
    optimizer, _ = make_optimizer(config.optimizer, config.sft.steps, learning_rate=config.sft.learning_rate)
    state = init_train_state(params, optimizer, config.seed)
    state, history = run_sft(
        state,
        graphdef=graphdef,
        optimizer=optimizer,
        records=records,
        steps=config.sft.steps,
        batch_size=config.sft.batch_size,
        row_length=config.sft.max_length,
        seed=config.seed,
        metrics_writer=writer,
        mesh=mesh,
    )
    if history:
        logger.info("SFT: %d steps, loss %.4f -> %.4f", len(history), history[0]["sft/loss"], history[-1]["sft/loss"])
    return state.params


def _frozen_copy(params, dtype: str):
    """A frozen copy of ``params`` in ``dtype`` that owns its buffers.

    ``astype`` to the same dtype returns the very same arrays, which the donating update
    step would then delete under the frozen model; those leaves are copied instead.
    """
    target = _DTYPES[dtype]
    return jax.tree.map(lambda x: x.astype(target) if x.dtype != target else jnp.copy(x), params)


def _uses_initial_policy(config: Config) -> bool:
    """Whether a frozen copy of the starting policy serves as reference, teacher or judge."""
    h = config.hybrid
    return ((config.algorithm.kl_coef > 0 and not config.model.reference_path)
            or (h.mode != "none" and h.teacher == "reference") or h.judge == "reference")


def _reference_params(config: Config, initial_params, mesh):
    """The frozen reference: ``model.reference_path`` if set, else a copy of the starting policy."""
    m = config.model
    if not m.reference_path:
        return _frozen_copy(initial_params, m.reference_dtype)
    reference = load_hf_checkpoint(m.reference_path, dtype=_DTYPES[m.reference_dtype],
                                   compute_dtype=_DTYPES[m.compute_dtype], mesh=mesh, rules=DEFAULT_RULES,
                                   attention_impl=attention_implementation(m.attention_impl, m.compute_dtype))
    graphdef, params = split_params(reference)
    if jax.tree.structure(params) != jax.tree.structure(initial_params):
        from agentrl_jax.config import ConfigError

        raise ConfigError(f"model.reference_path: {m.reference_path!r} has a different architecture than the policy")
    return params


# The fields that fix the param tree's structure and shapes.
_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm")


def _check_reference_architecture(config: Config, policy_config) -> None:
    """``model.reference_path`` must fit the policy; checked from its config.json before SFT, not after it."""
    if not config.model.reference_path:
        return
    from agentrl_jax.config import ConfigError
    from agentrl_jax.models import DecoderConfig

    try:
        reference = DecoderConfig.from_hf(config.model.reference_path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.reference_path: cannot read the checkpoint's config.json: {e}") from e
    diff = {f: (getattr(reference, f), getattr(policy_config, f)) for f in _SHAPE_FIELDS
            if getattr(reference, f) != getattr(policy_config, f)}
    if diff:
        details = ", ".join(f"{f}: {r!r} vs the policy's {p!r}" for f, (r, p) in diff.items())
        raise ConfigError(f"model.reference_path: {config.model.reference_path!r} has a different architecture "
                          f"than the policy ({details})")


def _attach_teacher_and_judge(config: Config, trainer: RLTrainer, initial_params, mesh, tokenizer: Tokenizer,
                              start_step: int) -> None:
    """The teacher (frozen starting policy or an HF checkpoint) and the PRM judge of ``config.hybrid``."""
    h, m = config.hybrid, config.model
    copies = {} if trainer.reference_params is None else {m.reference_dtype: trainer.reference_params}
    # "reference" is the run's frozen reference: model.reference_path when set (config validation
    # guarantees it is loaded then), else the starting policy, in the dtype each role asks for.
    source = trainer.reference_params if m.reference_path else initial_params

    def frozen(dtype: str):
        """The frozen reference in ``dtype``: one copy per dtype, shared by reference, teacher, judge."""
        if dtype not in copies:
            copies[dtype] = _frozen_copy(source, dtype)
        return copies[dtype]
    if h.mode != "none":
        if h.teacher == "checkpoint":
            teacher = load_hf_checkpoint(h.teacher_path, dtype=_DTYPES[h.teacher_dtype],
                                         compute_dtype=_DTYPES[m.compute_dtype], mesh=mesh, rules=DEFAULT_RULES,
                                         attention_impl=attention_implementation(m.attention_impl, m.compute_dtype),
                                         remat="none")
            trainer.teacher = split_params(teacher)
        else:
            trainer.teacher = (trainer.graphdef, frozen(h.teacher_dtype))
    if h.judge == "none":
        return
    if h.judge == "oracle":
        trainer.judge = ArithmeticOracleJudge(lambda s: len(tokenizer.encode(s)), max_hint_tokens=h.max_hint_tokens)
        return
    params = None
    if h.judge == "reference":
        params = frozen(m.reference_dtype)
    elif h.judge == "teacher":
        params = trainer.teacher[1]
    trainer.judge = ModelJudge(
        trainer.driver, tokenizer, template=h.judge_template, max_new_tokens=h.judge_max_new_tokens,
        temperature=h.judge_temperature, max_hint_tokens=h.max_hint_tokens, params=params,
        restore=lambda: (trainer.state.params, trainer.version), seed=config.seed,
    )
    trainer.judge.calls = start_step  # one call per step: a resumed run draws the seeds it would have


def _restore_initial_policy(out: Path, target):
    """The post-SFT policy the run saved before RL, for the frozen copies of a resumed run."""
    path = out / INITIAL_POLICY_DIR
    if not path.is_dir():
        from agentrl_jax.config import ConfigError

        raise ConfigError(f"checkpoint.resume: the reference / teacher is the post-SFT policy, but {path} is missing "
                          "(the run was started without a frozen copy, or by an older version); resuming would "
                          "anchor to the trained policy instead. Set checkpoint.resume=false to start over")
    return restore_pytree(path, target)


def _resume_step(config: Config, out: Path) -> int | None:
    """The step a run resumes from: the newest checkpoint with ``checkpoint.resume``, else None."""
    if not config.checkpoint.resume:
        return None
    with Checkpointer(out / "checkpoints") as checkpointer:
        step = checkpointer.latest_step()
    if step is not None and step > config.total_steps:
        from agentrl_jax.config import ConfigError

        raise ConfigError(f"total_steps: {config.total_steps} is below the step of the checkpoint to resume "
                          f"({step} in {out / 'checkpoints'}); raise it or set checkpoint.resume=false")
    return step


def _start_over(out: Path) -> None:
    """Removes what an earlier run left in ``out`` (a run killed before its first checkpoint, or
    ``checkpoint.resume=false``), so the outputs are this run's alone."""
    for name in _RUN_OUTPUTS:
        path = out / name
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # made by the resume check itself
            continue
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        logger.warning("starting over: removed %s of an earlier run (resume with checkpoint.resume=true)", path)


async def _maybe_resume(config: Config, trainer: RLTrainer, checkpointer: Checkpointer) -> RestoredCheckpoint | None:
    """Restores the newest checkpoint into ``trainer`` (with ``checkpoint.resume``); None on a fresh run."""
    if not config.checkpoint.resume:
        return None
    restored = checkpointer.restore_latest(trainer.state)
    if restored is None:
        return None
    trainer.state = restored.state
    if restored.data_state:
        trainer.data.set_state(restored.data_state)
    trainer.version = int((restored.extra or {}).get("version", restored.step))
    await trainer.driver.update_params(trainer.engine_params(trainer.state.params), trainer.version)
    logger.info("resumed from step %d (params version %d)", restored.step, trainer.version)
    return restored
