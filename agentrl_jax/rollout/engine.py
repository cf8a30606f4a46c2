"""The rollout engine: slot-based decoding over a paged KV cache, on a mesh.

KV memory is paged (`rollout.state`, `rollout.pages`): per layer a pool of fixed-size
pages ``[N, KV, P, K]``, per slot a page table. `KVPages` (``engine.pages``, one per
decode state) is the host side's one owner of them: free lists and reference counts, each
slot's pages, the prefix cache. The budget, in bytes or as a fraction of free device
memory, is turned into pages and logged as a memory plan (`rollout.memory_plan`) when the
first decode state is built.

- `prefill_insert` (`prefill_api`, the `Driver`'s path) prefills many sequences' new
  tokens straight into their pages in one call and fills their slots (sessions keep
  their pages across turns, a group's prompt is prefilled once with its pages shared).
- `generate` first gives every live slot the pages its next tokens need, then decodes:
  each slot writes its new k/v through its page table and attends over its own pages.
  With `num_steps=N` it runs N steps inside one jitted `lax.fori_loop` and returns [N, S]
  results (stop checks happen on the host; with decode lanes the device stops too).
- `free_resource` returns a slot's pages; without the decode state the device-side
  deactivation is deferred to the next call (frees are batched).

Pages and slots are split over the mesh's data axes alike: a slot only uses pages of its
own shard, so attention and cache writes stay on the device (`shard_map`). JetStream's
dense-prefix calls (`prefill` -> `insert`, the API MaxText's MaxEngine implements) are in
the optional `rollout.jetstream` package (`DensePrefixEngine`), which this module does not
import.

The model runs through `agentrl_jax.models.decode.forward`, not the trainer's layer scan:
`load_params` re-lays the weights out once per update (`rollout.weights`; `DecodeParams`:
one dict per layer, fused QKV and gate/up). The traced bodies live next to their inputs:
`decode_step` (generate), `paged_prefill` (prefill_insert); every token is sampled by
`sampling.sample_next_token`. A decode step's attention reads only filled entries: the
pages of a window of the first W entries (W bucketed by `attend_bucket`, a few compiles)
with the "xla" attention, or each slot's own entries with our Pallas GPU kernel
("pallas", the default on GPU), which also finishes the QKV projection, applies QK-norm
and RoPE and writes the cache.

All state is sharded on the mesh with the inference rule table (kv heads over `tensor`,
slots and pages over the data axes, weights with tensor parallelism only) and is donated
through every jitted call. The Driver's prefill calls take one of a closed set of shapes
(`paged_prefill`), compiled at `warmup`; slot indices, lengths, page tables and sampling
parameters are arrays, so none of them recompiles anything.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation
from jax.sharding import Mesh

from agentrl_jax.models import Decoder, split_params
from agentrl_jax.models.decode import AttentionPlan, DecodeParams
from agentrl_jax.rollout.compile_cache import use_compilation_cache
from agentrl_jax.rollout.decode_step import (
    KERNEL_ATTENTION,
    choose_decode_attention,
    choose_prefill_attention,
    generate_steps,
)
from agentrl_jax.rollout.engine_config import DEFAULT_MEMORY_FRACTION, EngineConfig, decode_compiler_options
from agentrl_jax.rollout.memory_plan import MemoryPlan, plan_memory
from agentrl_jax.rollout.pages import KVPages, pages_for
from agentrl_jax.rollout.prefill_api import PagedPrefillAPI
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.state import (
    DecodeState,
    attend_bucket,
    decode_state_shardings,
    init_decode_state,
)
from agentrl_jax.rollout.weights import EngineWeights
from agentrl_jax.sharding import Rules, inference_rules, logical_to_spec, make_mesh

logger = logging.getLogger(__name__)



class Engine(PagedPrefillAPI):
    """Slot-based decoding of a `Decoder` over a paged KV cache on a mesh.

    Args:
      model: the decoder (its graph and config are used; params are passed per call).
      engine_config: the engine's settings (`EngineConfig`; a run's: `EngineConfig.from_rollout`).
      mesh: the device mesh (default: all devices on `data`).
      rules: logical-axis rule table (default: `inference_rules()`).
      **settings: `EngineConfig` fields, replacing ``engine_config``'s (tests and benchmarks build
        engines with ``Engine(model, mesh=..., max_concurrent_decodes=4, ...)``).
    """

    def __init__(self, model: Decoder, engine_config: EngineConfig | None = None, *, mesh: Mesh | None = None,
                 rules: Rules | None = None, **settings):
        cfg = dataclasses.replace(engine_config or EngineConfig(), **settings)
        self.engine_config = cfg
        if cfg.compilation_cache_dir:
            use_compilation_cache(cfg.compilation_cache_dir)
        self._mesh = mesh if mesh is not None else make_mesh({"data": -1})
        self.prefill_compaction = cfg.prefill_compaction
        if self.prefill_compaction is None:
            self.prefill_compaction = all(d.platform in ("gpu", "tpu") for d in self._mesh.devices.flat)
        decode_attention = choose_decode_attention(cfg.decode_attention, model, self._mesh, cfg.page_size,
                                                   cfg.cache_dtype)
        self.prefill_attention = choose_prefill_attention(cfg.prefill_attention, model, self._mesh, cfg.page_size)
        self.config = model.config
        _, abstract = split_params(model)
        self._dtype = model.dtype
        self._attend_granule = cfg.attend_granule
        self.decode_attention = decode_attention
        self._rules = rules if rules is not None else inference_rules()
        self._slots = cfg.max_concurrent_decodes
        self.max_target_length = cfg.max_target_length
        self.page_size = cfg.page_size
        self.table_width = pages_for(cfg.max_target_length, cfg.page_size)
        self._max_prefill = cfg.max_prefill_length
        self._min_bucket = min(cfg.min_prefill_bucket, cfg.max_prefill_length)
        self.prefill_row_tokens = min(cfg.prefill_row_tokens, cfg.max_prefill_length)
        self.cache_dtype = cfg.cache_dtype if cfg.cache_dtype is not None else model.dtype
        # the pool's pages are split over the data axes exactly like the slots
        self._rows_spec = logical_to_spec(("slots",), self._rules, shape=(self._slots,), mesh=self._mesh)[0]
        rows_axes = () if self._rows_spec is None else (
            (self._rows_spec,) if isinstance(self._rows_spec, str) else tuple(self._rows_spec))
        self.num_shards = math.prod(self._mesh.shape[a] for a in rows_axes)
        self._slots_per_shard = self._slots // self.num_shards
        self.decode_batch = self._slots if cfg.decode_batch is None else cfg.decode_batch
        if not 1 <= self.decode_batch <= self._slots or self.decode_batch % self.num_shards:
            raise ValueError(
                f"Engine: decode_batch={cfg.decode_batch} must be in [1, max_concurrent_decodes={self._slots}] and a "
                f"multiple of the mesh's {self.num_shards} data shard(s) (each shard's lanes take its own slots)"
            )
        self._admissions = 0  # admission counter: ready slots take free decode lanes in this order
        self.device_stop_ids = cfg.device_stop_ids
        self.device_stop_sequences = cfg.device_stop_sequences
        self.decode_kernel_programs = cfg.decode_kernel_programs
        if self.decode_kernel_programs is None:
            self.decode_kernel_programs = cfg.decode_kernel.min_programs * (2 if self.decode_batch < self._slots else 1)
        self.decode_kernel = dataclasses.replace(cfg.decode_kernel, min_programs=self.decode_kernel_programs)
        self.decode_compiler_options = decode_compiler_options(cfg.decode_compiler_options, self._mesh)
        self._budget = (cfg.num_pages, cfg.kv_cache_bytes, cfg.kv_cache_memory_fraction)
        # Weights are stored in the compute dtype: `models.decode.forward` casts every weight to it
        # before use, so casting once at load gives the same values and halves the bytes a decode
        # step reads when the trainer keeps float32 master params. The output embedding stays in
        # the param dtype unless the logits matmul runs in the compute dtype (`lm_head_dtype`).
        output_dtype = model.dtype if model.lm_head_dtype == "compute" else model.param_dtype
        self._weights = EngineWeights(self.config, abstract, self._mesh, self._rules, model.dtype, output_dtype)
        self.param_shardings = self._weights.param_shardings
        self.decode_param_shardings = self._weights.decode_param_shardings
        self.memory_plan: MemoryPlan | None = None
        self.pages: KVPages | None = None  # the page pool's one owner, made with each decode state
        self.decode_plan: AttentionPlan | None = None  # the decode and prefill attentions, made with the pool's plan
        self.prefill_plan: AttentionPlan | None = None
        self.state_shardings: DecodeState | None = None
        self._generate_fns: dict[tuple[int | None, int, bool], Any] = {}  # (steps, window, truncation)
        self._paged_prefill_fns: dict[tuple, Any] = {}
        self._copy_fns: dict[int, Any] = {}

    # ---- JetStream properties -------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    # ---- params -------------------------------------------------------------------------

    def load_params(self, params: nnx.State | Decoder | DecodeParams, *, dtype: Any = None) -> DecodeParams:
        """The engine's copy of the weights: `DecodeParams` (per-layer, fused QKV and gate/up).

        Accepts an `nnx.State` of `nnx.Param` or a `Decoder` (the trainer's stacked layout),
        or `DecodeParams`. Floating leaves are cast to `dtype` (default: the model's compute
        dtype, in which the decode forward uses every weight anyway; the output embedding keeps
        the param dtype unless ``lm_head_dtype="compute"``), placed with `jax.device_put` in the
        inference sharding (weights coming from the trainer's sharding never visit the host),
        then re-laid out on the device. The result is a new buffer: the caller's params are
        never donated.
        """
        return self._weights.load(params, dtype)

    # ---- the page pool ------------------------------------------------------------------

    def _plan(self) -> MemoryPlan:
        """Turn the budget into pages per shard (once), log the plan, build the state's shardings."""
        if self.memory_plan is not None:
            return self.memory_plan
        cfg, P = self.config, self.page_size
        bytes_per_page = 2 * cfg.num_layers * cfg.num_kv_heads * P * cfg.head_dim * jnp.dtype(self.cache_dtype).itemsize
        heads = logical_to_spec(("kv_heads",), self._rules, shape=(cfg.num_kv_heads,), mesh=self._mesh)[0]
        heads = () if heads is None else ((heads,) if isinstance(heads, str) else tuple(heads))
        plan = plan_memory(
            bytes_per_page=bytes_per_page,
            per_device_page=bytes_per_page // math.prod(self._mesh.shape[a] for a in heads),
            num_shards=self.num_shards, slots_per_shard=self._slots_per_shard, table_width=self.table_width,
            page_size=P, smallest_sequence=min(self._max_prefill, self.max_target_length - 1) + 1,
            budget=self._budget, devices=list(self._mesh.devices.flat), default_fraction=DEFAULT_MEMORY_FRACTION,
            max_concurrent=self._slots, max_target_length=self.max_target_length,
            replicated_over_data=self._rows_spec is None,
        )
        logger.info("%s", plan.describe())
        num_pages = self.num_shards * plan.pages_per_shard
        self.state_shardings = decode_state_shardings(
            self.config, self._slots, num_pages, P, self.table_width, self.cache_dtype, self._mesh, self._rules,
            lanes=self.decode_batch, stop_ids=self.device_stop_ids, stop_seqs=self.device_stop_sequences,
        )
        make = functools.partial(
            init_decode_state, self.config, self._slots, num_pages, P, self.table_width, self.cache_dtype,
            lanes=self.decode_batch, stop_ids=self.device_stop_ids, stop_seqs=self.device_stop_sequences,
        )
        self._init_state = jax.jit(make, out_shardings=self.state_shardings)
        # the programs' attentions, chosen once: they run per shard of the cache's sharding, known from here
        cache_spec = self.state_shardings.cache.k[0].spec
        self.decode_plan = AttentionPlan(self.config, self._dtype, self.decode_attention, kernel=self.decode_kernel,
                                         mesh=self._mesh, cache_spec=cache_spec)
        self.prefill_plan = AttentionPlan(self.config, self._dtype, prefill_attention=self.prefill_attention,
                                          mesh=self._mesh, cache_spec=cache_spec)
        self._deactivate = jax.jit(
            lambda state, slots: state.replace(active=state.active.at[slots].set(False, mode="drop")),
            donate_argnums=(0,), out_shardings=self.state_shardings,
        )
        self.memory_plan = plan
        return plan

    def compiled_programs(self) -> int:
        """Programs the paged rollout path has compiled so far: prefill shapes, page copies, decode
        dispatches and slot frees. It stays constant after `warmup` when warm-up covered every
        shape a run meets (``rollout/engine/compiled_programs`` in the trainer's metrics)."""
        fns = [*self._paged_prefill_fns.values(), *self._copy_fns.values(), *self._generate_fns.values()]
        if self.memory_plan is not None:
            fns.append(self._deactivate)
        # a jitted function's count of compiled signatures (private in jax; one per function if it goes)
        return sum(fn._cache_size() if hasattr(fn, "_cache_size") else 1 for fn in fns)

    def init_decode_state(self) -> DecodeState:
        """All slots free and every page free, materialized directly in the decode-state sharding.

        The engine keeps one decode state: a new one starts a new `KVPages` (every page free).
        """
        plan = self._plan()
        self.pages = KVPages(plan.num_shards, plan.pages_per_shard, num_slots=self._slots,
                             table_width=self.table_width, page_size=self.page_size,
                             max_length=self.max_target_length)
        return self._init_state()

    def shard_of(self, slot: int) -> int:
        """The data shard whose pages `slot` uses."""
        return slot // self._slots_per_shard

    def shard_slots(self, shard: int) -> range:
        return range(shard * self._slots_per_shard, (shard + 1) * self._slots_per_shard)

    def _sync(self, state: DecodeState) -> DecodeState:
        """Apply the host's pending slot frees (one call) and page-table changes (one upload)."""
        with TraceAnnotation("engine/sync"):
            slots = self.pages.take_deactivations()
            if slots:
                state = self._deactivate(state, np.asarray(slots, np.int32))
            if self.pages.dirty:
                # a copy: the host edits its table while calls queued with the uploaded one may not have run
                # (the transfer can read the host buffer later, or alias it on CPU), e.g. a slot retired while
                # the dispatch that writes its last tokens is in flight
                table = self.pages.table.copy()
                state = state.replace(page_table=jax.device_put(table, self.state_shardings.page_table))
                self.pages.dirty = False
            return state

    def free_resource(self, slot: int, decode_state: DecodeState | None = None) -> DecodeState | None:
        """Release `slot` and its pages (JetStream API).

        Without the decode state the slot is deactivated on the device by the next engine
        call that takes the state (frees are batched into one call per tick).
        """
        self.pages.release_slot(slot)
        return None if decode_state is None else self._sync(decode_state)

    # ---- generate ---------------------------------------------------------------------

    def generate(
        self,
        params: DecodeParams,
        decode_state: DecodeState,
        *,
        num_steps: int | None = None,
        attend_len: int | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot ([S] results), or `num_steps` steps in one dispatch ([N, S]).

        With ``decode_batch`` B < S a step computes B lanes and a slot without one has valid = 0
        (`decode_step.lane_decode_step`); results are per slot all the same. The decode state
        is donated. Every live slot first gets the pages its new tokens need (`reserve`;
        OutOfPages when a shard has too few: the `Driver` preempts before that happens). A slot
        stops advancing (valid = 0) once it is inactive or at `max_target_length` (with lanes
        also at its device-side stops and limit); every other stop condition is checked by the
        caller.

        With the "xla" attention every slot reads the pages of the first W entries, W =
        `attend_window` (from the host's length bounds: no device read). A caller may pass
        `attend_len` (any value >= that bound; smaller values give wrong results for the
        longer slots). With a kernel ("pallas", "pallas_tpu") there is no window (the kernel
        stops at each slot's length) and `attend_len` is ignored.
        """
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"generate: num_steps must be >= 1, got {num_steps}")
        steps = 1 if num_steps is None else num_steps
        with TraceAnnotation("engine/reserve"):
            for slot in self.pages.live_slots():
                self.pages.reserve(slot, steps)
        if self.decode_attention in KERNEL_ATTENTION:
            attend_len = self.table_width * self.page_size  # the kernel bounds each slot's reads by its length
        elif attend_len is None:
            attend_len = self.attend_window(decode_state, steps)
        elif not 0 < attend_len <= self.max_target_length:
            raise ValueError(f"generate: attend_len={attend_len} must be in [1, {self.max_target_length}]")
        decode_state = self._sync(decode_state)
        with TraceAnnotation("engine/launch"):
            out = self._dispatch(params, decode_state, num_steps, attend_len, self.pages.any_truncating())
        self.pages.advance(steps)
        return out

    def _dispatch(self, params: DecodeParams, decode_state: DecodeState, num_steps: int | None, attend_len: int,
                  truncation: bool):
        return self._generate_fn(num_steps, attend_len, truncation)(params, decode_state)

    def _generate_fn(self, num_steps: int | None, attend_len: int, truncation: bool):
        """The jitted decode dispatch (compiled at its first call); ``truncation``: with the top-k /
        top-p sampling path (`sampling.sample`), for dispatches in which a live slot truncates."""
        key = (num_steps, attend_len, truncation)
        if key not in self._generate_fns:
            step = functools.partial(generate_steps, num_steps=num_steps, plan=self.decode_plan, attend_len=attend_len,
                                     max_length=self.max_target_length, truncation=truncation, shards=self.num_shards)
            self._generate_fns[key] = jax.jit(step, donate_argnums=(1,), out_shardings=(self.state_shardings, None),
                                              compiler_options=self.decode_compiler_options or None)
        return self._generate_fns[key]

    def attend_window(self, decode_state: DecodeState | None = None, num_steps: int = 1) -> int:
        """The "xla" attention window W for `num_steps` steps (see `generate`): whole pages
        covering the longest live slot's length bound + the steps."""
        longest = self.pages.longest() if self.pages is not None else 0
        window = attend_bucket(longest + num_steps, self.max_target_length, self._attend_granule)
        return min(pages_for(window, self.page_size), self.table_width) * self.page_size
