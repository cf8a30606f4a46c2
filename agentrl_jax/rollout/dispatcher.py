"""The driver's synchronous side: one tick of engine work at a time, in the driver's worker thread.

A tick (`Dispatcher.tick`):

1. release what finished or was given up: closed sessions' pages, cancelled requests; and
   retire the slots whose turn ends inside the dispatch in flight by its length limit
   (`max_new_tokens`, `max_target_length`: known on the host), so they can take a waiting
   sequence in the next dispatch instead of decoding it for nothing;
2. apply a pending weight update if its boundary is reached;
3. give every decoding slot the pages its next dispatch needs (evicting idle sessions or
   preempting the newest sequence when a shard runs out: `Scheduler.reserve_pages`);
4. prefill every waiting sequence that fits, in ONE `Engine.prefill_insert` call under a
   token budget (`Scheduler.plan_prefill`);
5. queue `generate(num_steps=steps)` for all slots, and only then read the PREVIOUS
   dispatch's results (copied to the host asynchronously), so the device never waits on
   the host;
6. walk each slot's new tokens and stop at eos / stop ids / stop strings / `max_new_tokens`
   / `max_target_length`; tokens after a stop are dropped (a sequence stopped by a token or
   a string decodes the rest of its dispatch and one dispatch more, which are discarded).

With fewer decode lanes than slots (`Engine.decode_batch`), the device itself stops a slot at
its stop ids, its stop strings' tokens and its length limit and hands its lane to a ready slot
at the next step, so those steps are not lost; a slot's valid tokens in a dispatch are then
the steps it held a lane.
Step 1's retirement is off there (a ready slot may not run in the dispatch in flight, so its
end is not known to fall inside it), and each read settles the slots' length bounds to what
they hold (`KVPages.settle`), so a slot waiting for a lane does not collect pages.

Nothing here touches asyncio: finished requests come back as ``(future, value)`` pairs that
the driver resolves on its event loop.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from jax.profiler import TraceAnnotation

from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.request import Completion, Request
from agentrl_jax.rollout.scheduler import Scheduler
from agentrl_jax.rollout.scheduler import Sequence as Track


class Dispatcher:
    """Engine state, params and the in-flight dispatch between ticks.

    Args:
      engine: the paged engine.
      params: the engine's params (`Engine.load_params`).
      version: their version tag.
      steps: decode steps per dispatch.
      budget: new tokens prefilled per tick.
      prefix_cache: keep full prompt pages across requests (`prefix_cache.PrefixCache`).
    """

    def __init__(self, engine: Engine, params: Any, version: int, steps: int, budget: int, prefix_cache: bool = False):
        self.engine = engine
        self.prefix_cache = prefix_cache
        self.params, self.version = params, version
        self.steps = steps
        self.state = None
        self.sched = Scheduler(engine, steps, budget)
        self.budget = budget
        self.row_cap = max(budget // engine.prefill_row_tokens, 1)  # packed rows per shard a tick can fill
        self.lanes = engine.decode_batch < engine.max_concurrent_decodes  # slots wait for decode lanes
        # the last decode dispatch, read one tick later: (results, {slot: (track, admission)}, params version)
        self.in_flight: tuple[Any, dict, int] | None = None
        # sequences whose slot was freed this tick before their last dispatch is read (`_retire_known_ends`)
        self.retired: set[Track] = set()
        # decode work: dispatches, lane-steps that advanced a slot (valid results), and the
        # tokens of those that were kept (the rest came after a stop or before a preemption)
        self.dispatches = self.live_slot_steps = self.kept_tokens = 0
        # host time: inside ticks, and the part of it blocked on the device's results (the rest is
        # host work the device may wait for; see `stats`)
        self.tick_s = self.wait_s = 0.0
        self.ticks = 0

    @property
    def idle(self) -> bool:
        """Nothing decodes and nothing waits for a prefill."""
        return not self.sched.slots and not self.sched.waiting

    def drop_state(self) -> None:
        """Forget the decode state and every page (open sessions will re-prefill their history)."""
        self.state = None  # the engine's `KVPages` (and its prefix cache) goes with it: the next state makes a new one
        for session in self.sched.sessions:
            session.pages, session.shard = [], None
        self.sched.sessions.clear()

    def warmup(self, truncation: bool = False) -> dict[str, float]:
        """Compile every prefill shape and the decode dispatch now (`Engine.warmup`); idle only."""
        if not self.idle:
            raise RuntimeError("Driver.warmup: requests are in flight; warm up before the first one")
        if self.state is None:
            self._prepare([])
        self.state, stats = self.engine.warmup(self.params, self.state, token_budget=self.budget,
                                               num_steps=self.steps, truncation=truncation)
        return {**stats, "programs": self.engine.compiled_programs()}

    def stats(self) -> dict[str, float]:
        """Decode occupancy and KV pages (see `Driver.stats`)."""
        engine, sched = self.engine, self.sched
        slot_steps = self.dispatches * self.steps * engine.decode_batch
        out = {
            "decode_dispatches": self.dispatches, "live_slot_steps": self.live_slot_steps,
            "kept_tokens": self.kept_tokens,
            "slot_occupancy": self.live_slot_steps / slot_steps if slot_steps else 0.0,
            "kept_token_fraction": self.kept_tokens / self.live_slot_steps if self.live_slot_steps else 0.0,
            "preemptions": sched.preemptions, "evictions": sched.evictions, "shared_prefills": sched.shared_prefills,
            "split_groups": sched.split_groups, "compiled_programs": engine.compiled_programs(),
            "ticks": self.ticks, "tick_seconds": self.tick_s, "device_wait_seconds": self.wait_s,
        }
        cache = engine.pages.cache if self.state is not None else None
        if cache is not None:
            out.update(prefix_cache_pages=len(cache), prefix_cache_hits=cache.hits,
                       prefix_cache_hit_tokens=cache.hit_tokens)
        plan = engine.memory_plan
        if self.state is not None and plan is not None:
            P = engine.page_size
            slots = sum(engine.pages.length_bound(s) for s in sched.slots)
            sessions = sum(s.num_cached_tokens for s in sched.sessions)
            out.update(
                kv_pool_tokens=plan.tokens, kv_pool_bytes_per_device=plan.bytes_per_device,
                kv_held_tokens=engine.pages.num_used() * P,
                kv_written_tokens=slots + sessions + sum(p.done for p in sched.waiting),
            )
        return out

    def requests(self) -> list[Request]:
        """Every request that waits for a prefill or decodes."""
        sched = self.sched
        return [*(s.request for p in sched.waiting for s in p.sequences), *(t.request for t in sched.slots.values()),
                *(t.request for t in self.retired)]

    def tick(self, inbox: list[Request], update) -> tuple[list, bool]:
        """One boundary (see the module docstring). Returns the ``(future, value)`` pairs to resolve and
        whether ``update`` (``(params, version, drain, future)`` or None) was applied."""
        started = time.perf_counter()
        self.ticks += 1
        try:
            with TraceAnnotation("rollout/tick"):
                return self._tick(inbox, update)
        finally:
            self.tick_s += time.perf_counter() - started

    def _tick(self, inbox: list[Request], update) -> tuple[list, bool]:
        # The phases are named for `jax.profiler` traces (`bench/rollout.py --profile` lines them up
        # against the device's idle gaps); an annotation costs ~1 us when no trace is taken.
        with TraceAnnotation("rollout/prepare"):
            sched = self._prepare(inbox)
            resolved: list = []
            self.retired = self._retire_known_ends()
            update_done = False
            if update is not None and (not update[2] or not sched.slots):
                self.params, self.version = update[0], update[1]
                update_done = True
                if sched.kv.cache is not None:
                    sched.kv.cache.clear()  # KV of the old weights
            if sched.slots:  # pages for the next dispatch of every decoding slot (may preempt)
                sched.reserve_pages(lambda track: self._finish(track, "capacity", None, resolved))
            rows, admitted = [], []
            if sched.waiting and not (update is not None and not update_done):
                rows, admitted = sched.plan_prefill(resolved, pages_pending=bool(self.retired))
        if rows:
            with TraceAnnotation("rollout/prefill_call"):
                self.state, first = self.engine.prefill_insert(self.params, self.state, rows, row_cap=self.row_cap)
        previous, self.in_flight = self.in_flight, None
        if sched.slots:  # queued before the host reads anything: the device never waits on the host
            with TraceAnnotation("rollout/decode_call"):
                self.state, generated = self.engine.generate(self.params, self.state, num_steps=self.steps)
            with TraceAnnotation("rollout/copy_async"):
                generated.copy_to_host_async()
            self.in_flight = (generated, {s: (t, t.admitted) for s, t in sched.slots.items()}, self.version)
            self.dispatches += 1
        if previous is not None:
            self._read_dispatch(*previous, resolved)
        self.retired = set()
        if rows:  # first tokens come after every token of the previous dispatch
            tokens, valid, log_prob, truncated = (c.tolist() for c in _columns(self._wait(first)))
            with TraceAnnotation("rollout/accept_first"):
                for m, track in enumerate(admitted):
                    if valid[m] and track.slot is not None:  # not valid: a resumed sequence's forced token
                        one = slice(m, m + 1)
                        self._accept(track, tokens[one], valid[one], log_prob[one], truncated[one], self.version,
                                     resolved)
        if not sched.slots:
            self.in_flight = None  # nobody left to read it
        return resolved, update_done

    def _prepare(self, inbox: list[Request]) -> Scheduler:
        sched = self.sched
        if self.state is None:
            self.state = self.engine.init_decode_state()  # a fresh page allocator
            self.engine.pages.use_prefix_cache(self.prefix_cache)
        sched.release_closed()
        sched.drop_cancelled()
        for request in inbox:
            sched.enqueue(request)
        return sched

    def _retire_known_ends(self) -> set[Track]:
        """Free now the slots whose turn ends inside the dispatch in flight by its length limit.

        ``max_new_tokens`` and ``max_target_length`` are known on the host: a sequence whose
        held tokens plus the in-flight dispatch's steps reach one of them stops inside that
        dispatch (there or earlier, at a stop). Without this its slot would decode the next
        dispatch too, for tokens that are dropped; retired (`Scheduler.retire`), the slot is
        free for a waiting sequence in that dispatch. The track is finished when the in-flight
        results are read, later in this tick. Stops by token or string are only known then.
        """
        if self.in_flight is None or self.lanes:
            return set()
        retired = set()
        for slot, (track, admitted) in self.in_flight[1].items():
            if self.sched.slots.get(slot) is not track or track.admitted != admitted:
                continue
            limit = min(track.request.max_new_tokens, self.engine.max_target_length - track.kv_start)
            if len(track.tokens) + self.steps >= limit:
                self.sched.retire(track)
                retired.add(track)
        return retired

    def _read_dispatch(self, generated, tracks: dict, version: int, resolved: list) -> None:
        """Accept one dispatch's tokens for the sequences that are still in the slots they had then
        (or were retired from them this tick)."""
        columns = _columns(self._wait(generated))
        self.live_slot_steps += int(columns[1].sum())
        tokens, valid, log_prob, truncated = (c.T.tolist() for c in columns)
        with TraceAnnotation("rollout/accept"):
            self._accept_dispatch(tracks, tokens, valid, log_prob, truncated, version, resolved)

    def _accept_dispatch(self, tracks: dict, tokens, valid, log_prob, truncated, version: int, resolved: list) -> None:
        """`_accept` each slot's row of a dispatch's host results (``tokens[slot]`` ...)."""
        for slot, (track, admitted) in tracks.items():
            current = self.sched.slots.get(slot) is track and track.admitted == admitted
            if not current and track not in self.retired:
                continue  # finished or preempted (and maybe resumed) since: these tokens are dropped
            self.kept_tokens += self._accept(
                track, tokens[slot], valid[slot], log_prob[slot], truncated[slot], version, resolved
            )
            if self.lanes and track.slot is not None:  # it holds what it holds, plus the dispatch in flight
                self.engine.pages.settle(slot, track.kv_start + len(track.tokens) - 1 + self.steps)

    def _wait(self, result):
        """``result`` on the host; the time blocked counts as waiting for the device."""
        started = time.perf_counter()
        with TraceAnnotation("rollout/wait"):
            host = result.convert_to_numpy()
        self.wait_s += time.perf_counter() - started
        return host

    def _accept(self, track: Track, tokens: list[int], valid: list, log_prob: list[float], truncated: list[float],
                version: int, resolved: list) -> int:
        """Append one slot's tokens of a dispatch up to the first stop, and finish the track there.

        Only the steps the device advanced the slot count (valid = 1: one run of steps, all of
        them with a lane of its own, or none while the slot waits for a lane; the device stops
        advancing it at ``max_target_length``, and with lanes also at its stop ids and length
        limit). The same outcome as checking token by token, in this order: the token is
        appended, then a stop id, a completed stop string, ``max_new_tokens`` and
        ``max_target_length`` end it. Returns how many tokens were appended.
        """
        request = track.request
        if 0 in valid:
            keep = [i for i, v in enumerate(valid) if v]
            tokens, log_prob, truncated = ([x[i] for i in keep] for x in (tokens, log_prob, truncated))
        held = len(track.tokens)
        length_room = request.max_new_tokens - held
        capacity_room = self.engine.max_target_length - track.kv_start - held
        take = min(len(tokens), length_room, capacity_room)
        stop_at, stop = next(((i, t) for i, t in enumerate(tokens[:take]) if t in request.stop_token_ids), (None, None))
        if request.stops is not None:
            at, string = request.stops.first_match(track.tokens, tokens[: take if stop_at is None else stop_at])
            if at is not None:
                stop_at, stop = at, string
        if stop_at is not None:
            take, reason = stop_at + 1, "stop"
        elif take == length_room:
            reason = "length"
        elif take == capacity_room:
            reason = "capacity"
        else:
            reason = None
        track.tokens += tokens[:take]
        track.logprobs += log_prob[:take]
        track.truncated += truncated[:take]
        track.versions += [version] * take
        if reason is not None:
            self._finish(track, reason, stop, resolved)
        return take

    def _finish(self, track: Track, reason: str, stop, resolved: list) -> None:
        request = track.request
        self.sched.end_turn(track)
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


def _columns(result) -> tuple:
    """``(tokens, valid, log_prob, truncated_log_prob)`` of a host `ResultTokens`, as plain arrays."""
    return result.tokens, result.valid.astype(np.int8), result.log_prob, result.truncated_log_prob
