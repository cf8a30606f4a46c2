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
from agentrl_jax.models import decode as model_decode
from agentrl_jax.models.decode import DecodeParams
from agentrl_jax.rollout.compile_cache import use_compilation_cache
from agentrl_jax.rollout.decode_step import (
    KERNEL_ATTENTION,
    choose_decode_attention,
    choose_prefill_attention,
    generate_steps,
)
from agentrl_jax.rollout.memory_plan import MemoryPlan, plan_memory
from agentrl_jax.rollout.pages import KVPages, pages_for
from agentrl_jax.rollout.prefill_api import PagedPrefillAPI
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.state import (
    STOP_IDS,
    STOP_SEQUENCES,
    DecodeState,
    attend_bucket,
    decode_state_shardings,
    init_decode_state,
)
from agentrl_jax.rollout.weights import EngineWeights
from agentrl_jax.sharding import Rules, inference_rules, logical_to_spec, make_mesh

logger = logging.getLogger(__name__)

DEFAULT_MEMORY_FRACTION = 0.8  # of the free device memory, for the KV pool, when nothing else is set
# XLA options the decode dispatch compiles with on GPU meshes, when `Engine(decode_compiler_options=)` is None.
# A decode step's weight matmuls have M = the batch (64): XLA's autotuner picks split-K Triton GEMMs for
# them, whose float32 partials the next fusion reads again; cuBLAS measured faster per step at batch 64
# on the 1.7B shape (docs/benchmarks.md, "cuBLAS for the decode step's weight matmuls"). Per program
# (`jax.jit(compiler_options=)`), so the trainer's and the prefill's programs keep XLA's own choice.
GPU_DECODE_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


