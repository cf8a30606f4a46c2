"""The host's view of the decode slots' pages: page lists, the page table, length bounds.

The device reads a slot's pages from `DecodeState.page_table`; this table is where they
are decided. Changes accumulate here and reach the device in one upload (and one batched
deactivation call for freed slots) the next time the engine touches the decode state
(`Engine._sync`), so frees and inserts cost one call per tick, not one per slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentrl_jax.rollout.pages import TRASH_PAGE, PageAllocator, pages_for


class SlotTable:
    """Pages of S slots over D shards (slot s uses shard ``s // (S / D)``).

    Args:
      pages: the allocator (references move between it, the slots and their callers).
      num_slots: S.
      table_width: Tp, the page table's columns (pages of the longest sequence).
      page_size: P.
      max_length: M, the longest sequence.
    """

    def __init__(self, pages: PageAllocator, num_slots: int, table_width: int, page_size: int, max_length: int):
        self.pages = pages
        self.num_slots = num_slots
        self.slots_per_shard = num_slots // pages.num_shards
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
            raise ValueError(f"assign_slot: {len(pages)} pages exceed the table width {self.table.shape[1]}")
        self.release(slot)
        self._to_deactivate.discard(slot)
        self._pages[slot] = list(pages)
        self.table[slot, : len(pages)] = pages
        self._bound[slot] = length
        self._live[slot] = True
        self._truncating[slot] = truncating
        self.dirty = True

    def release(self, slot: int, *, keep_pages: bool = False) -> list[int]:
        """Free `slot`; drop its page references, or with ``keep_pages`` return them to the caller."""
        pages, self._pages[slot] = self._pages[slot], []
        if self._live[slot]:
            self._to_deactivate.add(slot)
        self._live[slot] = False
        self.table[slot] = TRASH_PAGE
        self.dirty = True
        if not keep_pages and pages:
            self.pages.release(self.shard_of(slot), pages)
        return pages if keep_pages else []

    def reserve(self, slot: int, steps: int) -> None:
        """Pages for `slot`'s next ``steps`` entries (OutOfPages if its shard has too few)."""
        bound = min(int(self._bound[slot]) + steps, self.max_length)
        need, have = pages_for(bound, self.page_size), len(self._pages[slot])
        if need > have:
            new = self.pages.alloc(self.shard_of(slot), need - have)
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
