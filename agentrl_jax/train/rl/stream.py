"""Streaming rollouts (``async_rl.mode='stream'``): groups start one by one, steps take finished groups.

The step admission (``admission.py``) starts a whole step's rollouts at once and the step
waits for its slowest episode. The stream keeps groups in flight instead: whenever one
finishes another starts, finished groups wait in a buffer, and step j takes the next
``groups_per_batch`` of them as soon as it may. Steps are counted from the run's start
(t = j - start_step); step t trains params version v0 + t, and the engine holds
v0 + e once e steps have finished.

    admission   a group starts at engine step e only while the groups started and not yet
                taken number fewer than (e + max_staleness - taken + 1) x groups_per_batch;
                its deadline is step e + max_staleness
    batch t     every group whose deadline is t (waited for if still running), then the
                finished groups by (deadline, draw order), groups_per_batch in all, in draw order

This is the staleness rule of "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning" (arXiv:2505.24298): a group starts only if its first token's
version (>= v0 + e) is within ``max_staleness`` of the version it will be trained at. The
admission count keeps at most groups_per_batch groups due by any step, so taking the
earliest deadlines first never misses one, and nothing finished is discarded for staleness.
With ``max_staleness = 0`` the groups of step t start together after step t - 1 finished, in
the synchronous run's order and with its seeds: the synchronous schedule, exactly.

How many groups run at once: the staleness bound above, the ``stream_max_groups`` cap, and a
target from Little's law: to keep D decode lanes busy while a share f of an episode's time
waits on tools, D / (1 - f) episodes must be in flight (f measured on finished groups), at
most as many as the KV pool holds at full length; never fewer than one batch.

DAPO's dynamic sampling ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476, sec. 3.2) drops a finished group whose rewards are all equal, which frees
its place for a new one: the stream never waits for a redraw round. After
``max_sampling_rounds`` x groups_per_batch drops for one step, all-equal groups are kept.

Checkpoints store the data position after the prompts drawn so far: a resume never draws a
trained prompt again, and loses the groups in flight or buffered and the prompts of the
current draw not started yet (``stream/resume_loses_groups``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import jax

from agentrl_jax.config import Config
from agentrl_jax.envs.agent_loop import AgentLoop
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.train.episodes import informative
from agentrl_jax.train.rl.admission import ProducerLoop

# run_group(task, draw, position) -> (the group's trajectories, the share of its episodes' time spent
# in tool calls); (draw, position) seed it
RunGroup = Callable[[Any, int, int], Awaitable[tuple[list, float]]]


@dataclasses.dataclass
class StreamGroup:
    """One prompt's group in the stream.

    Attributes:
      index: its place in draw order (the batch order).
      draw, position: the data draw it came from and its place in it (the sampling seed).
      started_at: the engine step when it started (its first token's version is >= v0 + it).
      deadline: the last step that may train it (``started_at + max_staleness``).
    """

    index: int
    draw: int
    position: int
    started_at: int
    deadline: int
    start_time: float
    trajectories: list | None = None
    finish_time: float = 0.0
    tool_share: float = 0.0


class GroupStream(ProducerLoop):
    """Keeps groups in flight and hands finished ones to the steps (see the module docstring).

    The loop's protocol is the step admission's: ``batch(step)`` after step - 1 finished,
    ``finish(step)`` once its weights are pushed; ``data_state`` for the checkpoint.

    Args:
      run_group: rolls out one prompt's group.
      data: the prompt iterator (``next`` draws ``groups_per_batch`` prompts; ``get_state``).
      start_step, total_steps: the steps to run.
      max_staleness: versions a group's first token may lag the version that trains it.
      groups_per_batch: groups one step trains (this host's share).
      first_draw: the number of draws before this run's first (seeds continue after a resume).
      dynamic_sampling, max_sampling_rounds: DAPO's filter (``algorithm.*``).
      max_groups: ``async_rl.stream_max_groups`` (0: no cap beyond the automatic size).
      decode_lanes: sequences one decode dispatch advances (the automatic size).
      kv_groups: groups whose full-length KV fits the pool (0: unknown, no cap).
      group_size: episodes per group (the automatic size).
    """

    def __init__(self, run_group: RunGroup, data: Any, start_step: int, total_steps: int, max_staleness: int,
                 groups_per_batch: int, *, first_draw: int = 0, dynamic_sampling: bool = False,
                 max_sampling_rounds: int = 0, max_groups: int = 0, decode_lanes: int = 0,
                 kv_groups: Callable[[], int] = lambda: 0, group_size: int = 1):
        self.run_group, self.data = run_group, data
        self.steps = total_steps - start_step
        self.max_staleness, self.per_batch = max_staleness, groups_per_batch
        self.dynamic_sampling, self.max_drops = dynamic_sampling, max_sampling_rounds * groups_per_batch
        self.max_groups, self.decode_lanes, self.kv_groups, self.group_size = (
            max_groups, decode_lanes, kv_groups, group_size)
        self.draws, self.prompts, self.next_index = first_draw, [], 0
        self.engine_step = 0  # steps finished (weights pushed) since start_step
        self.taken = 0  # batches handed to the loop
        self.running: dict[int, StreamGroup] = {}
        self.buffer: dict[int, StreamGroup] = {}
        self.tool_share = 0.0  # EWMA over finished groups; 0 until measured
        self.admission_wait: dict[int, float] = {}
        self.counts = {"dropped": 0, "kept_uninformative": 0, "drops_this_step": 0}
        self.last_batch: list[StreamGroup] = []
        self._tasks: dict[int, asyncio.Task] = {}
        self._failure: BaseException | None = None
        self._changed: asyncio.Condition | None = None
        self._producer: asyncio.Task | None = None

    # ---- the rule

    def capacity(self) -> int:
        """Groups that may be started and not taken (the admission count; 0 after the last batch)."""
        due_by_deadline = self.engine_step + self.max_staleness - self.taken + 1
        return self.per_batch * max(0, min(due_by_deadline, self.steps - self.taken))

    def target_in_flight(self) -> int:
        """Groups to keep running: Little's law on the measured tool share, within the caps."""
        lanes = math.ceil(self.decode_lanes / max(self.group_size, 1))
        target = math.ceil(lanes / max(1.0 - self.tool_share, 0.05)) if lanes else self.per_batch
        for cap in (self.kv_groups(), self.max_groups):
            target = min(target, cap) if cap else target
        return max(target, self.per_batch)

    def may_start(self) -> bool:
        return (len(self.running) + len(self.buffer) < self.capacity()
                and len(self.running) < self.target_in_flight())

    def ready(self) -> bool:
        """The batch of step ``taken`` can be formed: enough finished groups, none due still running."""
        return (len(self.buffer) >= self.per_batch
                and not any(g.deadline <= self.taken for g in self.running.values()))

    # ---- the loop's protocol

    def _pending(self) -> list[asyncio.Task]:
        return list(self._tasks.values())

    async def batch(self, step: int) -> tuple[list, dict[str, float], float]:
        """The next batch's (trajectories, stream stats, rollout seconds: first start to last finish)."""
        t0 = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(lambda: self.ready() or self._producer.done())
            if self._failure is not None:
                raise RuntimeError(f"stream: a group's rollout failed before step {step}") from self._failure
            if self._producer.done():
                self._producer.result()  # re-raises the producer's failure
                raise RuntimeError(f"stream: the producer stopped before step {step}")
            chosen = sorted(self.buffer.values(), key=lambda g: (g.deadline, g.index))[: self.per_batch]
            late = [g.index for g in self.buffer.values() if g.deadline <= self.taken and g not in chosen]
            if late:  # the admission count makes this impossible; never train past the bound silently
                raise RuntimeError(f"stream: groups {late} are due at step {step} but do not fit its batch")
            for g in chosen:
                del self.buffer[g.index]
            self.taken += 1
            drops, self.counts["drops_this_step"] = self.counts["drops_this_step"], 0
            self._changed.notify_all()
        chosen.sort(key=lambda g: g.index)
        self.last_batch = chosen
        trajectories = []
        for group_id, g in enumerate(chosen):
            for t in g.trajectories:
                t.group_id = group_id
                trajectories.append(t)
        stats = {"stream/trainer_wait": time.perf_counter() - t0,
                 "stream/admission_lag_max": float(max(self.taken - 1 - g.started_at for g in chosen)),
                 "stream/dropped_groups": float(drops)}
        if self.dynamic_sampling:
            stats.update({"dynamic_sampling/kept_groups": float(len(chosen)),
                          "dynamic_sampling/dropped_groups": float(drops)})
        seconds = max(g.finish_time for g in chosen) - min(g.start_time for g in chosen)
        return trajectories, stats, seconds

    async def finish(self, step: int) -> None:
        """Step ``step``'s weights are pushed (the engine is one version further): admit more."""
        async with self._changed:
            self.engine_step += 1
            self._changed.notify_all()

    def data_state(self, step: int) -> Any:
        """The data position after every prompt drawn so far (a resume draws none of them again)."""
        return self.data.get_state()

    @property
    def in_flight(self) -> int:
        """Batches' worth of groups started and not taken (``async/steps_in_flight``)."""
        return math.ceil((len(self.running) + len(self.buffer)) / self.per_batch)

    def metrics(self) -> dict[str, float]:
        """The stream now: groups running and buffered, its size, and what a resume from here loses."""
        return {"stream/groups_in_flight": float(len(self.running)), "stream/groups_buffered": float(len(self.buffer)),
                "stream/target_in_flight": float(self.target_in_flight()), "stream/tool_share": self.tool_share,
                "stream/dropped_groups_total": float(self.counts["dropped"]),
                "stream/kept_uninformative_total": float(self.counts["kept_uninformative"]),
                "stream/resume_loses_groups": float(len(self.running) + len(self.buffer)),
                "stream/resume_skips_prompts": float(len(self.prompts))}

    # ---- the producer

    async def _produce(self) -> None:
        while True:
            t0 = time.perf_counter()
            async with self._changed:
                await self._changed.wait_for(self.may_start)
            self.admission_wait[self.taken] = self.admission_wait.get(self.taken, 0.0) + time.perf_counter() - t0
            if not self.prompts:
                self.prompts = [(self.draws, i, task) for i, task in enumerate(next(self.data))]
                self.draws += 1
            draw, position, task = self.prompts.pop(0)
            group = StreamGroup(self.next_index, draw, position, self.engine_step,
                                self.engine_step + self.max_staleness, time.perf_counter())
            self.next_index += 1
            self.running[group.index] = group
            self._tasks[group.index] = asyncio.create_task(self._run(group, task))

    async def _run(self, group: StreamGroup, task: Any) -> None:
        try:
            group.trajectories, group.tool_share = await self.run_group(task, group.draw, group.position)
        except Exception as e:  # noqa: BLE001 - handed to the loop by batch()
            self._failure = e
            self._producer.cancel()  # wakes batch(), which raises it
            return
        finally:
            self._tasks.pop(group.index, None)
        group.finish_time = time.perf_counter()
        async with self._changed:
            del self.running[group.index]
            self.tool_share = group.tool_share if not self.tool_share else 0.8 * self.tool_share + 0.2 * group.tool_share
            if self.dynamic_sampling and not informative(group.trajectories):
                if self.counts["drops_this_step"] < self.max_drops:
                    self.counts["dropped"] += 1
                    self.counts["drops_this_step"] += 1
                    self._changed.notify_all()
                    return
                self.counts["kept_uninformative"] += 1
            self.buffer[group.index] = group
            self._changed.notify_all()


def stream_rollout(config: Config, agent_loop: AgentLoop, env_factory: Callable[[], Any]) -> RunGroup:
    """One prompt's G episodes for the stream, seeded like the synchronous run's ``rollout_fn``
    (``(seed, draw, global position)``: the draw is the step there), with the share of the
    episodes' time spent in ``env.step`` (the tool calls) measured."""
    r, G = config.rollout, config.algorithm.group_size
    hosts, host = jax.process_count(), jax.process_index()

    async def run_group(task: Any, draw: int, position: int) -> tuple[list, float]:
        envs: list[_TimedEnv] = []

        def timed_env():
            envs.append(_TimedEnv(env_factory()))
            return envs[-1]

        t0 = time.perf_counter()
        trajectories = await agent_loop.run_group(timed_env, task, G, SamplingParams(
            temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
            seed=hash((config.seed, draw, position * hosts + host)) & 0x7FFFFFFF))
        wall = (time.perf_counter() - t0) * max(len(envs), 1)
        return trajectories, min(sum(e.tool_seconds for e in envs) / max(wall, 1e-9), 1.0)

    return run_group


class _TimedEnv:
    """An environment whose ``step`` (the tool call and the grade) is timed; the rest is the env's."""

    def __init__(self, env: Any):
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "tool_seconds", 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    def __setattr__(self, name: str, value: Any) -> None:  # the agent loop tells the env its token count
        setattr(self._env, name, value)

    async def step(self, action_text: str) -> Any:
        t0 = time.perf_counter()
        try:
            return await self._env.step(action_text)
        finally:
            object.__setattr__(self, "tool_seconds", self.tool_seconds + time.perf_counter() - t0)
