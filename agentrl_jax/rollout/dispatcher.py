"""The driver's synchronous side: one tick of engine work at a time, in the driver's worker thread.

A tick (`Dispatcher.tick`):

1. release what finished or was given up: closed sessions' pages, cancelled requests;
2. apply a pending weight update if its boundary is reached;
3. give every decoding slot the pages its next dispatch needs (evicting idle sessions or
   preempting the newest sequence when a shard runs out: `Scheduler.reserve_pages`);
4. prefill every waiting sequence that fits, in ONE `Engine.prefill_insert` call under a
   token budget (`Scheduler.plan_prefill`);
5. queue `generate(num_steps=steps)` for all slots, and only then read the PREVIOUS
   dispatch's results (copied to the host asynchronously), so the device never waits on
   the host;
6. walk each slot's new tokens and stop at eos / stop ids / stop strings / `max_new_tokens`
   / `max_target_length`; tokens after a stop are dropped (a stopped sequence decodes one
   dispatch too many, which is discarded).

Nothing here touches asyncio: finished requests come back as ``(future, value)`` pairs that
the driver resolves on its event loop.
"""

from __future__ import annotations

from typing import Any

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
    """

    def __init__(self, engine: Engine, params: Any, version: int, steps: int, budget: int):
        self.engine = engine
        self.params, self.version = params, version
        self.steps = steps
        self.state = None
        self.sched = Scheduler(engine, steps, budget)
        # the last decode dispatch, read one tick later: (results, {slot: (track, admission)}, params version)
        self.in_flight: tuple[Any, dict, int] | None = None

    @property
    def idle(self) -> bool:
        """Nothing decodes and nothing waits for a prefill."""
        return not self.sched.slots and not self.sched.waiting

    def drop_state(self) -> None:
        """Forget the decode state and every page (open sessions will re-prefill their history)."""
        self.state = None
        for session in self.sched.sessions:
            session.pages, session.shard = [], None
        self.sched.sessions.clear()

    def requests(self) -> list[Request]:
        """Every request that waits for a prefill or decodes."""
        sched = self.sched
        return [*(s.request for p in sched.waiting for s in p.sequences), *(t.request for t in sched.slots.values())]

    def tick(self, inbox: list[Request], update) -> tuple[list, bool]:
        """One boundary (see the module docstring). Returns the ``(future, value)`` pairs to resolve and
        whether ``update`` (``(params, version, drain, future)`` or None) was applied."""
        sched = self._prepare(inbox)
        resolved: list = []
        update_done = False
        if update is not None and (not update[2] or not sched.slots):
            self.params, self.version = update[0], update[1]
            update_done = True
        if sched.slots:  # pages for the next dispatch of every decoding slot (may preempt)
            sched.reserve_pages(lambda track: self._finish(track, "capacity", None, resolved))
        rows, admitted = [], []
        if sched.waiting and not (update is not None and not update_done):
            rows, admitted = sched.plan_prefill(resolved)
        if rows:
            self.state, first = self.engine.prefill_insert(self.params, self.state, rows)
        previous, self.in_flight = self.in_flight, None
        if sched.slots:  # queued before the host reads anything: the device never waits on the host
            self.state, generated = self.engine.generate(self.params, self.state, num_steps=self.steps)
            generated.copy_to_host_async()
            self.in_flight = (generated, {s: (t, t.admitted) for s, t in sched.slots.items()}, self.version)
        if previous is not None:
            self._read_dispatch(*previous, resolved)
        if rows:  # first tokens come after every token of the previous dispatch
            first = first.convert_to_numpy()
            for m, track in enumerate(admitted):
                if first.valid[m] and track.slot is not None:
                    lp, tlp = float(first.log_prob[m]), float(first.truncated_log_prob[m])
                    self._accept(track, int(first.tokens[m]), lp, tlp, self.version, resolved)
        if not sched.slots:
            self.in_flight = None  # nobody left to read it
        return resolved, update_done

    def _prepare(self, inbox: list[Request]) -> Scheduler:
        if self.state is None:
            self.state = self.engine.init_decode_state()
        sched = self.sched
        sched.release_closed()
        sched.drop_cancelled()
        for request in inbox:
            sched.enqueue(request)
        return sched

    def _read_dispatch(self, generated, tracks: dict, version: int, resolved: list) -> None:
        """Accept one dispatch's tokens for the sequences that are still in the slots they had then."""
        generated = generated.convert_to_numpy()
        for slot, (track, admitted) in tracks.items():
            if self.sched.slots.get(slot) is not track or track.admitted != admitted:
                continue  # finished or preempted (and maybe resumed) since: these tokens are dropped
            for step in range(self.steps):
                if not generated.valid[step, slot]:
                    self._finish(track, "capacity", None, resolved)
                    break
                token = int(generated.tokens[step, slot])
                lp, tlp = float(generated.log_prob[step, slot]), float(generated.truncated_log_prob[step, slot])
                if self._accept(track, token, lp, tlp, version, resolved):
                    break

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
