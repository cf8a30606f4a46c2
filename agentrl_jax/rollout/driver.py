"""Continuous batching over the `Engine` with an asyncio API.

Coroutines (agent loops, environments) `await driver.generate(...)`; one background task
owns the engine. Each tick of that task runs in a single worker thread (so the event loop
keeps serving tool calls while the device works):

1. apply a pending weight update if its boundary is reached;
2. admit waiting requests into free slots: prefill (in chunks of `max_prefill_length`
   via `existing_prefix` when longer) and `insert`, or `bulk_insert` a G-sample group;
3. run `generate(num_steps=steps_per_dispatch)` for all slots in one dispatch;
4. on the host, walk each slot's new tokens and stop at eos / stop ids / stop strings /
   `max_new_tokens` / a full cache; tokens a slot produced after its stop are dropped and
   its slot is refilled on the next tick.

Multi-turn (`Session`): when a turn ends, the driver copies the slot's live KV row into a
saved `Prefix` held by the session and frees the slot. The next turn's
`generate(observation_ids, session=s)` prefills only [last sampled token] + observation
on top of that prefix: earlier turns never run through the model again. Memory trade-off:
a waiting session holds L * 2 * len * KV * K cache entries of device memory outside the
slot pool (about 110 KB per token for Qwen3-1.7B in bf16), but frees its slot for other
requests while its tool runs; `Session.close()` releases it. Holding the slot instead
would cost no copy but idle a slot for the whole tool call.

Weight updates (`update_params`): the new params are placed in the engine's sharding and
dtype, then swapped in between two dispatches. By default in-flight requests continue
on the new weights and every token records the version that sampled it
(`Completion.params_versions`; their earlier KV entries came from the old weights, as in
PipelineRL's in-flight updates). With `drain=True` admission pauses until every
in-flight request has finished on the old weights, then the swap happens.

Failure: an exception in a tick is set on every waiting caller's future and the driver
refuses new work with that exception as the cause; nothing exits the process. A request
that cannot fit (prompt longer than the engine's capacity, a group larger than the slot
count) fails alone, with a ValueError naming the limit.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.rollout.state import Prefix

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Completion:
    """One sampled continuation.

    Attributes:
      token_ids: sampled tokens, including the stop token / the tokens completing a stop string.
      logprobs: log softmax(z / tau)[token] per token (what the trainer computes).
      truncated_logprobs: logprob under the top-k/top-p distribution actually sampled.
      finish_reason: "stop" (eos, stop id or stop string), "length" (max_new_tokens) or
        "capacity" (the slot's cache is full).
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


class Session:
    """A multi-turn trajectory's handle: its saved KV prefix between turns.

    Create with `Driver.session()`, pass to every `generate` call of the trajectory, and
    `close()` it when the episode ends to release the device memory.
    """

    def __init__(self):
        self.prefix: Prefix | None = None
        self.pending_token: int | None = None
        self.length = 0
        self.busy = False

    def close(self) -> None:
        self.prefix = None
        self.pending_token = None

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of the trajectory whose KV the session holds."""
        return 0 if self.prefix is None else self.length


@dataclasses.dataclass
class _Request:
    prompt: np.ndarray
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    max_new_tokens: int
    num_samples: int
    session: Session | None
    future: asyncio.Future
    input_length: int
    completions: list[Completion | None] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Track:
    """One sample of a request, living in one slot."""

    request: _Request
    index: int
    slot: int
    kv_start: int
    generated_base: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    truncated: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)


class Driver:
    """Continuous-batching generation over an `Engine`, for asyncio callers.

    Args:
      engine: the engine (its slot count is the batch).
      params: initial params (placed with `engine.load_params`).
      params_version: the version tag of `params`.
      eos_token_ids: ids that end every request.
      detokenize: `token_ids -> str`, needed for stop strings.
      steps_per_dispatch: decode steps per jitted `generate` call.
      seed: base seed for requests that carry none.
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
    ):
        if steps_per_dispatch < 1:
            raise ValueError(f"Driver: steps_per_dispatch must be >= 1, got {steps_per_dispatch}")
        self.engine = engine
        self._params = engine.load_params(params)
        self._version = params_version
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._detokenize = detokenize
        self._steps = steps_per_dispatch
        self._seeds = itertools.count(seed * 1_000_003 + 1)
        self._state = None
        self._waiting: collections.deque[_Request] = collections.deque()
        self._inbox: list[_Request] = []
        self._slots: dict[int, _Track] = {}
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

    def session(self) -> Session:
        """A new multi-turn session handle."""
        return Session()

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
        """n samples of one prompt: prefilled once, bulk-inserted into n slots, own key each."""
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
        """Free the decode state (the KV cache) once the driver is idle; the next request re-creates it.

        A synchronous trainer calls this after a rollout so the update has the device memory.
        Requests in flight are not affected: the release waits for a tick with no slot in use.
        """
        self._release_requested = True
        if self._task is not None and not self._task.done():
            self._wakeup.set()
        elif not self._slots:
            self._state = None
            self._release_requested = False

    async def close(self) -> None:
        """Stop the background task (waiting requests fail) and release the decode state."""
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail_all(RuntimeError("Driver closed"))
        self._state = None
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> Driver:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

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
        if n > self.engine.max_concurrent_decodes:
            raise ValueError(
                f"generate_group: n={n} exceeds the engine's max_concurrent_decodes="
                f"{self.engine.max_concurrent_decodes}"
            )
        start, input_length = 0, int(prompt.size)
        if session is not None:
            if session.busy:
                raise ValueError("generate: the session already has a turn in flight")
            if session.prefix is not None:
                start = session.length
                prompt = np.concatenate([[session.pending_token], prompt]).astype(np.int32)
        if prompt.size == 0:
            raise ValueError("generate: prompt_ids is empty")
        capacity = self.engine.max_target_length
        if start + prompt.size >= capacity:
            raise ValueError(
                f"generate: prompt of {prompt.size} tokens (+ {start} cached in the session) does not fit "
                f"the engine's max_target_length={capacity} with room to generate; shorten the prompt or "
                "build the Engine with a larger max_target_length"
            )
        loop = asyncio.get_running_loop()
        request = _Request(
            prompt=prompt,
            sampling=sampling,
            stop_token_ids=frozenset(int(t) for t in stop_token_ids) | self._eos,
            stop_strings=tuple(stop_strings),
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
            if not self._slots and not self._waiting and not self._inbox and self._pending_update is None:
                if self._release_requested:
                    self._state, self._release_requested = None, False
                started = time.perf_counter()
                await self._wakeup.wait()
                self.idle_seconds += time.perf_counter() - started

    def _fail_all(self, exc: BaseException, extra: Sequence[_Request] = ()) -> None:
        requests = {id(r): r for r in [*extra, *self._inbox, *self._waiting, *(t.request for t in self._slots.values())]}
        for request in requests.values():
            if not request.future.done():
                request.future.set_exception(exc)
        if self._pending_update is not None and not self._pending_update[3].done():
            self._pending_update[3].set_exception(exc)
        self._inbox, self._slots = [], {}
        self._waiting.clear()

    def _tick(self, inbox: list[_Request], update) -> tuple[list, bool]:
        """One boundary: weight swap, admissions, one N-step dispatch, host-side stop checks."""
        if self._state is None:
            self._state = self.engine.init_decode_state()
        self._waiting.extend(inbox)
        resolved: list = []
        update_done = False
        if update is not None and (not update[2] or not self._slots):
            self._params, self._version = update[0], update[1]
            update_done = True
        draining = update is not None and not update_done
        while self._waiting and not draining:
            request = self._waiting[0]
            free = [s for s in range(self.engine.max_concurrent_decodes) if s not in self._slots]
            if len(free) < request.num_samples:
                break
            self._waiting.popleft()
            try:
                self._admit(request, free[: request.num_samples], resolved)
            except ValueError as exc:
                resolved.append((request.future, exc))
        if self._slots:
            self._state, result = self.engine.generate(self._params, self._state, num_steps=self._steps)
            result = result.convert_to_numpy()
            for slot, track in list(self._slots.items()):
                for step in range(self._steps):
                    if not result.valid[step, slot]:
                        self._finish(track, "capacity", None, resolved)
                        break
                    token = int(result.tokens[step, slot])
                    lp, tlp = float(result.log_prob[step, slot]), float(result.truncated_log_prob[step, slot])
                    if self._accept(track, token, lp, tlp, resolved):
                        break
        return resolved, update_done

    def _admit(self, request: _Request, slots: list[int], resolved: list) -> None:
        session = request.session
        prefix = session.prefix if session is not None else None
        kv_start = session.length if prefix is not None else 0
        chunk = self.engine.max_prefill_length
        pieces = [request.prompt[i : i + chunk] for i in range(0, request.prompt.size, chunk)]
        for i, piece in enumerate(pieces):
            if i > 0:  # the token sampled at an intermediate chunk is discarded with its key index
                prefix = prefix.replace(generated=prefix.generated - 1)
            prefix, first = self.engine.prefill(
                params=self._params,
                existing_prefix=prefix,
                padded_tokens=piece,
                true_length=piece.size,
                sampler=request.sampling,
                num_samples=request.num_samples,
            )
        first = first.convert_to_numpy()
        generated = np.asarray(prefix.generated)
        if request.num_samples == 1:
            self._state = self.engine.insert(prefix, self._state, slots[0])
        else:
            self._state = self.engine.bulk_insert(prefix, self._state, slots)
        for g, slot in enumerate(slots):
            track = _Track(request, g, slot, kv_start + request.prompt.size, int(generated[g]) - 1)
            self._slots[slot] = track
            self._accept(track, int(first.tokens[g]), float(first.log_prob[g]), float(first.truncated_log_prob[g]), resolved)

    def _accept(self, track: _Track, token: int, lp: float, tlp: float, resolved: list) -> bool:
        """Append one token; finish the track if it stops. Returns True when finished."""
        request = track.request
        track.tokens.append(token)
        track.logprobs.append(lp)
        track.truncated.append(tlp)
        track.versions.append(self._version)
        if token in request.stop_token_ids:
            self._finish(track, "stop", token, resolved)
            return True
        if request.stop_strings:
            longest = max(len(s) for s in request.stop_strings)
            tail = self._detokenize(track.tokens[-(longest + 4) :])
            for stop in request.stop_strings:
                if stop in tail:
                    self._finish(track, "stop", stop, resolved)
                    return True
        if len(track.tokens) >= request.max_new_tokens:
            self._finish(track, "length", None, resolved)
            return True
        if track.kv_start + len(track.tokens) >= self.engine.max_target_length:
            self._finish(track, "capacity", None, resolved)
            return True
        return False

    def _finish(self, track: _Track, reason: str, stop, resolved: list) -> None:
        request = track.request
        session = request.session
        if session is not None:
            length = track.kv_start + len(track.tokens) - 1
            session.prefix = self.engine.extract_prefix(
                self._state, track.slot, length=length, generated=track.generated_base + len(track.tokens)
            )
            session.length = length
            session.pending_token = track.tokens[-1]
        self._state = self.engine.free_resource(track.slot, self._state)
        del self._slots[track.slot]
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