class Engine(PagedPrefillAPI):
    """Slot-based decoding of a `Decoder` over a paged KV cache on a mesh.

    Args:
      model: the decoder (its graph and config are used; params are passed per call).
      mesh: the device mesh (default: all devices on `data`).
      max_concurrent_decodes: S, the number of decode slots (sequences held at once).
      decode_batch: B, the sequences a decode step computes (its lanes; default S). With B < S,
        a slot admitted while the B lanes are busy waits ready (prefilled, first token sampled)
        and takes the lane of a slot that stops, at the next step, on the device: a slot stops
        there at a stop id or its length limit (`Admission.limit`, `stop_ids`), so a turn that
        ends mid-dispatch leaves no lane idle for the rest of the dispatch or the next one, as
        long as a ready slot waits (`decode_step.lane_decode_step`). B must divide over the
        mesh's data shards like S.
      device_stop_ids: stop token ids per slot that the device checks with decode lanes (a
        request's lowest ones; the host checks them all, so one past this many still ends the
        turn, a dispatch later, as without lanes).
      device_stop_sequences: ``(Q, L)``: with decode lanes, the device also stops a slot whose
        newest tokens are one of its first Q stop strings' token sequences of at most L tokens
        (`StopMatcher.sequences`, from `Driver(tokenize=)`: ReTool's ``</code>`` is several
        tokens). The host checks the same sequences, so both stop at the same token; a stop
        string written with other tokens is found by the host's text check, a dispatch later.
      decode_kernel_programs: the GPU decode kernel ("pallas" attention) splits each row's
        entries into chunks until it runs at least this many (row, kv head, chunk) programs
        per device (a float32 combine joins the chunks). More programs spread rows of ragged
        lengths, and the few rows left at the end of a batch, over the SMs; with rows of one
        length they only add the combine. Default `models.decode.PALLAS_MIN_PROGRAMS` (512),
        twice that with decode lanes (B < S), whose rows are a mix of lengths and drain to a
        few at the end of a batch (docs/benchmarks.md, "Decode kernel chunks": faster on the
        multi-turn workload with lanes, in the batch's tail; slower on a batch of equal
        lengths).
      decode_compiler_options: XLA options (``jax.jit(compiler_options=)``) for the decode
        dispatch programs only, e.g. ``{"xla_gpu_enable_triton_gemm": False}``. Default:
        `GPU_DECODE_COMPILER_OPTIONS` on GPU meshes (cuBLAS for the decode step's skinny weight
        matmuls), none elsewhere; ``{}`` compiles with XLA's defaults.
      max_target_length: M, the longest sequence (prompt + every turn + generated).
      max_prefill_length: the largest prompt chunk one prefill takes.
      min_prefill_bucket: the smallest padded prompt length of JetStream's dense `prefill`
        (`rollout.jetstream.DensePrefixEngine`).
      prefill_row_tokens: C, the width of a packed row of `prefill_insert` (the Driver's
        path): a sequence's new tokens are cut into pieces of C (at most
        ``max_prefill_length``), so it pads less than C tokens and the compiled shapes stay
        few (`paged_prefill`).
      prefill_compaction: run the dense layers of a `prefill_insert` call on its real tokens
        only (padded to a bucket), not on every row's C tokens (`paged_prefill`): the same
        results for less compute, at up to five compiled programs per row bucket instead of one.
        Default: on for GPU and TPU meshes, where a prefill call's cost is its layers' compute;
        off on CPU, where compiling the extra programs costs more than the compute they save.
      cache_dtype: dtype of the KV cache (default: the model's compute dtype).
      rules: logical-axis rule table (default: `inference_rules()`).
      attend_granule: the "xla" decode attention reads a window of the first W entries of
        every slot, W rounded up from the longest live slot (+ the dispatch's steps) in
        steps of at least this many entries (`attend_bucket`); each W compiles once.
      decode_attention: "xla" (gather the window's pages, einsums), "pallas" (the backend's
        Pallas kernel, run per shard, which reads each slot's own entries through its page
        table: on GPU `models.decode_attention`, interpreted off GPU and TPU, for tests; on a
        TPU mesh "pallas_tpu") or "pallas_tpu" (the XLA page write, then the TPU kernel of
        `models.tpu_decode_attention`; off TPU in the TPU interpreter, for tests). Default:
        "pallas" on GPU meshes with a 16-bit compute dtype, a power-of-two head dim and page
        size >= 16 (the kernel's float32 dots would run in TF32, loosening the
        engine/trainer logprob match), and on TPU meshes with a head dim a multiple of 128
        and a page a whole number of the cache dtype's sublane tiles (`tpu_kernel_fits`),
        else "xla".
      prefill_attention: the `prefill_insert` attention: "xla" (each row gathers the call's
        window of pages; einsums) or "pallas" (the Pallas GPU kernel of
        `models.prefill_attention`, run per shard, which reads each row's own entries through
        its page table; interpreted off GPU). Default: "pallas" where the GPU decode default is.
      page_size: P, tokens per KV page.
      num_pages: usable pages over all shards (overrides the byte budget; tests).
      kv_cache_bytes: pool bytes per device.
      kv_cache_memory_fraction: pool bytes as this fraction of the free memory of the
        fullest device, measured when the first decode state is built (after the weights
        are placed). Default `DEFAULT_MEMORY_FRACTION` on devices that report memory.
        With none of the three, and on devices that report no memory (CPU), the pool holds
        every slot at full length. Never more pages than that are made.
      compilation_cache_dir: turn on JAX's persistent compilation cache there, for the whole
        process (`compile_cache.use_compilation_cache`); a restarted run loads its prefill
        and decode programs instead of compiling them again.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        mesh: Mesh | None = None,
        max_concurrent_decodes: int = 8,
        decode_batch: int | None = None,
        device_stop_ids: int = STOP_IDS,
        device_stop_sequences: tuple[int, int] = STOP_SEQUENCES,
        decode_kernel_programs: int | None = None,
        decode_compiler_options: dict[str, Any] | None = None,
        max_target_length: int = 1024,
        max_prefill_length: int = 512,
        min_prefill_bucket: int = 16,
        prefill_row_tokens: int = 64,
        prefill_compaction: bool | None = None,
        cache_dtype: Any = None,
        rules: Rules | None = None,
        attend_granule: int = 256,
        decode_attention: str | None = None,
        prefill_attention: str | None = None,
        page_size: int = 32,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_cache_memory_fraction: float | None = None,
        compilation_cache_dir: str | None = None,
    ):
        _check_sizes(max_concurrent_decodes=max_concurrent_decodes, max_target_length=max_target_length,
                     max_prefill_length=max_prefill_length, min_prefill_bucket=min_prefill_bucket,
                     prefill_row_tokens=prefill_row_tokens,
                     attend_granule=attend_granule, page_size=page_size, num_pages=num_pages,
                     kv_cache_bytes=kv_cache_bytes, kv_cache_memory_fraction=kv_cache_memory_fraction)
        if compilation_cache_dir:
            use_compilation_cache(compilation_cache_dir)
        self._mesh = mesh if mesh is not None else make_mesh({"data": -1})
        if prefill_compaction is None:
            prefill_compaction = all(d.platform in ("gpu", "tpu") for d in self._mesh.devices.flat)
        self.prefill_compaction = prefill_compaction
        decode_attention = choose_decode_attention(decode_attention, model, self._mesh, page_size, cache_dtype)
        self.prefill_attention = choose_prefill_attention(prefill_attention, model, self._mesh, page_size)
        self.config = model.config
        _, abstract = split_params(model)
        self._dtype = model.dtype
        self._attend_granule = attend_granule
        self.decode_attention = decode_attention
        self._rules = rules if rules is not None else inference_rules()
        self._slots = max_concurrent_decodes
        self.max_target_length = max_target_length
        self.page_size = page_size
        self.table_width = pages_for(max_target_length, page_size)
        self._max_prefill = max_prefill_length
        self._min_bucket = min(min_prefill_bucket, max_prefill_length)
        self.prefill_row_tokens = min(prefill_row_tokens, max_prefill_length)
        self.cache_dtype = cache_dtype if cache_dtype is not None else model.dtype
        # the pool's pages are split over the data axes exactly like the slots
        self._rows_spec = logical_to_spec(("slots",), self._rules, shape=(self._slots,), mesh=self._mesh)[0]
        rows_axes = () if self._rows_spec is None else (
            (self._rows_spec,) if isinstance(self._rows_spec, str) else tuple(self._rows_spec))
        self.num_shards = math.prod(self._mesh.shape[a] for a in rows_axes)
        self._slots_per_shard = self._slots // self.num_shards
        self.decode_batch = self._slots if decode_batch is None else decode_batch
        if not 1 <= self.decode_batch <= self._slots or self.decode_batch % self.num_shards:
            raise ValueError(
                f"Engine: decode_batch={decode_batch} must be in [1, max_concurrent_decodes={self._slots}] and a "
                f"multiple of the mesh's {self.num_shards} data shard(s) (each shard's lanes take its own slots)"
            )
        self._admissions = 0  # admission counter: ready slots take free decode lanes in this order
        if device_stop_ids < 1:
            raise ValueError(f"Engine: device_stop_ids must be >= 1, got {device_stop_ids}")
        self.device_stop_ids = device_stop_ids
        if len(device_stop_sequences) != 2 or min(device_stop_sequences) < 1:
            raise ValueError(f"Engine: device_stop_sequences must be (sequences >= 1, tokens >= 1), got "
                             f"{device_stop_sequences}")
        self.device_stop_sequences = tuple(device_stop_sequences)
        if decode_kernel_programs is None:
            # read at construction, so bench/decode.py's --kernel override reaches it
            decode_kernel_programs = model_decode.PALLAS_MIN_PROGRAMS * (2 if self.decode_batch < self._slots else 1)
        if decode_kernel_programs < 1:
            raise ValueError(f"Engine: decode_kernel_programs must be >= 1, got {decode_kernel_programs}")
        self.decode_kernel_programs = decode_kernel_programs
        self.decode_compiler_options = _decode_compiler_options(decode_compiler_options, self._mesh)
        self._budget = (num_pages, kv_cache_bytes, kv_cache_memory_fraction)
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
            step = functools.partial(
                generate_steps, num_steps=num_steps, config=self.config, attend_len=attend_len, dtype=self._dtype,
                truncation=truncation, attention=self.decode_attention, cache_spec=self.state_shardings.cache.k[0].spec,
                mesh=self._mesh, max_length=self.max_target_length, shards=self.num_shards,
                kernel_programs=self.decode_kernel_programs,
            )
            self._generate_fns[key] = jax.jit(step, donate_argnums=(1,), out_shardings=(self.state_shardings, None),
                                              compiler_options=self.decode_compiler_options or None)
        return self._generate_fns[key]

    def attend_window(self, decode_state: DecodeState | None = None, num_steps: int = 1) -> int:
        """The "xla" attention window W for `num_steps` steps (see `generate`): whole pages
        covering the longest live slot's length bound + the steps."""
        longest = self.pages.longest() if self.pages is not None else 0
        window = attend_bucket(longest + num_steps, self.max_target_length, self._attend_granule)
        return min(pages_for(window, self.page_size), self.table_width) * self.page_size


