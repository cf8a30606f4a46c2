"""What the driver's scheduler keeps per sequence: a sample being decoded (`Sequence`), KV work
waiting for a prefill (`Pending`), and a multi-turn trajectory between turns (`Session`).

Plain host-side records; `scheduler.Scheduler` decides what happens to them.

- `Sequence` is one sample of a request (a track): its tokens so far, its key and sample
  counter (so a re-prefill after preemption samples exactly what an uninterrupted run would).
- `Pending` is KV work waiting for a prefill: the full token list whose KV must be in
  pages, how much of it already is, the pages holding that part, and the sequences that
  will decode from it (G for a prompt shared by a group or by identical prompts that
  arrived in the same tick; the full pages are then shared, the last partial page copied).
- `Session` keeps a multi-turn trajectory's pages while its tool runs, plus the token
  history those pages hold, so an evicted session can be rebuilt exactly.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from agentrl_jax.rollout.paged_prefill import Admission

_order = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One sample of a request, from admission to its last token.

    Attributes:
      request: the driver's request (`request.Request`).
      index: the sample index within the request.
      key: [2] uint32 request key of this sample.
      generated_base: tokens the sample's key had sampled before this turn (sessions).
      context: tokens whose KV precedes this turn's input (a session's history).
      slot: the decode slot while decoding, else None.
      admitted: admission order (preemption takes the newest first).
    """

    request: object
    index: int
    key: np.ndarray
    generated_base: int
    context: list[int]
    slot: int | None = None
    admitted: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    truncated: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    kept_pages: list[int] | None = None  # a retired session turn's pages, until its last tokens are read
    shard: int | None = None

    @property
    def kv_start(self) -> int:
        """Cache entries before this turn's first sampled token."""
        return len(self.context) + len(self.request.prompt)

    def resume_tokens(self) -> tuple[list[int], int]:
        """(tokens whose KV a resumed sequence needs, the token it feeds next)."""
        return self.context + list(self.request.prompt) + self.tokens[:-1], self.tokens[-1]

    def admission(self, slot: int, pages: list[int], forced: int) -> Admission:
        """This sequence entering ``slot`` (reading ``pages``) at the end of its prefill.

        With decode lanes the device stops it at its stop ids, its stop strings' tokens
        (matched against the turn's tokens: a resumed sequence brings those before its forced
        one) and max_new_tokens."""
        request = self.request
        generated = self.generated_base + len(self.tokens)
        return Admission(
            slot, pages, self.key, generated, request.sampling, forced,
            limit=self.kv_start + request.max_new_tokens - 1, stop_ids=request.stop_token_ids,
            stop_sequences=request.stops.sequences if request.stops is not None else (),
            recent=self.tokens[:-1] if forced >= 0 else ())


@dataclasses.dataclass(eq=False)
class Pending:
    """KV work waiting for prefill (see the module docstring).

    Attributes:
      tokens: every token whose KV must be in pages before decoding starts.
      done: how many of them already are (in ``pages``, of ``shard``).
      sequences: who decodes from it once it is complete.
      forced: the token a resumed sequence feeds next (no sampling), or -1.
      session: the session whose history this continues (its pages moved here).
    """

    tokens: list[int]
    sequences: list[Sequence]
    done: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    shard: int | None = None
    forced: int = -1
    session: object | None = None
    cache_keys: list[int] | None = None  # the prefix cache's hash chain of ``tokens`` (computed once)

    @property
    def new_episode(self) -> bool:
        """Every sequence starts its first turn (no history, nothing sampled): starting it takes pages
        and returns none until it ends."""
        return all(not s.context and not s.tokens for s in self.sequences)

    @property
    def fresh(self) -> bool:
        """A new prompt: nothing prefilled, no history, nothing forced (may merge with an identical one)."""
        first_turn = self.session is None or not self.session.started
        return self.done == 0 and self.forced < 0 and first_turn and not self.pages


class Session:
    """A multi-turn trajectory's handle: its KV pages between turns and the tokens they hold.

    Create with `Driver.session()`, pass to every `generate` call of the trajectory, and
    `close()` it when the episode ends to release its pages.

    Attributes:
      history: tokens whose KV the session's pages hold (every earlier turn except the
        last sampled token, which the next turn feeds first).
      pending_token: the last sampled token.
      generated: tokens the session has sampled (its key's counter).
    """

    def __init__(self, scheduler=None):
        self._scheduler = scheduler
        self.history: list[int] = []
        self.pages: list[int] = []
        self.shard: int | None = None
        self.pending_token: int | None = None
        self.key: np.ndarray | None = None
        self.generated = 0
        self.busy = False
        self.broken: str | None = None
        self.closed = False
        self.last_used = 0

    def close(self) -> None:
        """Release the session's pages (at the driver's next tick) and forget its history."""
        self.closed = True
        if self._scheduler is not None:
            self._scheduler.closing.append(self)

    @property
    def started(self) -> bool:
        return self.pending_token is not None

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of the trajectory whose KV the session's pages hold now."""
        return len(self.history) if self.pages else 0

    def touch(self) -> None:
        self.last_used = next(_order)
