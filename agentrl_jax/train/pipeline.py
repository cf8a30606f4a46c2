"""Asynchronous RL: rollouts of later steps run while the trainer updates, with bounded staleness.

A producer/consumer pipeline on the asyncio loop (the decoupled rollout and training
components of seeds/004; PipelineRL-style in-flight weight updates):

    producer  for step j = s0, s0+1, ...:
                wait until the engine's params version >= v0 + (j - s0) - max_staleness  (admission)
                draw step j's prompts; start its rollouts (a task: several steps in flight)
    consumer  for step j = s0, s0+1, ...:
                await step j's trajectories
                train on them in a worker thread (the event loop keeps serving the rollout
                driver and the tool sandboxes meanwhile)
                push the new weights (version + 1) to the engine; wake the producer

Staleness bound: step j's rollouts start at a version >= v0 + (j - s0) - max_staleness,
and every token of them is sampled at that version or later (in-flight requests continue
on new weights, each token tagged with its version), while step j trains the params of
version v0 + (j - s0). So no trained token lags more than ``max_staleness`` versions, and
nothing finished is ever discarded: the bound is kept by not starting work too early.

``max_staleness = 0`` is the synchronous schedule: step j's rollouts start only once step
j-1's weights are in the engine, with the same prompts and sampling seeds, so the updates
equal the synchronous trainer's.

Placement is decided by ``train()`` (``async_rl.placement``): colocated, the engine and
the trainer share the devices and their kernels interleave; disaggregated, the engine
has its own devices and the weight push is a device-to-device ``device_put``.

Checkpoints record the data position before the first prompts not yet trained on; a
resumed run draws those prompts again (their in-flight rollouts are not saved).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import jax

logger = logging.getLogger(__name__)


class AsyncPipeline:
    """Runs ``trainer``'s RL steps with asynchronous rollouts (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.max_staleness = trainer.config.async_rl.max_staleness
        self.pushed_version = trainer.version
        self.batches: dict[int, asyncio.Task] = {}
        self.data_states: dict[int, Any] = {}
        self.admission_wait: dict[int, float] = {}
        self.violations = 0
        self._changed: asyncio.Condition | None = None

    async def run(self, start_step: int) -> None:
        t = self.trainer
        self._changed = asyncio.Condition()
        v0 = t.version
        t.old_policy.on_version(t.version, t.state.params)
        producer = asyncio.create_task(self._produce(start_step, t.config.total_steps, v0))
        producer.add_done_callback(lambda _: asyncio.ensure_future(self._notify()))
        last = time.perf_counter()
        idle_mark = t.driver.idle_seconds
        try:
            for step in range(start_step, t.config.total_steps):
                t0 = time.perf_counter()
                trajectories, sampling_stats, t_rollout = await self._batch(step, producer)
                t_wait = time.perf_counter() - t0
                oldest = min((int(x.params_versions[x.loss_mask > 0].min()) for x in trajectories
                              if (x.loss_mask > 0).any()), default=t.version)
                if t.version - oldest > self.max_staleness:  # the admission rule makes this impossible
                    self.violations += 1
                    logger.error("async: step %d trains version %d on tokens of version %d (max_staleness %d)",
                                 step, t.version, oldest, self.max_staleness)
                t1 = time.perf_counter()
                metrics = await asyncio.to_thread(self._train, trajectories, step)
                t_update = time.perf_counter() - t1
                t2 = time.perf_counter()
                await t.sync_weights()
                t.old_policy.on_version(t.version, t.state.params)
                async with self._changed:
                    self.pushed_version = t.version
                    self._changed.notify_all()
                t_sync = time.perf_counter() - t2
                now = time.perf_counter()
                metrics.update(sampling_stats)
                metrics.update({
                    "time/rollout": t_rollout, "time/update": t_update, "time/sync": t_sync,
                    "time/step": now - last,
                    "time/trainer_idle": t_wait,
                    "time/rollout_idle": t.driver.idle_seconds - idle_mark,
                    "time/admission_wait": self.admission_wait.pop(step, 0.0),
                    "async/steps_in_flight": float(len(self.batches)),
                    "async/staleness_violations": float(self.violations),
                    "throughput/sampled_tokens_per_s": (
                        sum(x.num_sampled_tokens for x in trajectories) / max(t_rollout, 1e-9)),
                })
                last, idle_mark = now, t.driver.idle_seconds
                stop = await t.end_step(step, trajectories, metrics, data_state=self._data_state(step + 1))
                self.data_states.pop(step, None)
                if stop:
                    return
        finally:
            producer.cancel()
            pending = list(self.batches.values())
            for task in pending:
                task.cancel()
            await asyncio.gather(producer, *pending, return_exceptions=True)

    def _train(self, trajectories, step: int) -> dict[str, float]:
        metrics = self.trainer.train_on(trajectories, step)
        jax.block_until_ready(self.trainer.state.params)
        return metrics

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _admitted(self, step: int, start_step: int, v0: int) -> bool:
        return self.pushed_version - v0 >= step - start_step - self.max_staleness

    async def _produce(self, start_step: int, total_steps: int, v0: int) -> None:
        t = self.trainer
        for step in range(start_step, total_steps):
            t0 = time.perf_counter()
            async with self._changed:
                await self._changed.wait_for(lambda: self._admitted(step, start_step, v0))  # noqa: B023
            self.admission_wait[step] = time.perf_counter() - t0
            self.data_states[step] = t.data.get_state()
            tasks = next(t.data)
            self.batches[step] = asyncio.create_task(self._collect(step, tasks))
            await self._notify()

    async def _collect(self, step: int, tasks: list[dict]):
        t0 = time.perf_counter()
        trajectories, stats = await self.trainer.collect(step, tasks)
        return trajectories, stats, time.perf_counter() - t0

    async def _batch(self, step: int, producer: asyncio.Task):
        """Step ``step``'s (trajectories, sampling stats, rollout seconds), once rolled out."""
        async with self._changed:
            await self._changed.wait_for(lambda: step in self.batches or producer.done())
        if step not in self.batches:
            producer.result()  # re-raises the producer's failure
            raise RuntimeError(f"async pipeline: the producer stopped before step {step}")
        task = self.batches[step]
        try:
            return await task
        finally:
            del self.batches[step]

    def _data_state(self, step: int) -> Any:
        """The data position before step ``step``'s prompts (drawn already or not)."""
        return self.data_states.get(step) or self.trainer.data.get_state()
