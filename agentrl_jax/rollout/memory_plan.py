"""The KV budget turned into pages: how many pages each data shard of the pool gets.

Printed once, when the engine builds its first decode state (after the weights are placed,
so a memory fraction measures what is left for the cache).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from agentrl_jax.rollout.pages import pages_for

logger = logging.getLogger(__name__)


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
