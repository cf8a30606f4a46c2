"""KV pages on the host side: the allocator with reference counts, and the memory plan.

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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

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


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How the KV budget was turned into pages (printed when the engine first builds its state).

    Attributes:
      page_size: P, tokens per page.
      bytes_per_page: K and V of every layer for one page, whole (before tensor sharding).
      num_shards: D, data-parallel shards of the pool.
      pages_per_shard: pages per shard, trash page included.
      bytes_per_device: pool bytes each device holds.
      source: where the budget came from ("num_pages", "kv_cache_bytes", "memory fraction
        ...", "default: slots x max length").
      max_concurrent: S, decode slots.
      max_target_length: M, longest sequence.
    """

    page_size: int
    bytes_per_page: int
    num_shards: int
    pages_per_shard: int
    bytes_per_device: int
    source: str
    max_concurrent: int
    max_target_length: int

    @property
    def tokens(self) -> int:
        """Cache entries the pool holds for sequences (trash pages excluded)."""
        return self.num_shards * (self.pages_per_shard - 1) * self.page_size

    def describe(self) -> str:
        full = self.max_concurrent * self.max_target_length
        return (
            f"KV memory plan: {self.num_shards} shard(s) x {self.pages_per_shard - 1} pages of {self.page_size} "
            f"tokens = {self.tokens:,} tokens ({self.bytes_per_device / 2**30:.3f} GiB per device, "
            f"{self.bytes_per_page / 2**20:.3f} MiB per page, budget from {self.source}); "
            f"{self.max_concurrent} slots x {self.max_target_length} max length would need {full:,} tokens "
            f"({100.0 * self.tokens / max(full, 1):.0f}% of that is held)"
        )


def free_device_bytes(devices: Sequence) -> int | None:
    """The smallest free memory over ``devices`` (bytes), or None where devices do not report it (CPU)."""
    free = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001  (backends without memory stats raise or return None)
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free) if free else None


def plan_memory(
    *, bytes_per_page: int, per_device_page: int, num_shards: int, slots_per_shard: int, table_width: int,
    page_size: int, smallest_sequence: int, budget: tuple, devices: Sequence, default_fraction: float,
    max_concurrent: int, max_target_length: int, replicated_over_data: bool,
) -> MemoryPlan:
    """Pages per shard from the budget (the first of num_pages, kv_cache_bytes, memory fraction given).

    Never more pages than every slot at full length needs. Raises a ValueError naming the
    config fields when the budget cannot hold one sequence of ``smallest_sequence`` tokens.
    """
    full = slots_per_shard * table_width + 1  # every slot at full length, plus the trash page
    num_pages, kv_bytes, fraction = budget
    if num_pages is not None:
        per_shard, source = -(-num_pages // num_shards) + 1, f"num_pages={num_pages}"
    elif kv_bytes is not None:
        per_shard, source = kv_bytes // per_device_page, f"kv_cache_bytes={kv_bytes:,}"
    else:
        free = free_device_bytes(devices)
        if free is None:
            per_shard, source = full, "the default (devices report no free memory): slots x max length"
        else:
            fraction = default_fraction if fraction is None else fraction
            per_shard = int(fraction * free) // per_device_page
            source = f"kv_cache_memory_fraction={fraction:g} of {free / 2**30:.2f} GiB free"
    per_shard = min(per_shard, full)
    need = pages_for(smallest_sequence, page_size)
    if per_shard - 1 < need:
        raise ValueError(
            f"KV budget ({source}) gives {max(per_shard - 1, 0)} pages of {page_size} tokens per shard; one "
            f"prompt chunk needs {need}. Raise rollout.kv_cache_bytes or rollout.kv_cache_memory_fraction, or "
            "lower rollout.page_size / rollout.max_prompt_length"
        )
    if per_shard - 1 < slots_per_shard:
        logger.warning(
            "KV budget: %d pages per shard for %d slots per shard; at most %d sequences can hold a page at once "
            "(rollout.max_concurrent is higher than the budget allows)", per_shard - 1, slots_per_shard, per_shard - 1,
        )
    return MemoryPlan(
        page_size=page_size, bytes_per_page=bytes_per_page, num_shards=num_shards, pages_per_shard=per_shard,
        bytes_per_device=per_shard * per_device_page * (num_shards if replicated_over_data else 1),
        source=source, max_concurrent=max_concurrent, max_target_length=max_target_length,
    )
