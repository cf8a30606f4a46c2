"""KV pages on the host side: `KVPages`, the one owner of who holds which page.

The engine's KV cache is a pool of fixed-size pages per layer (``[N, KV, P, K]``, see
`rollout.state`). A sequence's keys and values live in the pages its page table lists,
token ``t`` at entry ``t % P`` of page ``table[t // P]``. This module owns which page
belongs to whom; the device never decides.

Shards: when the decode slots are split over the mesh's data axes (D shards), the pool is
split the same way and every sequence takes its pages from its own shard, so decode
attention and cache writes never cross devices. Page ids are therefore local to a shard
(``[0, pages_per_shard)``). Page 0 of every shard is the trash page: it is never handed
out, and every write that must go nowhere (an inactive slot, padding of a batched
prefill, entries past a table's end) lands there.

Reference counts: a page may be held by several owners at once (the G samples of a GRPO
group share their prompt's full pages; a waiting multi-turn session holds its pages while
its tool runs). `release` returns a page to the free list when its count reaches zero.

`KVPages` is the only object that hands out, shares and frees pages: the pool
(`PageAllocator`), each decode slot's pages and the page table the device reads, and the
prefix cache's references (`prefix_cache.PrefixCache`, when on). The engine (inserts,
a dispatch's page reservations) and the driver's scheduler (prefills, sessions,
preemption) both call its methods. Slot changes accumulate here and reach the device in
one upload (and one batched deactivation call for freed slots) the next time the engine
touches the decode state (`Engine._sync`), so frees and inserts cost one call per tick,
not one per slot.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from agentrl_jax.rollout.prefix_cache import PrefixCache

TRASH_PAGE = 0


class OutOfPages(RuntimeError):
    """A shard has no free KV page left (the driver preempts; direct engine users see this)."""


class PageAllocator:
    """Free lists and reference counts of ``num_shards`` shards of ``pages_per_shard`` pages.

    Args:
      num_shards: D, the data-parallel shards of the pool.
      pages_per_shard: pages per shard, including the trash page.
    """

    def __init__(self, num_shards: int, pages_per_shard: int):
        if num_shards < 1 or pages_per_shard < 2:
            raise ValueError(f"PageAllocator: need >= 1 shard of >= 2 pages, got {num_shards} x {pages_per_shard}")
        self.num_shards = num_shards
        self.pages_per_shard = pages_per_shard
        self._refs = np.zeros((num_shards, pages_per_shard), np.int32)
        # a stack per shard; low ids first so small runs touch few distinct pages
        self._free = [list(range(pages_per_shard - 1, TRASH_PAGE, -1)) for _ in range(num_shards)]

    @property
    def usable_pages(self) -> int:
        """Pages one shard can hand out (all but the trash page)."""
        return self.pages_per_shard - 1

    def num_free(self, shard: int) -> int:
        return len(self._free[shard])

    def num_used(self) -> int:
        """Pages held by anyone, over all shards."""
        return sum(self.usable_pages - len(free) for free in self._free)

    def alloc(self, shard: int, n: int) -> list[int]:
        """``n`` fresh pages of ``shard`` with one reference each; OutOfPages if there are fewer."""
        free = self._free[shard]
        if n > len(free):
            raise OutOfPages(f"KV shard {shard}: {n} pages wanted, {len(free)} free")
        pages = [free.pop() for _ in range(n)]
        self._refs[shard, pages] = 1
        return pages

    def incref(self, shard: int, pages: Iterable[int]) -> None:
        """One more owner of each of ``pages`` (already held)."""
        for page in pages:
            if page == TRASH_PAGE or self._refs[shard, page] < 1:
                raise RuntimeError(f"KV shard {shard}: incref of page {page}, which nobody holds")
            self._refs[shard, page] += 1

    def release(self, shard: int, pages: Iterable[int]) -> None:
        """Drop one reference to each of ``pages``; a page nobody holds goes back to the free list."""
        for page in pages:
            if page == TRASH_PAGE or self._refs[shard, page] < 1:
                raise RuntimeError(f"KV shard {shard}: release of page {page}, which nobody holds")
            self._refs[shard, page] -= 1
            if self._refs[shard, page] == 0:
                self._free[shard].append(page)

    def refcount(self, shard: int, page: int) -> int:
        return int(self._refs[shard, page])


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` cache entries."""
    return -(-tokens // page_size)


class KVPages:
    """The KV page pool's owner: D shards of pages, S slots over them (slot s uses shard
    ``s // (S / D)``), and optionally the prefix cache.

    Args:
      num_shards: D.
      pages_per_shard: pages per shard, including the trash page.
      num_slots: S.
      table_width: Tp, the page table's columns (pages of the longest sequence).
      page_size: P.
      max_length: M, the longest sequence.

    Attributes:
      table: [S, Tp] each slot's pages (ids local to its shard): the page table the device reads.
      dirty: the table changed since the device last received it.
      cache: the prefix cache (`use_prefix_cache`), or None.
    """

    def __init__(self, num_shards: int, pages_per_shard: int, *, num_slots: int, table_width: int, page_size: int,
                 max_length: int):
        self._pool = PageAllocator(num_shards, pages_per_shard)
        self.cache: PrefixCache | None = None
        self.num_slots = num_slots
        self.slots_per_shard = num_slots // num_shards
        self.page_size = page_size
        self.max_length = max_length
        self.table = np.full((num_slots, table_width), TRASH_PAGE, np.int32)
        self._pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._bound = np.zeros((num_slots,), np.int64)  # >= the slot's length on the device
        self._live = np.zeros((num_slots,), bool)
        # whether the slot's request samples a top-k / top-p truncated distribution: a decode
        # dispatch compiles the sorted sampling path only when a live slot does (`sampling.sample`)
        self._truncating = np.zeros((num_slots,), bool)
        self._to_deactivate: set[int] = set()
        self.dirty = False

    # ---- the pool: pages of one shard, reference counted ------------------------------

    @property
    def num_shards(self) -> int:
        return self._pool.num_shards

    @property
    def pages_per_shard(self) -> int:
        return self._pool.pages_per_shard

    @property
    def usable_pages(self) -> int:
        """Pages one shard can hand out (all but the trash page)."""
        return self._pool.usable_pages

    def num_free(self, shard: int) -> int:
        return self._pool.num_free(shard)

    def num_used(self) -> int:
        """Pages held by anyone (slots, sessions, prefills, the prefix cache), over all shards."""
        return self._pool.num_used()

    def refcount(self, shard: int, page: int) -> int:
        return self._pool.refcount(shard, page)

    def alloc(self, shard: int, n: int) -> list[int]:
        """``n`` fresh pages of ``shard``, one reference each (the caller's); OutOfPages if too few."""
        return self._pool.alloc(shard, n)

    def incref(self, shard: int, pages: Iterable[int]) -> None:
        """One more owner of each of ``pages`` (shared: a group's prompt, a cache hit, a split group)."""
        self._pool.incref(shard, pages)

    def release(self, shard: int, pages: Iterable[int]) -> None:
        """Drop one reference to each of ``pages``; a page nobody holds is free again."""
        self._pool.release(shard, pages)

    def use_prefix_cache(self, on: bool) -> PrefixCache | None:
        """Start the prefix cache (holding its own page references) if ``on``; the cache, or None."""
        self.cache = PrefixCache(self._pool, self.page_size) if on else None
        return self.cache

    # ---- the slots: their pages, the page table, length bounds --------------------------

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def slot_pages(self, slot: int) -> list[int]:
        return list(self._pages[slot])

    def live_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self._live)]

    def length_bound(self, slot: int) -> int:
        """An upper bound of `slot`'s cache entries (exact between dispatches; 0 for a free slot)."""
        return int(self._bound[slot]) if self._live[slot] else 0

    def longest(self) -> int:
        """The largest length bound of a live slot (0 if none)."""
        return int(self._bound[self._live].max()) if self._live.any() else 0

    def truncating(self, slot: int) -> bool:
        """Whether `slot`'s sampling truncates (as it was assigned)."""
        return bool(self._truncating[slot])

    def any_truncating(self) -> bool:
        """Whether a live slot samples with top-k / top-p (`SamplingParams.truncates`)."""
        return bool(np.any(self._truncating & self._live))

    def assign(self, slot: int, pages: Sequence[int], length: int, *, truncating: bool) -> None:
        """`slot` reads `pages` (taking over one reference to each) and holds `length` entries;
        ``truncating``: its sampling truncates (True is always safe: the sorted path handles any row)."""
        if len(pages) > self.table.shape[1]:
            raise ValueError(f"KVPages.assign: {len(pages)} pages exceed the table width {self.table.shape[1]}")
        self.release_slot(slot)
        self._to_deactivate.discard(slot)
        self._pages[slot] = list(pages)
        self.table[slot, : len(pages)] = pages
        self._bound[slot] = length
        self._live[slot] = True
        self._truncating[slot] = truncating
        self.dirty = True

    def release_slot(self, slot: int, *, keep_pages: bool = False) -> list[int]:
        """Free `slot`; its page references are dropped, or with ``keep_pages`` handed to the caller
        (a session keeping its pages across a tool call) and returned."""
        pages, self._pages[slot] = self._pages[slot], []
        if self._live[slot]:
            self._to_deactivate.add(slot)
        self._live[slot] = False
        self.table[slot] = TRASH_PAGE
        self.dirty = True
        if not keep_pages and pages:
            self._pool.release(self.shard_of(slot), pages)
        return pages if keep_pages else []

    def reserve(self, slot: int, steps: int) -> None:
        """Pages for `slot`'s next ``steps`` entries (OutOfPages if its shard has too few)."""
        bound = min(int(self._bound[slot]) + steps, self.max_length)
        need, have = pages_for(bound, self.page_size), len(self._pages[slot])
        if need > have:
            new = self._pool.alloc(self.shard_of(slot), need - have)
            self.table[slot, have:need] = new
            self._pages[slot] += new
            self.dirty = True

    def settle(self, slot: int, bound: int) -> None:
        """Lower `slot`'s length bound to ``bound`` (>= its length on the device): with decode lanes a
        slot may wait for a lane through a dispatch, which `advance` cannot know when it is queued."""
        self._bound[slot] = min(int(self._bound[slot]), bound)

    def advance(self, steps: int) -> None:
        """Every live slot may have written ``steps`` more entries (a dispatch was queued)."""
        live = self._live
        self._bound[live] = np.minimum(self._bound[live] + steps, self.max_length)

    def take_deactivations(self) -> list[int]:
        """Slots freed since the last call (to deactivate on the device), padded to a bucket with S."""
        slots = sorted(self._to_deactivate)
        self._to_deactivate.clear()
        return slots + [self.num_slots] * (bucket(len(slots)) - len(slots)) if slots else []


def bucket(n: int) -> int:
    """The next power of two >= max(n, 1): few compiled shapes for batched calls."""
    return 1 << max(n - 1, 0).bit_length()
