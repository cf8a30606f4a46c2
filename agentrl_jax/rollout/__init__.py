"""Rollout: a slot-based engine over a paged KV cache, exact-logprob sampling, and an
asyncio continuous-batching driver with multi-turn sessions, shared prompts, preemption and
versioned weight updates."""

from agentrl_jax.rollout.driver import Completion, Driver, Session
from agentrl_jax.rollout.engine import Engine
from agentrl_jax.rollout.engine_config import EngineConfig
from agentrl_jax.rollout.paged_prefill import Admission, PrefillRow
from agentrl_jax.rollout.memory_plan import MemoryPlan
from agentrl_jax.rollout.pages import KVPages, OutOfPages, PageAllocator
from agentrl_jax.rollout.result_tokens import ResultTokens, SlotData
from agentrl_jax.rollout.sampling import GREEDY, SamplingParams, SlotSampling, request_key, sample
from agentrl_jax.rollout.state import DecodeState, Prefix, prefill_bucket

__all__ = [
    "GREEDY",
    "Admission",
    "Completion",
    "DecodeState",
    "Driver",
    "Engine",
    "EngineConfig",
    "KVPages",
    "MemoryPlan",
    "OutOfPages",
    "PageAllocator",
    "PrefillRow",
    "Prefix",
    "ResultTokens",
    "SamplingParams",
    "Session",
    "SlotData",
    "SlotSampling",
    "prefill_bucket",
    "request_key",
    "sample",
]
