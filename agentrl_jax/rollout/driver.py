"""Continuous batching over the paged `Engine` with an asyncio API.

Coroutines (agent loops, environments) `await driver.generate(...)`; one background task
owns the engine. Each tick of that task runs in a single worker thread (so the event loop
keeps serving tool calls while the device works) and is one `dispatcher.Dispatcher.tick`:
releases, a weight swap at its boundary, one batched prefill under a token budget
(`prefill_token_budget`; identical fresh prompts that wait together, a GRPO group or G
agent loops of one task, are prefilled once with their full pages shared), pages for the
next dispatch (evicting idle sessions, else preempting the newest decoding sequence: it
is re-prefilled later from its kept tokens, with its key and sample counter, so exactly,
counted in `preemptions`), one N-step decode dispatch queued before the previous one's
results are read, and the stop checks (`stops.StopMatcher` detokenizes only when a token
can complete a stop string).

Warm-up (`Driver.warmup`): the prefill calls take a closed set of shapes fixed by the
engine and the token budget (`Engine.prefill_shapes`); warm-up compiles them and the decode
dispatch before the first request, so no tick compiles.

Multi-turn (`Session`): when a turn ends, the session takes over the slot's pages (no
copy) and the slot is freed. The next turn's `generate(observation_ids, session=s)`
prefills only [last sampled token] + observation into the session's own pages. A session
waiting on a tool holds its pages until it continues or `close()`s; under memory pressure
its pages are evicted and its next turn re-prefills its history.

Decode lanes (`Engine(decode_batch=B)`, B below the slot count): the slots beyond B hold
admitted sequences ready, and the device hands a lane whose sequence stops (a stop id, its
length limit) to one of them at the next step, so a turn that ends mid-dispatch idles no
lane while the host has yet to read the stop (docs/architecture.md, "Decode lanes").

Weight updates (`update_params`): the new params are placed in the engine's sharding and
dtype, then swapped in between two dispatches. By default in-flight requests continue
on the new weights and every token records the version that sampled it
(`Completion.params_versions`; their earlier KV entries came from the old weights, as in
PipelineRL's in-flight updates). With `drain=True` admission pauses until every
in-flight request has finished on the old weights, then the swap happens.

Failure: an exception in a tick is set on every waiting caller's future and the driver
refuses new work with that exception as the cause; nothing exits the process. A request
that can never fit (longer than `max_target_length`, more KV pages than a shard has, a
group larger than a shard's slots) fails alone with a ValueError naming the limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from agentrl_jax.rollout.dispatcher import Dispatcher
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.request import Completion, Request, make_request
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.rollout.scheduler import Session
from agentrl_jax.rollout.stops import StopMatcher, TokenTexts

logger = logging.getLogger(__name__)

__all__ = ["Completion", "Driver", "Session"]

_REPLY_TURNS = 4  # event-loop turns the driver yields after answering callers (`Driver._let_callers_reply`)


class Driver:
    """Continuous-batching generation over an `Engine`, for asyncio callers.

    Args:
      engine: the engine (its slot count is the batch, its page pool the memory).
      params: initial params (placed with `engine.load_params`).
      params_version: the version tag of `params`.
      eos_token_ids: ids that end every request.
      detokenize: `token_ids -> str`, needed for stop strings.
      tokenize: `str -> token_ids` (no special tokens added): each stop string's tokens, which
        end a turn without decoding text, and which the device checks too with decode lanes
        (`StopMatcher.sequences`, `Engine(device_stop_sequences=)`); a stop string the model
        writes with other tokens is still found in the text.
      steps_per_dispatch: decode steps per jitted `generate` call.
      seed: base seed for requests that carry none.
      prefill_token_budget: new tokens prefilled per tick, over all sequences (default: 4 x
        the engine's `max_prefill_length`); a longer prompt continues in the next ticks.
      prefix_cache: keep the full KV pages of finished prompts and reuse them for later
        sequences with the same leading tokens (`prefix_cache.PrefixCache`; emptied by weight
        updates, evicted under memory pressure; its pages count in `pages_in_use`).
    """

    def __init__(
        self,
        engine: Engine,
        params: Any,
        *,
        params_version: int = 0,
        eos_token_ids: Sequence[int] = (),
        detokenize: Callable[[Sequence[int]], str] | None = None,
        tokenize: Callable[[str], Sequence[int]] | None = None,
        steps_per_dispatch: int = 8,
        seed: int = 0,
        prefill_token_budget: int | None = None,
        prefix_cache: bool = False,
    ):
        if steps_per_dispatch < 1:
            raise ValueError(f"Driver: steps_per_dispatch must be >= 1, got {steps_per_dispatch}")
        budget = 4 * engine.max_prefill_length if prefill_token_budget is None else prefill_token_budget
        if budget < engine.max_prefill_length:
            raise ValueError(
                f"Driver: prefill_token_budget={budget} must be >= the engine's max_prefill_length="
                f"{engine.max_prefill_length}"
            )
        self.engine = engine
        self._dispatcher = Dispatcher(engine, engine.load_params(params), params_version, steps_per_dispatch, budget,
                                      prefix_cache)
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._detokenize = detokenize
        self._texts = TokenTexts(detokenize) if detokenize is not None else None
        self._tokenize = tokenize
        self._stop_tokens: dict[str, tuple[int, ...]] = {}  # stop string -> its tokens, encoded once
        self._seeds = itertools.count(seed * 1_000_003 + 1)
        self._sched = self._dispatcher.sched
        self._inbox: list[Request] = []
        self._pending_update: tuple[Any, int, bool, asyncio.Future] | None = None
        self._failure: BaseException | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._closed = False
        self._release_requested = False
        # Cumulative seconds the loop spent in ticks with work (device busy) and waiting for
        # work (no slot active, nothing admitted: the rollout devices idle).
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0

    # ---- public API -------------------------------------------------------------------

    @property
    def params_version(self) -> int:
        return self._dispatcher.version

    @property
    def preemptions(self) -> int:
        """Decoding sequences whose pages were taken back (and re-prefilled later)."""
        return self._sched.preemptions

    @property
    def evictions(self) -> int:
        """Idle sessions whose pages were taken back (their next turn re-prefills the history)."""
        return self._sched.evictions

    @property
    def shared_prefills(self) -> int:
        """Samples that decoded from another sample's prompt prefill (shared pages)."""
        return self._sched.shared_prefills

    def session(self) -> Session:
        """A new multi-turn session handle."""
        return Session(self._sched)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
        session: Session | None = None,
    ) -> Completion:
        """Sample one continuation of `prompt_ids` (with a session: of the trajectory so far + them)."""
        [completion] = await self._submit(
            prompt_ids, sampling, stop_token_ids, stop_strings, max_new_tokens, 1, session
        )
        return completion

    async def generate_group(
        self,
        prompt_ids: Sequence[int],
        n: int,
        sampling: SamplingParams | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        max_new_tokens: int = 256,
    ) -> list[Completion]:
        """n samples of one prompt: prefilled once, its pages shared by n slots, own key each."""
        return await self._submit(prompt_ids, sampling, stop_token_ids, stop_strings, max_new_tokens, n, None)

    async def update_params(self, params: Any, version: int, *, drain: bool = False) -> None:
        """Swap in new weights at the next dispatch boundary (see the module docstring).

        Args:
          params: an `nnx.State` of params (any sharding/dtype; placed into the engine's).
          version: the version tag tokens sampled with them will carry.
          drain: finish every in-flight request on the old weights first.
        """
        self._check_alive()
        if self._pending_update is not None:
            raise RuntimeError("update_params: another update is still pending; await it first")
        loop = asyncio.get_running_loop()
        placed = await loop.run_in_executor(self._executor, self.engine.load_params, params)
        done = loop.create_future()
        self._pending_update = (placed, version, drain, done)
        self._ensure_running()
        self._wakeup.set()
        await done

    async def warmup(self, *, truncation: bool = False) -> dict[str, float]:
        """Compile (or load from the persistent cache) every program the driver's ticks run, now.

        The prefill shapes are a closed set fixed by the engine and `prefill_token_budget`
        (`Engine.prefill_shapes`), so after this no tick compiles: a first rollout step, or
        a timed one, runs at speed. Call it before the first request (it raises while
        requests are in flight). Pass ``truncation=True`` when requests will sample with top-k
        or top-p (`SamplingParams.truncates`): their prefill and decode programs are compiled
        too (a second variant of each; calls without such a request run the plain one).

        Returns:
          ``{"prefill_shapes", "decode_shapes", "seconds", "programs"}`` (programs: the engine's
          compiled count after warm-up, `Engine.compiled_programs`).
        """
        self._check_alive()
        if self._inbox or (self._task is not None and not self._task.done() and not self._dispatcher.idle):
            raise RuntimeError("Driver.warmup: requests are in flight; warm up before the first one")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._dispatcher.warmup, truncation)

    def release_cache(self) -> None:
        """Free the decode state (the KV pages) once the driver is idle; the next request re-creates it.

        A synchronous trainer calls this after a rollout so the update has the device memory.
        Requests in flight are not affected: the release waits for a tick with no slot in use.
        Sessions still open lose their pages and re-prefill their history on their next turn.
        """
        self._release_requested = True
        if self._task is not None and not self._task.done():
            self._wakeup.set()
        elif self._dispatcher.idle:
            self._drop_state()

    async def close(self) -> None:
        """Stop the background task (waiting requests fail) and release the decode state."""
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(RuntimeError("Driver closed"))
        self._drop_state()
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> Driver:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def stats(self) -> dict[str, float]:
        """Rollout counters since the driver started, for metrics.

        - ``slot_occupancy``: decode lane-steps that advanced a sequence (valid results) / all
          lane-steps dispatched (a lane per slot unless `Engine.decode_batch` is smaller; free lanes
          decode nothing useful: the rest of a dispatch after the last sequence of a batch ends,
          and slots waiting for a tool's answer, lower it).
        - ``kept_token_fraction``: tokens kept / lane-steps that advanced a sequence (a stopped
          sequence's remaining steps, and its next dispatch, decode tokens that are dropped, unless
          decode lanes stop it on the device).
        - the counts behind them: ``decode_dispatches``, ``live_slot_steps``, ``kept_tokens``
          (decoded tokens only; a request's first token comes from its prefill); and
          ``preemptions``, ``evictions``, ``shared_prefills``, ``split_groups`` (groups admitted over
          several ticks because fewer slots than samples were free), ``busy_seconds``, ``idle_seconds``;
          ``compiled_programs`` (`Engine.compiled_programs`: constant after `warmup`).
        - Host time: ``ticks``, ``tick_seconds`` (inside the engine thread's ticks) and
          ``device_wait_seconds`` (the part of it blocked on reading the device's results). A
          tick's time minus its wait is host work; when a tick waits little the device is
          likely waiting for the host instead (`bench/rollout.py` reports the shares).
        - With a decode state: ``kv_pool_tokens`` / ``kv_pool_bytes_per_device`` (reserved by the
          budget), ``kv_held_tokens`` (pages held by slots, sessions and prefills x page size) and
          ``kv_written_tokens`` (cache entries they hold; a page shared by a group counts once per
          holder). held / pool is how full the pool is; written / held how well pages are filled.
        - With the prefix cache: ``prefix_cache_pages`` (held by it now), ``prefix_cache_hits``
          (sequences that reused cached pages) and ``prefix_cache_hit_tokens`` (prefill saved).
        """
        return {**self._dispatcher.stats(), "busy_seconds": self.busy_seconds, "idle_seconds": self.idle_seconds}

    def pages_in_use(self) -> int:
        """KV pages held now (slots, sessions, partly prefilled prompts)."""
        return 0 if self._dispatcher.state is None else self.engine.pages.num_used()

    # ---- submission -------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError("rollout driver loop failed; no new requests are accepted") from self._failure
        if self._closed:
            raise RuntimeError("Driver is closed")

    async def _submit(self, prompt_ids, sampling, stop_token_ids, stop_strings, max_new_tokens, n, session):
        self._check_alive()
        sampling = sampling if sampling is not None else SamplingParams()
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=next(self._seeds))
        if stop_strings and self._detokenize is None:
            raise ValueError("generate: stop_strings need a detokenize callback (Driver(detokenize=...))")
        request = make_request(
            self.engine, prompt_ids, sampling, stop_token_ids=frozenset(int(t) for t in stop_token_ids) | self._eos,
            stops=StopMatcher(tuple(stop_strings), self._texts, sequences=self._stop_sequences(stop_strings))
            if stop_strings else None,
            max_new_tokens=max_new_tokens, num_samples=n, session=session,
            future=asyncio.get_running_loop().create_future(),
        )
        if session is not None:
            session.busy = True
        self._inbox.append(request)
        self._ensure_running()
        self._wakeup.set()
        try:
            return await request.future
        finally:
            if session is not None:
                session.busy = False

    def _stop_sequences(self, stop_strings: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Each stop string's tokens (`tokenize`), or () without a tokenize callback."""
        if self._tokenize is None:
            return ()
        for stop in stop_strings:
            if stop not in self._stop_tokens:
                self._stop_tokens[stop] = tuple(int(t) for t in self._tokenize(stop))
        return tuple(self._stop_tokens[stop] for stop in stop_strings)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ---- the loop ---------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._wakeup.clear()
            inbox, self._inbox = self._inbox, []
            update = self._pending_update
            started = time.perf_counter()
            try:
                resolved, update_done = await loop.run_in_executor(self._executor, self._dispatcher.tick, inbox, update)
                self.busy_seconds += time.perf_counter() - started
            except BaseException as exc:  # noqa: BLE001  (every caller must see it; the process lives on)
                logger.exception("rollout driver loop failed")
                self._failure = exc
                self._fail_all(exc, extra=inbox)
                return
            if update_done:
                self._pending_update = None
                update[3].set_result(None)
            for future, value in resolved:
                if future.done():
                    continue
                if isinstance(value, BaseException):
                    future.set_exception(value)
                else:
                    future.set_result(value)
            if resolved:
                await self._let_callers_reply()
            if self._dispatcher.idle and not self._inbox and self._pending_update is None:
                if self._release_requested:
                    self._drop_state()
                started = time.perf_counter()
                await self._wakeup.wait()
                self.idle_seconds += time.perf_counter() - started

    async def _let_callers_reply(self) -> None:
        """Give the callers just answered a few event-loop turns before the next tick takes the inbox.

        The next tick queues a dispatch and then waits for the one in flight, so a next turn
        that misses its inbox waits one whole dispatch more. An agent loop whose environment
        answers at once (a parse error, a cached or trivial tool) resubmits within a few loop
        turns (resume, environment step, `generate`); the device is busy with the dispatch
        already queued meanwhile, and an idle turn costs microseconds.
        """
        for _ in range(_REPLY_TURNS):
            await asyncio.sleep(0)

    def _drop_state(self) -> None:
        """Forget the decode state and every page (open sessions will re-prefill their history)."""
        self._dispatcher.drop_state()
        self._release_requested = False

    def _fail_all(self, exc: BaseException, extra: Sequence[Request] = ()) -> None:
        requests = [*extra, *self._inbox, *self._dispatcher.requests()]
        for request in {id(r): r for r in requests}.values():
            if not request.future.done():
                request.future.set_exception(exc)
            if request.session is not None:
                request.session.broken = f"the driver failed: {exc!r}"
        if self._pending_update is not None and not self._pending_update[3].done():
            self._pending_update[3].set_exception(exc)
        self._inbox = []
        self._sched.slots.clear()
        self._sched.waiting.clear()
