"""When ``collect`` for step j may start: the admission rule of synchronous and asynchronous RL.

A producer task on the asyncio loop starts each step's ``collect`` once it is admitted;
the loop (``loop.py``) awaits step j's trajectories, runs the step body, and reports the
step finished:

    admission   collect for step j starts once step j - 1 - max_staleness has finished
                (its weights pushed to the engine: version >= v0 + (j - s0) - max_staleness)

``max_staleness = 0`` is the synchronous schedule: step j's rollouts start only after
step j - 1 is done, with the same prompts and sampling seeds. With ``max_staleness = k``
up to k later steps roll out while the trainer updates (the decoupled rollout and
training of "AstraFlow: Dataflow-Oriented Reinforcement Learning for Agentic LLMs",
arXiv:2605.15565; PipelineRL-style in-flight weight updates). Every token of step
j's rollouts is sampled at a version >= v0 + (j - s0) - k (in-flight requests continue on
new weights, each token tagged with its version), while step j trains version
v0 + (j - s0): no trained token lags more than k versions, and nothing finished is
discarded; the bound is kept by not starting work too early.

Checkpoints record the data position before the first prompts not yet trained on; a
resumed run draws those prompts again (their in-flight rollouts are not saved).
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

# collect(step, tasks) -> (trajectories, sampling stats)
Collect = Callable[[int, list[dict]], Awaitable[tuple[list, dict[str, float]]]]


class ProducerLoop(abc.ABC):
    """An asyncio producer task started by ``async with`` and cancelled, with the tasks it
    started (``_pending()``), on exit; waiters block on ``_changed`` until ``_notify()``."""

    _changed: asyncio.Condition
    _producer: asyncio.Task

    async def __aenter__(self):
        self._changed = asyncio.Condition()
        self._producer = asyncio.create_task(self._produce())
        self._producer.add_done_callback(lambda _: asyncio.ensure_future(self._notify()))
        return self

    async def __aexit__(self, *exc) -> None:
        self._producer.cancel()
        pending = self._pending()
        for task in pending:
            task.cancel()
        await asyncio.gather(self._producer, *pending, return_exceptions=True)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @abc.abstractmethod
    async def _produce(self) -> None:
        """Start the work (batches, groups) as the rule admits it."""

    @abc.abstractmethod
    def _pending(self) -> list[asyncio.Task]:
        """The tasks the producer started and that may still run."""


class StepAdmission(ProducerLoop):
    """Starts each step's ``collect`` under the admission rule (see the module docstring).

    Args:
      collect: runs one step's rollouts.
      data: the prompt iterator (``next`` draws a step's prompts; ``get_state`` its position).
      start_step, total_steps: the steps to run.
      max_staleness: steps whose rollouts may run ahead of the trainer (0: synchronous).
    """

    def __init__(self, collect: Collect, data: Any, start_step: int, total_steps: int, max_staleness: int):
        self.collect = collect
        self.data = data
        self.start_step, self.total_steps = start_step, total_steps
        self.max_staleness = max_staleness
        self.finished = 0  # steps finished since start_step
        self.batches: dict[int, asyncio.Task] = {}
        self.data_states: dict[int, Any] = {}
        self.admission_wait: dict[int, float] = {}
        self._changed: asyncio.Condition | None = None
        self._producer: asyncio.Task | None = None

    def admitted(self, step: int) -> bool:
        """The admission rule."""
        return self.finished >= step - self.start_step - self.max_staleness

    def _pending(self) -> list[asyncio.Task]:
        return list(self.batches.values())

    async def batch(self, step: int) -> tuple[list, dict[str, float], float]:
        """Step ``step``'s (trajectories, sampling stats, rollout seconds), once rolled out."""
        async with self._changed:
            await self._changed.wait_for(lambda: step in self.batches or self._producer.done())
        if step not in self.batches:
            self._producer.result()  # re-raises the producer's failure
            raise RuntimeError(f"step admission: the producer stopped before step {step}")
        try:
            return await self.batches[step]
        finally:
            del self.batches[step]

    async def finish(self, step: int) -> None:
        """Step ``step`` is done (weights pushed, metrics and checkpoint written): admit more."""
        self.data_states.pop(step, None)
        async with self._changed:
            self.finished = step + 1 - self.start_step
            self._changed.notify_all()

    def data_state(self, step: int) -> Any:
        """The data position before step ``step``'s prompts (drawn already or not)."""
        return self.data_states.get(step) or self.data.get_state()

    @property
    def in_flight(self) -> int:
        return len(self.batches)

    async def _produce(self) -> None:
        for step in range(self.start_step, self.total_steps):
            t0 = time.perf_counter()
            async with self._changed:
                await self._changed.wait_for(lambda: self.admitted(step))  # noqa: B023
            self.admission_wait[step] = time.perf_counter() - t0
            self.data_states[step] = self.data.get_state()
            self.batches[step] = asyncio.create_task(self._timed(step, next(self.data)))
            await self._notify()

    async def _timed(self, step: int, tasks: list[dict]):
        t0 = time.perf_counter()
        trajectories, stats = await self.collect(step, tasks)
        return trajectories, stats, time.perf_counter() - t0