def _decode_compiler_options(options: dict[str, Any] | None, mesh: Mesh) -> dict[str, Any]:
    """`Engine(decode_compiler_options=)` checked, or the platform's default (`GPU_DECODE_COMPILER_OPTIONS`)."""
    if options is None:
        on_gpu = all(d.platform == "gpu" for d in mesh.devices.flat)
        return dict(GPU_DECODE_COMPILER_OPTIONS) if on_gpu else {}
    if not isinstance(options, dict) or not all(
            isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in options.items()):
        raise ValueError(f"Engine: decode_compiler_options must be a dict of XLA option name -> bool, number or "
                         f"string, got {options!r}")
    if options:  # an unknown name or a bad value fails here, not at the first decode's compile
        probe = jax.jit(lambda x: x + 1, compiler_options=options)
        device = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])  # the mesh's backend
        try:
            probe.lower(jax.ShapeDtypeStruct((1,), jnp.int32, sharding=device)).compile()
        except jax.errors.JaxRuntimeError as e:
            raise ValueError(f"Engine: decode_compiler_options={options!r}: {e}") from e
    return dict(options)


def _check_sizes(*, num_pages, kv_cache_bytes, kv_cache_memory_fraction, **sizes) -> None:
    """ValueError naming the first `Engine` argument out of range."""
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"Engine: {name} must be >= 1, got {value}")
    if num_pages is not None and num_pages < 1:
        raise ValueError(f"Engine: num_pages must be >= 1, got {num_pages}")
    if kv_cache_bytes is not None and kv_cache_bytes < 1:
        raise ValueError(f"Engine: kv_cache_bytes must be >= 1, got {kv_cache_bytes}")
    if kv_cache_memory_fraction is not None and not 0 < kv_cache_memory_fraction <= 1:
        raise ValueError(f"Engine: kv_cache_memory_fraction must be in (0, 1], got {kv_cache_memory_fraction}")
