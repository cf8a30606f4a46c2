"""A cross-request prefix cache: full KV pages kept after their requests end, found by token hash.

Repeated system prompts and few-shot headers, the same task's prompt in a later step, or a
preempted sequence coming back: their leading tokens' KV is already in pages that a
finished request held. The cache keeps one reference to each full page a prefill wrote,
keyed by a hash chain over the tokens up to the page's end (the KV of page i depends on
every token before it, so the key of page i hashes page i's tokens together with the key
of page i - 1), per data shard. A new sequence (nothing prefilled yet) takes the longest
chain of cached pages on one shard (each page one more reference) and prefills from there.

Only full pages are cached (a partial page is still written by its sequence), and never
the last token of a sequence (its logits sample the first token). KV depends on the
weights, so a weight update empties the cache. Under memory pressure the scheduler
evicts the least recently used entries that only the cache still holds, before idle
sessions.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `pages.KVPages` owns the cache: a runtime import would be circular
    from agentrl_jax.rollout.pages import PageAllocator


class PrefixCache:
    """Full pages by (shard, hash of the tokens up to their end), least recently used first.

    Made by `KVPages.use_prefix_cache`, which owns it.

    Args:
      pages: the pool's allocator (the cache holds one reference per entry).
      page_size: P.

    Attributes:
      hit_tokens: prompt tokens whose prefill the cache saved.
      lookups, hits: sequences looked up, and those that reused at least one page.
    """

    def __init__(self, pages: PageAllocator, page_size: int):
        self.pages = pages
        self.page_size = page_size
        self._entries: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()
        self.hit_tokens = self.lookups = self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _keys(self, tokens: Sequence[int], num_pages: int) -> list[int]:
        P, key, keys = self.page_size, 0, []
        for i in range(num_pages):
            key = hash((key, tuple(tokens[i * P : (i + 1) * P])))
            keys.append(key)
        return keys

    def chain(self, tokens: Sequence[int]) -> list[int]:
        """The keys of the full pages of ``tokens`` that a lookup may reuse (all but the last token's)."""
        return self._keys(tokens, (len(tokens) - 1) // self.page_size)

    def lookup(self, keys: Sequence[int], num_shards: int) -> tuple[int | None, list[int]]:
        """``(shard, pages)``: the longest run of cached leading pages of a sequence whose `chain` is
        ``keys``, on one shard (each page gets one more reference, owned by the caller), leaving at
        least one token to prefill; ``(None, [])`` when no page matches."""
        self.lookups += 1
        best_shard, best = None, []
        for shard in range(num_shards):
            run = []
            for key in keys:
                page = self._entries.get((shard, key))
                if page is None:
                    break
                run.append(page)
            if len(run) > len(best):
                best_shard, best = shard, run
        if not best:
            return None, []
        for key in reversed(keys[: len(best)]):  # leaves older than their prefix: evicted first
            self._entries.move_to_end((best_shard, key))
        self.pages.incref(best_shard, best)
        self.hits += 1
        self.hit_tokens += len(best) * self.page_size
        return best_shard, best

    def insert(self, shard: int, tokens: Sequence[int], pages: Sequence[int], written: int) -> None:
        """Keep the full pages among the first ``written`` entries of a sequence (``pages`` hold them)."""
        full = min(written // self.page_size, len(pages))
        for key, page in reversed(list(zip(self._keys(tokens, full), pages[:full]))):
            entry = (shard, key)
            if entry in self._entries:
                self._entries.move_to_end(entry)
                continue
            self.pages.incref(shard, [page])
            self._entries[entry] = page

    def evict(self, shard: int, need: int) -> None:
        """Drop least recently used entries of ``shard`` that only the cache holds until ``need`` pages are free."""
        for entry in list(self._entries):
            if self.pages.num_free(shard) >= need:
                return
            if entry[0] == shard and self.pages.refcount(shard, self._entries[entry]) == 1:
                self.pages.release(shard, [self._entries.pop(entry)])

    def clear(self) -> None:
        """Drop every entry (new weights: the cached KV is stale)."""
        for (shard, _), page in self._entries.items():
            self.pages.release(shard, [page])
        self._entries.clear()
