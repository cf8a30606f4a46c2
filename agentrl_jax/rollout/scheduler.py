"""Who holds which KV pages between the driver's ticks, and the driver's choices when slots or
pages run out, over the records of `rollout.tracks`. Host-side bookkeeping only (no device
calls); `driver.Driver` runs it inside its tick.

- Waiting work is prefilled under a token budget (packed tokens: each chunk rounded up to
  whole rows of `prefill_row_tokens`, so a call is one of the shapes `Engine.warmup`
  compiled), in arrival order while more than `TIGHT_FREE_FRACTION` of the pool is free,
  else episodes under way (a session's next turn, a resumed sequence) before new ones; a
  group takes the free slots and the rest follows (`Scheduler.split_group`).
- Out of pages: the prefix cache gives pages back first, then idle sessions (their next turn
  re-prefills the history), then the newest decoding sequence is preempted (re-prefilled
  later from its kept tokens, exactly); a sequence alone in its shard takes the pages of
  work waiting there, and only one the whole shard cannot hold ends with "capacity". A new
  episode never evicts a session or takes pages decoding slots are about to need; it waits.
- With a `PrefixCache`, a pending sequence with nothing prefilled starts from the cached full
  pages of its leading tokens, and every prefill but a session's later turns (whose pages
  hold decoded KV) offers its full pages to the cache: agent loops share prompt headers.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import numpy as np

from agentrl_jax.rollout.paged_prefill import PrefillRow
from agentrl_jax.rollout.pages import KVPages, OutOfPages, pages_for
from agentrl_jax.rollout.sampling import request_keys
from agentrl_jax.rollout.tracks import Pending, Sequence, Session

__all__ = ["Pending", "Scheduler", "Sequence", "Session"]

# At or below this free fraction of the pool, episodes under way are prefilled before new ones.
# Swept on CPU in docs/benchmarks.md ("Scheduler constants (CPU)").
TIGHT_FREE_FRACTION = 0.5


class Scheduler:
    """The driver's page and slot policy.

    Args:
      engine: the paged engine (its `KVPages`: pool, slots and prefix cache).
      steps: decode steps per dispatch (pages reserved ahead for them).
      budget: new tokens prefilled per tick.

    Attributes:
      waiting: pending KV work in admission order (preempted sequences go first).
      slots: the sequence decoding in each busy slot.
      sessions: sessions holding pages between turns (evictable, oldest first).
      closing: sessions closed since the last tick (their pages are released then).
      preemptions, evictions, shared_prefills, split_groups: counters (see `Driver`).
    """

    def __init__(self, engine, steps: int, budget: int):
        self.engine = engine
        self.steps = steps
        self.budget = budget
        self.waiting: collections.deque[Pending] = collections.deque()
        self.slots: dict[int, Sequence] = {}
        self.sessions: set[Session] = set()
        self.closing: list[Session] = []
        self._admitted = itertools.count()
        self.preemptions = self.evictions = self.shared_prefills = self.split_groups = 0

    @property
    def kv(self) -> KVPages:
        """The engine's page owner (a new one with each decode state); every page move goes through it."""
        return self.engine.pages

    def end_turn(self, track: Sequence) -> None:
        """A sequence stopped: free its slot (unless `retire` did); a session takes over its pages and history."""
        if track.slot is not None:
            self.retire(track)
        session, pages = track.request.session, track.kept_pages
        track.kept_pages = None
        if session is None or session.closed:
            if pages:
                self.kv.release(track.shard, pages)
            return
        session.pages, session.shard = pages or [], track.shard
        session.history = track.context + track.request.prompt.tolist() + track.tokens[:-1]
        session.pending_token = track.tokens[-1]
        session.key, session.generated = track.key, track.generated_base + len(track.tokens)
        session.touch()
        if session.pages:
            self.sessions.add(session)

    def retire(self, track: Sequence) -> None:
        """Free ``track``'s slot now, although its last tokens are still to be read.

        For a turn that is known to end inside the dispatch in flight (its length limit falls
        there): the slot can take a waiting sequence in the next dispatch instead of decoding
        one more dispatch for nothing. The device runs the calls in order, so the dispatch in
        flight finishes writing the pages before anything queued later reuses them; a
        session's pages stay with the track until `end_turn` hands them over.
        """
        session = track.request.session
        keep = session is not None and not session.closed
        track.shard = self.engine.shard_of(track.slot)
        track.kept_pages = self.kv.release_slot(track.slot, keep_pages=keep)
        del self.slots[track.slot]
        track.slot = None

    def release_closed(self) -> None:
        closing, self.closing = self.closing, []
        for session in closing:
            if session.pages:
                self.kv.release(session.shard, session.pages)
            session.pages, session.shard, session.history = [], None, []
            self.sessions.discard(session)

    def drop_cancelled(self) -> None:
        """Requests whose caller gave up: free their slots, pages and waiting work."""
        for slot, track in list(self.slots.items()):
            if track.request.future.cancelled():
                self.kv.release_slot(slot)
                del self.slots[slot]
                self.break_session(track.request.session, "its turn was cancelled")
        for pending in list(self.waiting):
            cancelled = [s for s in pending.sequences if s.request.future.cancelled()]
            pending.sequences = [s for s in pending.sequences if s not in cancelled]
            if not pending.sequences:
                self.waiting.remove(pending)
                if pending.pages:
                    self.kv.release(pending.shard, pending.pages)
            for track in cancelled:
                self.break_session(track.request.session, "its turn was cancelled")

    def break_session(self, session: Session | None, why: str) -> None:
        if session is not None:
            session.broken = why

    def enqueue(self, request) -> None:
        """A request becomes pending KV work (a session's turn takes over the session's pages)."""
        session = request.session
        context = list(session.history) if session is not None and session.started else []
        if session is not None and session.started:
            key, base = session.key, session.generated
            keys = [key]
        else:
            base = 0
            keys = list(request_keys(request.sampling.seed, request.num_samples))
        sequences = [Sequence(request, g, keys[g], base, context) for g in range(request.num_samples)]
        pending = Pending(tokens=context + request.prompt.tolist(), sequences=sequences, session=session)
        if session is not None and session.pages:
            pending.pages, pending.shard, pending.done = session.pages, session.shard, len(session.history)
            session.pages, session.shard = [], None
            self.sessions.discard(session)
        if pending.fresh:  # identical prompts waiting together share one prefill (if one shard can hold them)
            for other in self.waiting:
                if other.fresh and other.tokens == pending.tokens and self.fits(other, len(sequences)):
                    other.sequences += sequences
                    return
        self.waiting.append(pending)

    def pages_needed(self, pending: Pending, samples: int) -> int:
        """Pages a complete prefill of ``pending`` for ``samples`` sequences takes, with their first
        dispatch: shared full pages, then per sample its partial page and the pages of its next steps."""
        P = self.engine.page_size
        length = len(pending.tokens)
        full = length // P
        reach = min(length + self.steps, self.engine.max_target_length)
        return full + samples * (pages_for(reach, P) - full)

    def fits(self, pending: Pending, extra: int) -> bool:
        """Whether ``extra`` more samples can join ``pending`` (one shard's slots and pages)."""
        samples = len(pending.sequences) + extra
        return (samples <= self.engine.max_concurrent_decodes // self.engine.num_shards
                and self.pages_needed(pending, samples) <= self.kv.usable_pages)

    def plan_prefill(self, resolved: list, *, pages_pending: bool = False) -> tuple[list[PrefillRow], list[Sequence]]:
        """This tick's prefill rows under the token budget, and the sequences they admit to slots.

        ``pages_pending``: turns retired this tick still hold their pages until the dispatch in
        flight is read (later in the tick), so nothing planned now is stuck for good (`unblock`)."""
        engine, P, C = self.engine, self.engine.page_size, self.engine.prefill_row_tokens
        budget = self.budget
        free_slots = {d: [s for s in engine.shard_slots(d) if s not in self.slots] for d in range(engine.num_shards)}
        rows, admitted, finished, offers = [], [], [], []
        # with TIGHT_FREE_FRACTION (half) of the pool or less free, episodes under way (a session's next
        # turn, a resumed sequence) go before new ones: finishing episodes frees pages, starting new ones
        # takes them; with more free, arrival order (new episodes started early shorten the ragged tail)
        tight = sum(self.kv.num_free(d) for d in range(engine.num_shards)) <= (
            TIGHT_FREE_FRACTION * self.kv.usable_pages * engine.num_shards)
        for pending in sorted(self.waiting, key=lambda p: p.new_episode) if tight else list(self.waiting):
            if budget <= 0:
                break
            if self.kv.cache is not None and not pending.pages and pending.done == 0:
                self.reuse_cached(pending)
            remaining = len(pending.tokens) - pending.done
            # the budget counts packed tokens: a chunk takes whole rows of C (`paged_prefill`)
            chunk = min(remaining, engine.max_prefill_length, budget // C * C)
            if chunk == 0:
                break
            final = chunk == remaining
            G = len(pending.sequences)
            shard = pending.shard
            if shard is None:
                shard = max(range(engine.num_shards), key=lambda d: (len(free_slots[d]) >= G, self.kv.num_free(d)))
            take = min(G, len(free_slots[shard])) if final else G  # fewer: the group is split (`split_group`)
            if take == 0:
                continue
            end = pending.done + chunk
            need = pages_for(end, P) - len(pending.pages)
            if final:  # every admitted sample's partial page and first dispatch, minus what the pending holds
                need = self.pages_needed(pending, take) - len(pending.pages)
            if pending.new_episode and self.slots:  # a new episode must not push the ones under way out
                if not self.free_pages(shard, need + self.headroom(shard), evict_sessions=False):
                    continue
            elif not self.free_pages(shard, need):
                continue
            pending.shard = shard
            pending.pages += self.kv.alloc(shard, max(pages_for(end, P) - len(pending.pages), 0))
            row = PrefillRow(shard=shard, pages=list(pending.pages), start=pending.done,
                             tokens=np.asarray(pending.tokens[pending.done:end], np.int32))
            pending.done = end
            # a session's later turns hold decoded KV in their pages; its first turn holds only its prompt's
            if self.kv.cache is not None and (pending.session is None or not pending.session.started):
                offers.append((shard, pending.tokens, list(pending.pages), end))
            budget -= -(-chunk // C) * C
            if final:
                if take < G:
                    self.split_group(pending, take)
                self.admit(pending, row, free_slots[shard])
                admitted += pending.sequences
                finished.append(pending)
            rows.append(row)
        for pending in finished:
            self.waiting.remove(pending)
        for offer in offers:  # after the lookups: this tick's pages are written by this tick's call
            self.kv.cache.insert(*offer)
        if not rows and not self.slots and not pages_pending:
            self.unblock(resolved)
        return rows, admitted

    def reuse_cached(self, pending: Pending) -> None:
        """Start ``pending`` from the prefix cache's pages of its leading tokens, if any.

        Looked up when the pending is planned, not when it arrives: a step's prompts arrive
        together, and the first ones prefilled fill the cache for the others. Only pages
        offered in earlier ticks are found (this tick's offers are inserted after planning),
        so every page read was written by an earlier call.
        """
        if pending.cache_keys is None:
            pending.cache_keys = self.kv.cache.chain(pending.tokens)
        pending.shard, pending.pages = self.kv.cache.lookup(pending.cache_keys, self.engine.num_shards)
        pending.done = len(pending.pages) * self.engine.page_size

    def split_group(self, pending: Pending, take: int) -> None:
        """Admit only ``take`` samples of a group now; the others wait, first in line after it.

        Waiting for G slots to be free at once would leave the free ones idle meanwhile (with
        more episodes than slots, single turns keep taking them and a group can wait long).
        The rest keeps a reference to the prompt's full pages before its last token and
        prefills the rest (at most one page) when slots free up: the same KV, like a prefix
        cache hit.
        """
        P = self.engine.page_size
        keep = (len(pending.tokens) - 1) // P
        rest = Pending(tokens=pending.tokens, sequences=pending.sequences[take:], done=keep * P,
                       pages=pending.pages[:keep], shard=pending.shard, session=pending.session)
        self.kv.incref(pending.shard, rest.pages)
        pending.sequences = pending.sequences[:take]
        self.waiting.insert(self.waiting.index(pending) + 1, rest)
        self.split_groups += 1

    def admit(self, pending: Pending, row: PrefillRow, free: list[int]) -> None:
        """Fill G slots from a complete pending prefill: shared full pages, copied partial page."""
        engine, P = self.engine, self.engine.page_size
        length = len(pending.tokens)
        full = length // P
        shared, last = pending.pages[:full], pending.pages[full:]
        self.shared_prefills += len(pending.sequences) - 1
        for g, track in enumerate(pending.sequences):
            slot = free.pop(0)
            if g == 0:
                pages = shared + last  # takes over the pending's references
            else:
                self.kv.incref(pending.shard, shared)
                own = self.kv.alloc(pending.shard, len(last))
                row.copies += list(zip(last[:1], own[:1]))
                pages = shared + own
            track.slot, track.admitted = slot, next(self._admitted)
            self.slots[slot] = track
            # the pages of its first dispatch (checked free with the prefill's)
            reach = min(length + self.steps, engine.max_target_length)
            pages = pages + self.kv.alloc(pending.shard, max(pages_for(reach, P) - len(pages), 0))
            row.admissions.append(track.admission(slot, pages, pending.forced))

    def unblock(self, resolved: list) -> None:
        """Nothing decodes and nothing could be admitted: waiting sequences hold pages each other need.

        Every waiting sequence but the first gives its pages back (it re-prefills later); if
        the first cannot fit even into an otherwise empty shard, it fails alone.
        """
        if self.kv.cache is not None and len(self.kv.cache):
            self.kv.cache.clear()
            return  # the next tick tries again with the cached pages free
        head, *rest = self.waiting
        freed = False
        for pending in rest:
            if pending.pages:
                self._drop_pages(pending)
                freed = True
        if freed:
            return  # the next tick admits the head
        needed = len(head.tokens) - head.done
        self.waiting.popleft()
        if head.pages:
            self.kv.release(head.shard, head.pages)
        error = ValueError(
            f"generate: {len(head.sequences)} sample(s) of a {len(head.tokens)}-token sequence ({needed} to prefill) "
            f"do not fit the KV pages of one shard ({self.engine.memory_plan.describe()}); raise "
            "rollout.kv_cache_bytes / rollout.kv_cache_memory_fraction or shorten the prompt"
        )
        for track in head.sequences:
            resolved.append((track.request.future, error))
            self.break_session(track.request.session, "its turn did not fit the KV budget")

    def headroom(self, shard: int) -> int:
        """Pages the next dispatch of ``shard``'s decoding slots may take (a new prompt leaves them free)."""
        slots = sum(self.engine.shard_of(slot) == shard for slot in self.slots)
        return slots * (self.steps // self.engine.page_size + 1)

    def free_pages(self, shard: int, need: int, *, evict_sessions: bool = True) -> bool:
        """Make ``need`` pages free in ``shard`` by evicting prefix-cache entries (least recently used
        first), then idle sessions (oldest first) unless ``evict_sessions`` is False.

        A new prompt (nothing prefilled) waits instead of evicting sessions or taking the pages
        that decoding slots are about to need, while anything decodes: evicted sessions and
        preempted sequences would re-prefill, and under a tight budget new episodes would keep
        pushing the ones under way out (thrash). With nothing decoding it may evict, so a
        session that is never continued cannot block the pool.
        """
        pages = self.engine.pages
        if self.kv.cache is not None:
            self.kv.cache.evict(shard, need)
        while pages.num_free(shard) < need:
            if not evict_sessions:
                return False
            idle = [s for s in self.sessions if s.shard == shard]
            if not idle:
                return False
            victim = min(idle, key=lambda s: s.last_used)
            pages.release(shard, victim.pages)
            victim.pages, victim.shard = [], None
            self.sessions.discard(victim)
            self.evictions += 1
        return True

    def reserve_pages(self, finish: Callable[[Sequence], None]) -> None:
        """Pages for every decoding slot's next dispatch, oldest first; when a shard runs out, evict
        an idle session, else preempt the newest sequence of that shard; a sequence alone in its
        shard takes the pages of work waiting there (`release_waiting`), and only a sequence that
        the whole shard cannot hold ends with "capacity"."""
        engine = self.engine
        for track in sorted(self.slots.values(), key=lambda t: t.admitted):
            while track.slot is not None:
                try:
                    self.kv.reserve(track.slot, self.steps)
                    break
                except OutOfPages:
                    shard = engine.shard_of(track.slot)
                    if self.free_pages(shard, self.kv.num_free(shard) + 1):
                        continue
                    victims = [t for t in self.slots.values() if t is not track and engine.shard_of(t.slot) == shard]
                    if victims:
                        self.preempt(max(victims, key=lambda t: t.admitted))
                    elif not self.release_waiting(shard):  # alone in its shard and still too long
                        finish(track)  # ends with "capacity"
                        break

    def release_waiting(self, shard: int) -> bool:
        """Give back the pages of the newest waiting work in ``shard`` that holds any (a session's
        next turn waiting for a slot, a prompt prefilled in part): it re-prefills every token
        later, exactly, as an evicted session's turn does. Counted in ``evictions``. False if
        no waiting work there holds pages."""
        for pending in reversed(self.waiting):
            if pending.shard == shard and pending.pages:
                self._drop_pages(pending)
                self.evictions += 1
                return True
        return False

    def _drop_pages(self, pending: Pending) -> None:
        """``pending`` gives its pages back and will prefill every token again."""
        self.kv.release(pending.shard, pending.pages)
        pending.pages, pending.shard, pending.done = [], None, 0

    def preempt(self, track: Sequence) -> None:
        """Free a decoding sequence's slot and pages; it waits (first in line) to be re-prefilled."""
        self.kv.release_slot(track.slot)
        del self.slots[track.slot]
        track.slot = None
        tokens, forced = track.resume_tokens()
        self.waiting.appendleft(Pending(tokens=tokens, sequences=[track], forced=forced))
        self.preemptions += 1

