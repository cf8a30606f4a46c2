"""What a caller gets back (`Completion`) and what the driver keeps per call (`Request`).

`make_request` checks a call against the engine's limits before it is queued, so a
request that can never fit fails alone, with a ValueError naming the limit and the
config field to change.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from agentrl_jax.rollout.pages import pages_for
from agentrl_jax.rollout.sampling import SamplingParams
from agentrl_jax.rollout.scheduler import Session
from agentrl_jax.rollout.stops import StopMatcher


@dataclasses.dataclass
class Completion:
    """One sampled continuation.

    Attributes:
      token_ids: sampled tokens, including the stop token / the tokens completing a stop string.
      logprobs: log softmax(z / tau)[token] per token (what the trainer computes).
      truncated_logprobs: logprob under the top-k/top-p distribution actually sampled.
      finish_reason: "stop" (eos, stop id or stop string), "length" (max_new_tokens) or
        "capacity" (max_target_length reached, or the KV budget cannot hold it longer).
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


@dataclasses.dataclass(eq=False)
class Request:
    """One `generate` / `generate_group` call, from submission until its future is resolved."""

    prompt: np.ndarray  # this turn's input (with a session: [pending token] + new ids)
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    stops: StopMatcher | None
    max_new_tokens: int
    num_samples: int
    session: Session | None
    future: asyncio.Future
    input_length: int
    completions: list[Completion | None] = dataclasses.field(default_factory=list)


def make_request(engine, prompt_ids, sampling: SamplingParams, *, stop_token_ids: frozenset[int],
                 stops: StopMatcher | None, max_new_tokens: int, num_samples: int, session: Session | None,
                 future: asyncio.Future) -> Request:
    """A `Request` for ``engine``, or a ValueError naming the limit the call breaks."""
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    n = num_samples
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    per_shard = engine.max_concurrent_decodes // engine.num_shards
    if n > per_shard:
        raise ValueError(
            f"generate_group: n={n} exceeds the {per_shard} slots of one data shard (the engine's "
            f"max_concurrent_decodes={engine.max_concurrent_decodes} over {engine.num_shards} shards)"
        )
    start, input_length = 0, int(prompt.size)
    if session is not None:
        if session.busy:
            raise ValueError("generate: the session already has a turn in flight")
        if session.broken:
            raise ValueError(f"generate: the session cannot continue ({session.broken}); start a new one")
        if session.closed:
            raise ValueError("generate: the session is closed")
        if session.started:
            start = len(session.history)
            prompt = np.concatenate([[session.pending_token], prompt]).astype(np.int32)
    if prompt.size == 0:  # a started session may continue with no new tokens (an empty observation)
        raise ValueError("generate: prompt_ids is empty")
    capacity = engine.max_target_length
    if start + prompt.size >= capacity:
        raise ValueError(
            f"generate: prompt of {prompt.size} tokens (+ {start} cached in the session) does not fit "
            f"the engine's max_target_length={capacity} with room to generate; shorten the prompt or "
            "build the Engine with a larger max_target_length"
        )
    plan = engine.memory_plan
    if plan is not None:
        total = start + prompt.size + 1
        need = total // engine.page_size + n * (pages_for(total, engine.page_size) - total // engine.page_size)
        if need > plan.pages_per_shard - 1:
            raise ValueError(
                f"generate: {n} sample(s) of a {total - 1}-token sequence need {need} KV pages; a shard has "
                f"{plan.pages_per_shard - 1} ({plan.source}). Raise rollout.kv_cache_bytes / "
                "rollout.kv_cache_memory_fraction or shorten the prompt"
            )
    return Request(
        prompt=prompt, sampling=sampling, stop_token_ids=stop_token_ids, stops=stops,
        max_new_tokens=max_new_tokens, num_samples=n, session=session, future=future,
        input_length=input_length, completions=[None] * n,
    )
