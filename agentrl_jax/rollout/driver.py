"""Continuous batching over the paged `Engine` with an asyncio API.

Coroutines (agent loops, environments) `await driver.generate(...)`; one background task
owns the engine. Each tick of that task runs in a single worker thread (so the event loop
keeps serving tool calls while the device works):

1. release what finished or was given up: closed sessions' pages, cancelled requests;
2. apply a pending weight update if its boundary is reached;
3. prefill: every waiting sequence that fits (free slots and pages in a data shard) gets
   its next chunk into ONE `Engine.prefill_insert` call, under a token budget
   (`prefill_token_budget`); sequences whose prompt is complete fill their slots in the
   same call. Identical fresh prompts that wait together (a GRPO group, or G agent loops
   of one task) are prefilled once: their full pages are shared, the last partial page is
   copied per sample;
4. give every decoding slot the pages its next `steps_per_dispatch` tokens need; when a
   shard runs out: evict an idle session's pages, else preempt the newest decoding
   sequence (its pages are freed and it is re-prefilled later from its kept tokens, with
   its key and sample counter: exact), counted in `preemptions`;
5. queue `generate(num_steps=steps_per_dispatch)` for all slots in one dispatch, and only
   then read the PREVIOUS dispatch's results (copied to the host asynchronously), so the
   device never waits on the host;
6. on the host, walk each slot's new tokens and stop at eos / stop ids / stop strings
   (`stops.StopMatcher`: detokenizes only when a token can complete one) /
   `max_new_tokens` / `max_target_length`; tokens after a stop are dropped (a stopped
   sequence decodes one dispatch too many, which is discarded).

Multi-turn (`Session`): when a turn ends, the session takes over the slot's pages (no
copy) and the slot is freed. The next turn's `generate(observation_ids, session=s)`
prefills only [last sampled token] + observation into the session's own pages. A session
waiting on a tool holds its pages until it continues or `close()`s; under memory pressure
its pages are evicted and its next turn re-prefills its history.

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

import numpy as np

from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.pages import pages_for
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.rollout.scheduler import Scheduler, Session
from agentrl_jax.rollout.scheduler import Sequence as Track
from agentrl_jax.rollout.stops import StopMatcher, TokenTexts

logger = logging.getLogger(__name__)

__all__ = ["Completion", "Driver", "Session"]


@dataclasses.dataclass
class Completion:
    """One sampled continuation.

    Attributes:
      token_ids: sampled tokens, including the stop token / the tokens completing a stop string.
      logprobs: log softmax(z / tau)[token] per token (what the trainer computes).
      truncated_logprobs: logprob under the top-k/top-p distribution actually sampled.
      finish_reason: "stop" (eos, stop id or stop string), "length" (max_new_tokens) or
        "capacity" (max_target_length reached, or the KV budget cannot hold it longer).
      params_versions: the params version that sampled each token.
      prompt_length: tokens of the prompt (for a session turn: this turn's input tokens).
      stop: the matched stop token id or stop string, else None.
    """

    token_ids: list[int]
    logprobs: list[float]
    truncated_logprobs: list[float]
    finish_reason: str
    params_versions: list[int]
    prompt_length: int
    stop: int | str | None = None

    @property
    def params_version(self) -> int:
        """The version of the last token (the newest weights that touched this completion)."""
        return self.params_versions[-1]


@dataclasses.dataclass(eq=False)
class _Request:
    prompt: np.ndarray  # this turn's input (with a session: [pending token] + new ids)
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stops: StopMatcher | None
    max_new_tokens: int
    num_samples: int
    session: Session | None
    future: asyncio.Future
    input_length: int
    completions: list[Completion | None] = dataclasses.field(default_factory=list)


class Driver:
    """Continuous-batching generation over an `Engine`, for asyncio callers.

    Args:
      engine: the engine (its slot count is the batch, its page pool the memory).
      params: initial params (placed with `engine.load_params`).
      params_version: the version tag of `params`.
      eos_token_ids: ids that end every request.
      detokenize: `token_ids -> str`, needed for stop strings.
      steps_per_dispatch: decode steps per jitted `generate` call.
      seed: base seed for requests that carry none.
      prefill_token_budget: new tokens prefilled per tick, over all sequences (default: 4 x
        the engine's `max_prefill_length`); a longer prompt continues in the next ticks.
    """

    def __init__(
        self,
        engine: Engine,
        params: Any,
        *,
        params_version: int = 0,
        eos_token_ids: Sequence[int] = (),
        detokenize: Callable[[Sequence[int]], str] | None = None,
        steps_per_dispatch: int = 8,
        seed: int = 0,
        prefill_token_budget: int | None = None,
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
        self._params = engine.load_params(params)
        self._version = params_version
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._detokenize = detokenize
        self._texts = TokenTexts(detokenize) if detokenize is not None else None
        self._steps = steps_per_dispatch
        self._budget = budget
        self._seeds = itertools.count(seed * 1_000_003 + 1)
        self._state = None
        self._sched = Scheduler(engine, steps_per_dispatch, budget)
        self._inbox: list[_Request] = []
        # the last decode dispatch, read one tick later: (results, {slot: (track, admission)}, params version)
        self._in_flight: tuple[Any, dict, int] | None = None
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
        return self._version

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

    def release_cache(self) -> None:
        """Free the decode state (the KV pages) once the driver is idle; the next request re-creates it.

        A synchronous trainer calls this after a rollout so the update has the device memory.
        Requests in flight are not affected: the release waits for a tick with no slot in use.
        Sessions still open lose their pages and re-prefill their history on their next turn.
        """
        self._release_requested = True
        if self._task is not None and not self._task.done():
            self._wakeup.set()
        elif not self._sched.slots and not self._sched.waiting:
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

    def pages_in_use(self) -> int:
        """KV pages held now (slots, sessions, partly prefilled prompts)."""
        return 0 if self._state is None else self.engine.pages.num_used()

    # ---- submission -------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError("rollout driver loop failed; no new requests are accepted") from self._failure
        if self._closed:
            raise RuntimeError("Driver is closed")

    async def _submit(self, prompt_ids, sampling, stop_token_ids, stop_strings, max_new_tokens, n, session):
        self._check_alive()
        prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
        sampling = sampling if sampling is not None else SamplingParams()
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=next(self._seeds))
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_strings and self._detokenize is None:
            raise ValueError("generate: stop_strings need a detokenize callback (Driver(detokenize=...))")
        engine = self.engine
        per_shard = engine.max_concurrent_decodes // engine.num_shards
        if n > per_shard:
            raise ValueError(
                f"generate_group: n={n} exceeds the {per_shard} slots of one data shard (the engine's "
                f"max_concurrent_decodes={engine.max_concurrent_decodes} over {engine.num_shards} shards)"
            )
        start, input_length = 0, int(prompt.size)
        if session is not None:
            if session.busy:
                raise ValueError("generate: the session already has a turn in flight")
            if session.broken:
                raise ValueError(f"generate: the session cannot continue ({session.broken}); start a new one")
            if session.closed:
                raise ValueError("generate: the session is closed")
            if session.started:
                start = len(session.history)
                prompt = np.concatenate([[session.pending_token], prompt]).astype(np.int32)
        if prompt.size == 0:  # a started session may continue with no new tokens (an empty observation)
            raise ValueError("generate: prompt_ids is empty")
        capacity = engine.max_target_length
        if start + prompt.size >= capacity:
            raise ValueError(
                f"generate: prompt of {prompt.size} tokens (+ {start} cached in the session) does not fit "
                f"the engine's max_target_length={capacity} with room to generate; shorten the prompt or "
                "build the Engine with a larger max_target_length"
            )
        plan = engine.memory_plan
        if plan is not None:
            total = start + prompt.size + 1
            need = total // engine.page_size + n * (pages_for(total, engine.page_size) - total // engine.page_size)
            if need > plan.pages_per_shard - 1:
                raise ValueError(
                    f"generate: {n} sample(s) of a {total - 1}-token sequence need {need} KV pages; a shard has "
                    f"{plan.pages_per_shard - 1} ({plan.source}). Raise rollout.kv_cache_bytes / "
                    "rollout.kv_cache_memory_fraction or shorten the prompt"
                )
        loop = asyncio.get_running_loop()
        request = _Request(
            prompt=prompt,
            sampling=sampling,
            stop_token_ids=frozenset(int(t) for t in stop_token_ids) | self._eos,
            stops=StopMatcher(tuple(stop_strings), self._texts) if stop_strings else None,
            max_new_tokens=max_new_tokens,
            num_samples=n,
            session=session,
            future=loop.create_future(),
            input_length=input_length,
            completions=[None] * n,
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
                resolved, update_done = await loop.run_in_executor(self._executor, self._tick, inbox, update)
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
            if not self._sched.slots and not self._sched.waiting and not self._inbox and self._pending_update is None:
                if self._release_requested:
                    self._drop_state()
                started = time.perf_counter()
                await self._wakeup.wait()
                self.idle_seconds += time.perf_counter() - started

    def _drop_state(self) -> None:
        """Forget the decode state and every page (open sessions will re-prefill their history)."""
        self._state, self._release_requested = None, False
        for session in self._sched.sessions:
            session.pages, session.shard = [], None
        self._sched.sessions.clear()

    def _fail_all(self, exc: BaseException, extra: Sequence[_Request] = ()) -> None:
        sched = self._sched
        requests = [*extra, *self._inbox, *(s.request for p in sched.waiting for s in p.sequences),
                    *(t.request for t in sched.slots.values())]
        for request in {id(r): r for r in requests}.values():
            if not request.future.done():
                request.future.set_exception(exc)
            if request.session is not None:
                request.session.broken = f"the driver failed: {exc!r}"
        if self._pending_update is not None and not self._pending_update[3].done():
            self._pending_update[3].set_exception(exc)
        self._inbox = []
        sched.slots.clear()
        sched.waiting.clear()

    def _tick(self, inbox: list[_Request], update) -> tuple[list, bool]:
        """One boundary: releases, weight swap, one batched prefill, one N-step dispatch, then the
        previous dispatch's results (read while this one runs) and stop checks."""
        sched = self._sched
        if self._state is None:
            self._state = self.engine.init_decode_state()
        resolved: list = []
        sched.release_closed()
        sched.drop_cancelled()
        for request in inbox:
            sched.enqueue(request)
        update_done = False
        if update is not None and (not update[2] or not sched.slots):
            self._params, self._version = update[0], update[1]
            update_done = True
        if sched.slots:  # pages for the next dispatch of every decoding slot (may preempt)
            sched.reserve_pages(lambda track: self._finish(track, "capacity", None, resolved))
        rows, admitted = [], []
        if sched.waiting and not (update is not None and not update_done):
            rows, admitted = sched.plan_prefill(resolved)
        if rows:
            self._state, first = self.engine.prefill_insert(self._params, self._state, rows)
        previous, self._in_flight = self._in_flight, None
        if sched.slots:  # queued before the host reads anything: the device never waits on the host
            self._state, generated = self.engine.generate(self._params, self._state, num_steps=self._steps)
            generated.copy_to_host_async()
            self._in_flight = (generated, {s: (t, t.admitted) for s, t in sched.slots.items()}, self._version)
        if previous is not None:
            self._read_dispatch(*previous, resolved)
        if rows:  # first tokens come after every token of the previous dispatch
            first = first.convert_to_numpy()
            for m, track in enumerate(admitted):
                if first.valid[m] and track.slot is not None:
                    lp, tlp = float(first.log_prob[m]), float(first.truncated_log_prob[m])
                    self._accept(track, int(first.tokens[m]), lp, tlp, self._version, resolved)
        if not sched.slots:
            self._in_flight = None  # nobody left to read it
        return resolved, update_done

    def _read_dispatch(self, generated, tracks: dict, version: int, resolved: list) -> None:
        """Accept one dispatch's tokens for the sequences that are still in the slots they had then."""
        generated = generated.convert_to_numpy()
        for slot, (track, admitted) in tracks.items():
            if self._sched.slots.get(slot) is not track or track.admitted != admitted:
                continue  # finished or preempted (and maybe resumed) since: these tokens are dropped
            for step in range(self._steps):
                if not generated.valid[step, slot]:
                    self._finish(track, "capacity", None, resolved)
                    break
                token = int(generated.tokens[step, slot])
                lp, tlp = float(generated.log_prob[step, slot]), float(generated.truncated_log_prob[step, slot])
                if self._accept(track, token, lp, tlp, version, resolved):
                    break

    # ---- results ------------------------------------------------------------------------

    def _accept(self, track: Track, token: int, lp: float, tlp: float, version: int, resolved: list) -> bool:
        """Append one token; finish the track if it stops. Returns True when finished."""
        request = track.request
        track.tokens.append(token)
        track.logprobs.append(lp)
        track.truncated.append(tlp)
        track.versions.append(version)
        if token in request.stop_token_ids:
            self._finish(track, "stop", token, resolved)
            return True
        if request.stops is not None:
            stop = request.stops.match(track.tokens)
            if stop is not None:
                self._finish(track, "stop", stop, resolved)
                return True
        if len(track.tokens) >= request.max_new_tokens:
            self._finish(track, "length", None, resolved)
            return True
        if track.kv_start + len(track.tokens) >= self.engine.max_target_length:
            self._finish(track, "capacity", None, resolved)
            return True
        return False

    def _finish(self, track: Track, reason: str, stop, resolved: list) -> None:
        request = track.request
        self._sched.end_turn(track)
        request.completions[track.index] = Completion(
            token_ids=track.tokens,
            logprobs=track.logprobs,
            truncated_logprobs=track.truncated,
            finish_reason=reason,
            params_versions=track.versions,
            prompt_length=request.input_length,
            stop=stop,
        )
        if all(c is not None for c in request.completions):
            resolved.append((request.future, request.completions))
