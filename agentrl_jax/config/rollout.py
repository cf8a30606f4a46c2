"""The rollout section: the engine's slots, lengths, sampling, KV budget and decode programs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from agentrl_jax.config.core import DType, _f, _require, _Section


@dataclass(frozen=True)
class RolloutConfig(_Section):
    max_concurrent: int = _f(64, "Decode slots in the KV cache (trajectories in flight at once).")
    decode_batch: int = _f(
        0, "Sequences decoded per step (0: every slot). Fewer than max_concurrent: the other slots hold admitted "
        "sequences ready, and a sequence that stops (eos, a stop id, a stop string's tokens, its token limit) hands "
        "its decode lane to one of them at the next step, on the device, instead of idling it until the host reads "
        "the stop (docs/architecture.md, 'Decode lanes'). A multiple of the mesh's data shards."
    )
    max_prompt_length: int = _f(1024, "Longest prompt (tokens) the engine prefills.")
    max_sequence_length: int = _f(4096, "KV-cache length per slot: prompt + all turns + observations.")
    max_new_tokens_per_turn: int = _f(1024, "Tokens the policy may write in one turn.")
    temperature: float = _f(1.0, "Sampling temperature; the trainer uses the same one for logprobs.")
    top_p: float = _f(1.0, "Nucleus sampling threshold (1.0: off).")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    steps_per_dispatch: int = _f(8, "Decode steps per jitted call (host stop checks in between).")
    cache_dtype: DType = _f("bfloat16", "KV-cache dtype.")
    page_size: int = _f(32, "Tokens per KV-cache page (a power of two; >= 16 for the GPU decode kernel).")
    kv_cache_bytes: int = _f(0, "KV page pool bytes per device (0: use kv_cache_memory_fraction).")
    kv_cache_memory_fraction: float = _f(
        0.0, "KV page pool as this fraction of the free device memory when the rollout state is built "
        "(0: the engine's default, 0.8; devices that report no memory, e.g. CPU, get every slot at full length)."
    )
    prefill_token_budget: int = _f(0, "New tokens prefilled per driver tick (0: 4 x max_prompt_length).")
    prefix_cache: bool = _f(
        False, "Keep full KV pages of finished prompts and reuse them for later sequences with the same leading "
        "tokens (repeated system prompts, a task's prompt in later steps); emptied by every weight update."
    )
    warmup: Literal["auto", "on", "off"] = _f(
        "auto", "Compile every rollout program (the closed set of prefill shapes, the decode dispatch, the slot "
        "frees) before the first rollout, so no step compiles mid-rollout ('auto': on for GPU/TPU engines, off "
        "on CPU, where a run meets only a few of the shapes)."
    )
    compilation_cache_dir: str = _f(
        "", "JAX persistent compilation cache directory ('~' expanded), so a restarted run does not compile the "
        "rollout (or anything else) again ('': off)."
    )
    decode_compiler_options: str = _f(
        "default", "XLA options for the decode dispatch only, as 'name=value,...' ('default': the engine's, which "
        "on GPU puts the decode step's weight matmuls on cuBLAS, xla_gpu_enable_triton_gemm=false; 'none': XLA's "
        "own defaults). Engine(decode_compiler_options=); docs/architecture.md, 'Decode lanes'."
    )

    def engine_kwargs(self) -> dict:
        """The paged-cache, decode-lane and compilation-cache arguments of `rollout.Engine` from this section."""
        return {
            "decode_batch": self.decode_batch or None,
            "page_size": self.page_size,
            "kv_cache_bytes": self.kv_cache_bytes or None,
            "kv_cache_memory_fraction": self.kv_cache_memory_fraction or None,
            "compilation_cache_dir": self.compilation_cache_dir or None,
            "decode_compiler_options": parse_compiler_options(self.decode_compiler_options),
        }

    def validate(self) -> None:
        _require(self.max_concurrent >= 1, self._path("max_concurrent"), "must be >= 1")
        _require(
            0 <= self.decode_batch <= self.max_concurrent, self._path("decode_batch"),
            f"({self.decode_batch}) must be in [0, rollout.max_concurrent ({self.max_concurrent})] (0: every slot)",
        )
        _require(
            self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
            self._path("page_size"), f"must be a power of two, got {self.page_size}",
        )
        _require(
            self.page_size <= self.max_sequence_length, self._path("page_size"),
            f"({self.page_size}) must be <= rollout.max_sequence_length ({self.max_sequence_length})",
        )
        _require(self.kv_cache_bytes >= 0, self._path("kv_cache_bytes"), "must be >= 0 (0: use the fraction)")
        _require(
            0 <= self.kv_cache_memory_fraction <= 1, self._path("kv_cache_memory_fraction"),
            f"must be in [0, 1] (0: the default), got {self.kv_cache_memory_fraction}",
        )
        _require(
            self.prefill_token_budget == 0 or self.prefill_token_budget >= self.max_prompt_length,
            self._path("prefill_token_budget"),
            f"({self.prefill_token_budget}) must be 0 or >= rollout.max_prompt_length ({self.max_prompt_length})",
        )
        _require(self.temperature > 0, self._path("temperature"), "must be > 0 for RL (logprobs are tempered)")
        _require(0 < self.top_p <= 1, self._path("top_p"), f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, self._path("top_k"), "must be >= 0 (0: off)")
        _require(self.steps_per_dispatch >= 1, self._path("steps_per_dispatch"), "must be >= 1")
        _require(
            self.max_prompt_length < self.max_sequence_length,
            self._path("max_prompt_length"),
            f"({self.max_prompt_length}) must be < rollout.max_sequence_length ({self.max_sequence_length})",
        )
        try:
            parse_compiler_options(self.decode_compiler_options)
        except ValueError as e:
            _require(False, self._path("decode_compiler_options"), str(e))
        if self.compilation_cache_dir:
            problem = _unusable_directory(self.compilation_cache_dir)
            _require(problem is None, self._path("compilation_cache_dir"), f"{self.compilation_cache_dir!r} {problem} "
                     "(the engine creates it and writes compiled programs there; '' turns the cache off)")


def parse_compiler_options(text: str) -> dict[str, Any] | None:
    """XLA options written as text (``rollout.decode_compiler_options``, the benches' ``--compiler-options``)
    as `Engine(decode_compiler_options=)`: "" or "default" -> None (the engine's platform default), "none"
    -> {} (XLA's own defaults), "name=value,..." -> a dict (true / false -> bool, numbers -> int or float,
    else the string). ValueError on an item that is not name=value."""
    text = text.strip()
    if text in ("", "default"):
        return None
    if text == "none":
        return {}
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            raise ValueError(f"{item!r} is not name=value (in {text!r}; or 'default', 'none')")
        if value.lower() in ("true", "false"):
            options[name] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                options[name] = kind(value)
                break
            except ValueError:
                pass
        else:
            options[name] = value
    return options


def _unusable_directory(path: str) -> str | None:
    """Why ``path`` cannot be (created as) a writable directory, or None: checked at config load, so a bad
    path fails before the model loads, not when the rollout engine is built."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is not writable"
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"cannot be created: {parent} is not writable"
