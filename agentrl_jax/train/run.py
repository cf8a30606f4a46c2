"""``train(config)``: the whole job behind ``launch/tpu_pod.py``.

1. the meshes (first: a mesh the devices cannot take is reported before anything is read),
   tasks, model assets (a configured HF checkpoint, or a scratch model + tokenizer);
2. the policy on the mesh, the rollout engine and driver, the sandbox pool;
3. optional SFT cold start, then an evaluation of the starting policy;
4. the roles (``train/build.py``), then the RL loop (``train/rl/loop.py``);
5. a final evaluation; ``results.json`` and a printed table (start vs end).

Lifecycle (docs/running.md, "Checkpoints and restarts"). Checkpoints are saved every
``checkpoint.every_steps`` steps, on a preemption request, and at the last step once, after the
final evaluation, with the results. Resume (``checkpoint.resume`` and a checkpoint in
``output_dir/checkpoints``) restores the train state, data position, params version and start
evaluation, skips SFT, drops the metrics of steps after the checkpoint, and rebuilds the frozen
models (reference, teacher, judge) from the policy RL started from: the loaded checkpoint, or the
post-SFT policy under ``output_dir/init/sft_policy``. Resumed from the final checkpoint, the run
only writes ``results.json`` (and the export). Without a checkpoint the run starts over (what an
earlier run left in ``output_dir`` is removed). So a run killed at any point and started again
with the same command ends with the same outputs as one never interrupted.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from jax.sharding import Mesh

from agentrl_jax.config import Config, ConfigError
from agentrl_jax.envs.base import Environment
from agentrl_jax.models import split_params
from agentrl_jax.models.hf_io import load_hf_checkpoint
from agentrl_jax.models.tokenizer import Tokenizer
from agentrl_jax.rewards.verifier import MathVerifier
from agentrl_jax.rollout.driver import Driver
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.engine_config import EngineConfig
from agentrl_jax.sharding import DEFAULT_RULES, make_mesh
from agentrl_jax.train import lora, multi_policy, multihost, setup
from agentrl_jax.train.build import (
    DTYPES,
    attention_implementation,
    build_rl,
    build_roles,
    check_reference_architecture,
    uses_initial_policy,
)
from agentrl_jax.train.checkpoint import (
    Checkpointer,
    RestoredCheckpoint,
    restore_pytree,
    save_pytree,
)
from agentrl_jax.train.evaluation import results_table
from agentrl_jax.train.metrics import MetricsWriter
from agentrl_jax.train.rl import LoopResult, Roles, run_rl
from agentrl_jax.train.rl.collect import evaluate
from agentrl_jax.train.rl.stages import save
from agentrl_jax.train.sft import conversation_to_record, run_sft
from agentrl_jax.train.step import init_train_state, make_optimizer

logger = logging.getLogger(__name__)

# make_env(config, sandbox pool, math verifier, tokenizer) -> zero-argument Environment constructor
MakeEnv = Callable[[Config, Any, MathVerifier, Tokenizer], Callable[[], Environment]]
TABLE_KEYS = ["pass_at_1", "tool_use_rate", "calls_per_episode", "mean_response_tokens"]
ERROR_KEYS = ["tool_error_rate", "error_recovery_rate"]  # in the table when the evaluation has them
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
    if config.multi_policy.enabled:  # several policies in one episode (docs/multi_policy.md)
        return multi_policy.train_multi(config, make_env=make_env)
    return asyncio.run(train_async(config, make_env=make_env))


async def train_async(config: Config, *, make_env: MakeEnv | None = None) -> dict[str, Any]:
    """The coroutine behind :func:`train`: wiring, the starting policy, RL, the outputs."""
    t_start = time.perf_counter()
    # What only the devices tell (several hosts' limits, the mesh) first: before data and model assets.
    multihost.check_supported(config)
    mesh, engine_mesh = make_meshes(config)
    out = Path(config.output_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    train_tasks, eval_tasks, data_stats = setup.load_task_data(config)
    sft_conversations = None
    if config.sft.steps and not config.data.sft_path:  # the environment's own demonstrations, if it writes any
        sft_conversations = config.environment.make_demonstrations(config, train_tasks)
    if config.sft.steps and sft_conversations is None:
        sft_conversations, data_stats["sft"] = setup.load_sft_conversations(config)
    # Native-layout demonstrations carry their calls as tool_calls (rendered by the template).
    corpus = [m["content"] or json.dumps(m.get("tool_calls") or "") for conv in (sft_conversations or [])
              for m in conv] or [t["question"] for t in train_tasks]
    resume_step = _resume_step(config, out)
    if jax.process_index() == 0:  # hosts may share output_dir: one writes, the others wait
        if resume_step is None:
            _start_over(out)
        setup.prepare_model_assets(config, corpus)
    multihost.barrier("model assets")
    model_path, tokenizer_path = setup.prepare_model_assets(config, corpus)
    tokenizer = Tokenizer(tokenizer_path, chat_template_kwargs=config.model.chat_template_kwargs)
    policy = _load_policy(config, model_path, mesh)
    check_reference_architecture(config, policy.config)
    # Resuming at step s: the rows a killed run logged after its checkpoint (steps > s) go.
    host = jax.process_index()
    # starting over: host 0's folder went in _start_over, the others clear their own
    purge = resume_step + 1 if resume_step is not None else (None if host == 0 else 0)
    writer = MetricsWriter(out / ("metrics" if host == 0 else f"metrics_host{host}"), total_steps=config.total_steps,
                           enabled=host == 0 or config.logging.every_host, purge_step=purge)
    if resume_step is None:  # a resumed run keeps the first run's step-0 rows
        writer.write(0, setup.data_metrics(data_stats), timed=False)  # rows kept / skipped per split and reason
    checkpointer = Checkpointer(out / "checkpoints", max_to_keep=config.checkpoint.max_to_keep,
                                async_save=config.checkpoint.async_save)
    if threading.current_thread() is threading.main_thread():
        checkpointer.install_sigterm_handler()
    else:
        logger.info("not on the main thread: no SIGTERM handler (preemption saves are off)")
    v = config.environment.verifier
    job = _Job(config, out, policy, mesh, engine_mesh, tokenizer, writer, checkpointer, sft_conversations)
    with MathVerifier(num_workers=v.workers, timeout_s=v.timeout_s, memory_mb=v.memory_mb) as verifier:
        async with setup.make_sandbox(config) as pool:
            env_factory = (make_env(config, pool, verifier, tokenizer) if make_env is not None else
                           setup.env_factory(config, pool, verifier,
                                             count_tokens=lambda s: len(tokenizer.encode(s))))
            results, final = await job.run(env_factory, train_tasks, eval_tasks)
    checkpointer.wait_until_finished()
    checkpointer.close()
    writer.close()
    results["total_seconds"] = time.perf_counter() - t_start
    if not final.preempted:
        _write_outputs(config, out, results, final.state.params, policy.config, tokenizer)
    return results


def _load_policy(config: Config, model_path: str, mesh: Mesh):
    m = config.model
    return load_hf_checkpoint(model_path, dtype=DTYPES[m.param_dtype], compute_dtype=DTYPES[m.compute_dtype],
                              mesh=mesh, rules=DEFAULT_RULES,
                              attention_impl=attention_implementation(m.attention_impl, m.compute_dtype),
                              remat=m.remat, lm_head_dtype=m.lm_head_dtype)


class _Job:
    """The RL job on built components: the starting policy (resumed, or after SFT), the start
    evaluation, the RL loop, the final evaluation and checkpoint."""

    def __init__(self, config, out, policy, mesh, engine_mesh, tokenizer, writer, checkpointer, sft_conversations):
        self.config, self.out, self.mesh, self.tokenizer = config, out, mesh, tokenizer
        self.writer, self.checkpointer, self.sft_conversations = writer, checkpointer, sft_conversations
        self.tools = None  # the environment's tool schemas, for SFT prompts (set by run)
        self.graphdef, self.params = split_params(policy)
        self.model_config = policy.config
        self.engine = Engine(policy, EngineConfig.from_rollout(config.rollout), mesh=engine_mesh)
        self.engine_mesh = engine_mesh
        self.engine_params = lambda p: multihost.local_replica(p, mesh, engine_mesh)

    async def run(self, env_factory, train_tasks, eval_tasks) -> tuple[dict[str, Any], LoopResult]:
        c, r = self.config, self.config.rollout
        driver = Driver(self.engine, self.engine_params(self.params), eos_token_ids=self.tokenizer.eos_token_ids,
                        detokenize=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                        tokenize=self.tokenizer.encode, steps_per_dispatch=r.steps_per_dispatch, seed=c.seed,
                        prefill_token_budget=r.prefill_token_budget or None, prefix_cache=r.prefix_cache)
        async with driver:
            results: dict[str, Any] = {"config": c.name, "seed": c.seed}
            # SFT prompts list the tools the environment's prompts list (native layout).
            self.tools = getattr(env_factory(), "tools", None) if self.sft_conversations else None
            start = await self._starting_policy(driver, results)
            finished = start.restored is not None and "end" in results and start.step == c.total_steps
            if start.restored is not None and not finished:
                results.pop("end", None)  # a finished run's, continued to a larger total_steps
            # The frozen models come from the policy RL started from (the loaded checkpoint, or the
            # post-SFT policy), never the trained state; a finished run needs none of them.
            roles = Roles(self.graphdef) if finished else build_roles(
                c, self.graphdef, start.initial_params, self.mesh, tokenizer=self.tokenizer, driver=driver,
                start_step=start.step, policy_params=start.state.params)
            if start.restored is not None and roles.teacher is not None:
                roles.teacher.restore(self.checkpointer, start.step)  # a lagged teacher's snapshot / EMA
            if start.restored is not None and roles.critic is not None:
                roles.critic.restore(self.checkpointer, start.step)  # params and optimizer state
            if not finished and (warm := await setup.warm_up_rollout(c, driver, self.engine_mesh)) is not None:
                results["rollout_warmup"] = warm
            del self.params, start.initial_params  # the frozen copies are made; the trained policy is the state
            rl = build_rl(c, roles=roles, state=start.state, tokenizer=self.tokenizer, driver=driver,
                          env_factory=env_factory, train_tasks=train_tasks, eval_tasks=eval_tasks, writer=self.writer,
                          checkpointer=self.checkpointer, mesh=self.mesh, engine_params=self.engine_params,
                          data_state=start.data_state)
            if start.restored is None:
                results["start"] = await evaluate(c.eval, rl.agent_loop, env_factory, eval_tasks,
                                                  label="start (after SFT)" if self.sft_conversations else "start")
                self.writer.write(0, {f"eval/{k}": v for k, v in results["start"].items()})
            final = LoopResult(start.state, start.version, False)
            if not finished:
                t0 = time.perf_counter()
                # Every checkpoint carries the start evaluation, so a resumed run reports it too.
                final = await run_rl(rl, start.state, start.version, start.step,
                                     checkpoint_extra={"results": json.dumps(results)})
                results["rl_seconds"] = time.perf_counter() - t0
            if final.preempted:
                logger.warning("stopped by a preemption request after a checkpoint; run the same command to resume")
            elif not finished:
                results["end"] = await evaluate(c.eval, rl.agent_loop, env_factory, eval_tasks, label="end (after RL)")
                self.writer.write(c.total_steps, {f"eval/{k}": v for k, v in results["end"].items()})
                if start.step < c.total_steps:  # else: the step is on disk already (nothing trained since)
                    save(self.checkpointer, c, roles, final.state, final.version, c.total_steps,
                         data_state=rl.data.get_state(), extra={"results": json.dumps(results)})
                if c.logging.every_host:  # the hosts' copies of the trained weights, to compare
                    multihost.write_params_digest(self.out, self.engine_params(final.state.params), c.total_steps)
        return results, final

    async def _starting_policy(self, driver, results: dict[str, Any]) -> _Start:
        """The policy RL starts from: the newest checkpoint (``checkpoint.resume``), else the loaded
        model after the optional SFT cold start (pushed to the engine as version 0)."""
        c = self.config
        optimizer, _ = make_optimizer(c.optimizer, c.total_steps)
        resumes = c.checkpoint.resume and self.checkpointer.latest_step() is not None
        if resumes and self.sft_conversations and c.model.lora.rank:
            self.params = _restore_initial_policy(self.out, self.params)  # the LoRA base is the post-SFT policy
        state = init_train_state(lora.policy_params(c, self.params, self.model_config, self.mesh), optimizer, c.seed)
        restored = lora.restore_latest(self.checkpointer, state) if c.checkpoint.resume else None
        if restored is not None:
            version = int((restored.extra or {}).get("version", restored.step))
            await driver.update_params(self.engine_params(restored.state.params), version)
            logger.info("resumed from step %d (params version %d)", restored.step, version)
            results.update(json.loads(restored.extra.get("results", "{}")))
            initial = self.params
            if self.sft_conversations and uses_initial_policy(c) and not c.model.lora.rank and not (
                    "end" in results and restored.step == c.total_steps):
                initial = _restore_initial_policy(self.out, self.params)
            return _Start(restored, restored.state, version, restored.step, initial, restored.data_state)
        if self.sft_conversations:
            t0 = time.perf_counter()
            with MetricsWriter(self.out / "sft_metrics", total_steps=c.sft.steps) as sft_writer:
                self.params = _sft(c, self.graphdef, self.params, self.tokenizer, self.sft_conversations,
                                   sft_writer, self.mesh, tools=self.tools)
            results["sft_seconds"] = time.perf_counter() - t0
            if uses_initial_policy(c):
                save_pytree(self.out / INITIAL_POLICY_DIR, self.params)
            state = init_train_state(lora.policy_params(c, self.params, self.model_config, self.mesh), optimizer,
                                     c.seed)
            await driver.update_params(self.engine_params(state.params), 0)
        return _Start(None, state, 0, 0, self.params, None)


@dataclasses.dataclass
class _Start:
    restored: RestoredCheckpoint | None
    state: Any
    version: int
    step: int
    initial_params: Any
    data_state: Any


def _write_outputs(config: Config, out: Path, results: dict[str, Any], params, model_config, tokenizer) -> None:
    """The HF export (``checkpoint.export_hf``), results.json and the printed table (start vs end)."""
    if config.checkpoint.export_hf and multihost.is_multihost():
        logger.warning("checkpoint.export_hf: not supported on several hosts yet; convert a checkpoint instead")
    elif config.checkpoint.export_hf:
        # a LoRA adapter's base is model.path unless SFT changed it first (then it is exported too)
        for directory in lora.export(params, model_config, out / "export",
                                     base_model="" if config.sft.steps else config.model.path):
            tokenizer.hf.save_pretrained(directory)
    rows = {k: results[k] for k in ("start", "end") if k in results}
    first = next(iter(rows.values()), {})
    table = results_table(rows, TABLE_KEYS + [k for k in first if k.startswith("pass_at_") and k != "pass_at_1"]
                          + [k for k in ERROR_KEYS if any(k in row for row in rows.values())])
    results["table"] = table
    if jax.process_index() == 0:
        (out / "results.json.tmp").write_text(json.dumps(results, indent=2))
        os.replace(out / "results.json.tmp", out / "results.json")  # whole or absent, whenever a kill comes
        n_eval = int(results.get("end", results.get("start", {})).get("num_tasks", 0))
        print(f"\nheld-out evaluation ({n_eval} tasks, {config.eval.samples_per_task} samples each):")
        print(table)
        print(f"results: {out / 'results.json'}  ({results['total_seconds']:.0f} s)")


def make_meshes(config: Config) -> tuple[Mesh, Mesh]:
    """(training mesh, rollout-engine mesh).

    One host: the same mesh (colocated), or with ``async_rl.placement='disaggregated'`` the
    first ``rollout_devices`` devices (default half) for the engine (slots over ``data``,
    ``mesh.tensor``-way tensor parallel when it divides them) and the rest for training
    (``mesh.*``). Several hosts: rollouts are host-local (multihost.py), so the engine gets
    this host's devices.
    """
    async_rl = config.async_rl
    if async_rl.enabled and async_rl.placement == "disaggregated":
        devices = jax.devices()
        n = async_rl.rollout_devices or len(devices) // 2
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


def _sft(config, graphdef, params, tokenizer, conversations, writer, mesh, *, tools=None):
    records = [conversation_to_record(tokenizer, conv, tools=tools) for conv in conversations]
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
        chunk_size=config.algorithm.logprob_chunk_tokens,
    )
    if history:
        logger.info("SFT: %d steps, loss %.4f -> %.4f", len(history), history[0]["sft/loss"], history[-1]["sft/loss"])
    return state.params


def _restore_initial_policy(out: Path, target):
    """The post-SFT policy the run saved before RL, for the frozen copies of a resumed run."""
    path = out / INITIAL_POLICY_DIR
    if not path.is_dir():
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
