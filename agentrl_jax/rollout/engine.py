"""The rollout engine: JetStream's Engine API (prefill -> insert -> generate over slots) over a paged KV cache.

JetStream (AI-Hypercomputer/JetStream) defined the interface that MaxText's MaxEngine
implements; this class has the same method names and argument shapes (newest version:
keyword-only `prefill` with `existing_prefix`, `bulk_insert` for one prefill into G slots)
without importing `jetstream`.

KV memory is paged (`rollout.state`, `rollout.pages`): per layer a pool of fixed-size
pages ``[N, KV, P, K]``, per slot a page table, a host allocator with reference counts, and
a budget in bytes or as a fraction of free device memory, turned into pages and logged as
a memory plan when the first decode state is built. How pages map onto the JetStream calls:

- `prefill` runs a prompt (or a continuation of an `existing_prefix`) into a dense,
  batch-1 KV row outside the pool (JetStream's prefill takes no decode state) and samples
  the first token(s).
- `insert` / `bulk_insert` allocate the slot's pages and copy the row in; the G slots of a
  `bulk_insert` share the prompt's full pages and each own a copy of the last partial page.
- `generate` first gives every live slot the pages its next tokens need, then decodes:
  each slot writes its new k/v through its page table and attends over its own pages.
  With `num_steps=N` it runs N steps inside one jitted `lax.fori_loop` and returns [N, S]
  results (stop checks happen on the host).
- `free_resource` returns a slot's pages; without the decode state the device-side
  deactivation is deferred to the next call (frees are batched).

The `Driver` uses the paged path directly: `prefill_insert` prefills many sequences' new
tokens straight into their pages in one call and fills their slots (sessions keep their
pages across turns, a group's prompt is prefilled once with its pages shared), and
`assign_slot` / `release_slot` / `reserve` move pages between slots, sessions and the
free list. Pages and slots are split over the mesh's data axes alike: a slot only uses
pages of its own shard, so attention and cache writes stay on the device (`shard_map`).

The model runs through `agentrl_jax.models.decode.forward`, not the trainer's layer scan:
`load_params` re-lays the weights out once per update (`DecodeParams`: one dict per layer,
fused QKV and gate/up). A decode step's attention reads only filled entries: the pages of
a window of the first W entries (W bucketed by `attend_bucket`, a few compiles) with the
"xla" attention, or each slot's own entries with our Pallas GPU kernel ("pallas", the
default on GPU), which also finishes the QKV projection, applies QK-norm and RoPE and
writes the cache.

All state is sharded on the mesh with the inference rule table (kv heads over `tensor`,
slots and pages over the data axes, weights with tensor parallelism only) and is donated
through every jitted call. Prompt chunks are padded to power-of-two buckets; slot
indices, lengths, page tables and sampling parameters are arrays, so none of them
recompiles anything.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from agentrl_jax.models import Decoder, param_shardings, split_params
from agentrl_jax.models.decode import (
    DecodeParams,
    LayerCache,
    decode_params_axes,
    forward,
    to_decode_params,
)
from agentrl_jax.rollout.pages import (
    TRASH_PAGE,
    MemoryPlan,
    OutOfPages,
    PageAllocator,
    free_device_bytes,
    pages_for,
)
from agentrl_jax.rollout.result_tokens import ResultTokens
from agentrl_jax.rollout.sampling import (
    SamplingParams,
    SlotSampling,
    next_token_logits,
    request_key,
    sample,
    step_keys,
)
from agentrl_jax.rollout.state import (
    DecodeState,
    Prefix,
    attend_bucket,
    decode_state_shardings,
    init_decode_state,
    prefill_bucket,
    prefix_shardings,
)
from agentrl_jax.sharding import Rules, inference_rules, logical_to_spec, make_mesh, tree_shardings

logger = logging.getLogger(__name__)

DECODE_ATTENTION = ("xla", "pallas")
DEFAULT_MEMORY_FRACTION = 0.8  # of the free device memory, for the KV pool, when nothing else is set


@dataclasses.dataclass
class Admission:
    """A decode slot filled from a `PrefillRow` (see `Engine.prefill_insert`).

    Attributes:
      slot: the slot (in the row's shard).
      pages: the slot's page table; the slot takes over one reference to each page.
      key: [2] uint32, the request's key (`request_key(seed, sample)`).
      generated: tokens this sample has sampled before (the fold-in index of the next one).
      sampling: its sampling parameters.
      forced_token: >= 0 to feed this (already sampled) token instead of sampling one: a
        preempted sequence resuming.
    """

    slot: int
    pages: Sequence[int]
    key: np.ndarray
    generated: int
    sampling: SamplingParams
    forced_token: int = -1


@dataclasses.dataclass
class PrefillRow:
    """New tokens of one sequence, written into its pages by `Engine.prefill_insert`.

    Attributes:
      shard: the data shard that owns ``pages``.
      pages: local page ids covering entries ``[0, start + len(tokens))``.
      start: entries already in the pages (earlier turns, a shared prompt).
      tokens: the new tokens (at most ``max_prefill_length``).
      admissions: slots to fill from this row's last position (none for a middle chunk).
      copies: ``(src, dst)`` pages of the shard to copy after the write (copy-on-write).
    """

    shard: int
    pages: Sequence[int]
    start: int
    tokens: np.ndarray
    admissions: list[Admission] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _resize_row(cache: LayerCache, capacity: int) -> LayerCache:
    """Keep the first `capacity` entries of a cache row, zero-padding when it is shorter."""

    def one(x):
        have = x.shape[2]
        if have >= capacity:
            return x[:, :, :capacity]
        return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - have), (0, 0)))

    return cache.map(one)


class Engine:
    """Slot-based decoding of a `Decoder` over a paged KV cache on a mesh.

    Args:
      model: the decoder (its graph and config are used; params are passed per call).
      mesh: the device mesh (default: all devices on `data`).
      max_concurrent_decodes: S, the number of decode slots.
      max_target_length: M, the longest sequence (prompt + every turn + generated).
      max_prefill_length: the largest prompt chunk one prefill takes.
      min_prefill_bucket: the smallest padded prefill length.
      cache_dtype: dtype of the KV cache (default: the model's compute dtype).
      rules: logical-axis rule table (default: `inference_rules()`).
      attend_granule: the "xla" decode attention reads a window of the first W entries of
        every slot, W rounded up from the longest live slot (+ the dispatch's steps) in
        steps of at least this many entries (`attend_bucket`); each W compiles once.
      decode_attention: "xla" (gather the window's pages, einsums) or "pallas" (the Pallas
        GPU kernel of `models.decode_attention`, run per shard, which reads each slot's
        own entries through its page table; elsewhere than on GPU it runs interpreted, for
        tests). Default: "pallas" on GPU meshes with a 16-bit compute dtype, a power-of-two
        head dim and page size >= 16, else "xla" (the kernel's float32 dots would run in
        TF32, loosening the engine/trainer logprob match).
      page_size: P, tokens per KV page.
      num_pages: usable pages over all shards (overrides the byte budget; tests).
      kv_cache_bytes: pool bytes per device.
      kv_cache_memory_fraction: pool bytes as this fraction of the free memory of the
        fullest device, measured when the first decode state is built (after the weights
        are placed). Default `DEFAULT_MEMORY_FRACTION` on devices that report memory.
        With none of the three, and on devices that report no memory (CPU), the pool holds
        every slot at full length. Never more pages than that are made.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        mesh: Mesh | None = None,
        max_concurrent_decodes: int = 8,
        max_target_length: int = 1024,
        max_prefill_length: int = 512,
        min_prefill_bucket: int = 16,
        cache_dtype: Any = None,
        rules: Rules | None = None,
        attend_granule: int = 256,
        decode_attention: str | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        kv_cache_memory_fraction: float | None = None,
    ):
        for name, value in (
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_target_length", max_target_length),
            ("max_prefill_length", max_prefill_length),
            ("min_prefill_bucket", min_prefill_bucket),
            ("attend_granule", attend_granule),
            ("page_size", page_size),
        ):
            if value < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {value}")
        if num_pages is not None and num_pages < 1:
            raise ValueError(f"Engine: num_pages must be >= 1, got {num_pages}")
        if kv_cache_bytes is not None and kv_cache_bytes < 1:
            raise ValueError(f"Engine: kv_cache_bytes must be >= 1, got {kv_cache_bytes}")
        if kv_cache_memory_fraction is not None and not 0 < kv_cache_memory_fraction <= 1:
            raise ValueError(f"Engine: kv_cache_memory_fraction must be in (0, 1], got {kv_cache_memory_fraction}")
        self._mesh = mesh if mesh is not None else make_mesh({"data": -1})
        kernel_pages = page_size >= 16 and page_size & (page_size - 1) == 0
        if decode_attention is None:
            on_gpu = all(d.platform == "gpu" for d in self._mesh.devices.flat)
            head_dim = model.config.head_dim
            kernel_fits = head_dim >= 16 and head_dim & (head_dim - 1) == 0  # Triton blocks: powers of two
            fits = on_gpu and jnp.dtype(model.dtype).itemsize == 2 and kernel_fits and kernel_pages
            decode_attention = "pallas" if fits else "xla"
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"Engine: decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if decode_attention == "pallas" and not kernel_pages:
            raise ValueError(
                f"Engine: page_size={page_size} does not suit the pallas decode attention (it reads pages in "
                "blocks of a power of two >= 16); use such a page size or decode_attention='xla'"
            )
        self.config = model.config
        _, abstract = split_params(model)
        self._param_dtype = model.param_dtype
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
        self.cache_dtype = cache_dtype if cache_dtype is not None else model.dtype
        # the pool's pages are split over the data axes exactly like the slots
        self._rows_spec = logical_to_spec(("slots",), self._rules, shape=(self._slots,), mesh=self._mesh)[0]
        rows_axes = () if self._rows_spec is None else (
            (self._rows_spec,) if isinstance(self._rows_spec, str) else tuple(self._rows_spec))
        self.num_shards = math.prod(self._mesh.shape[a] for a in rows_axes)
        self._slots_per_shard = self._slots // self.num_shards
        self._budget = (num_pages, kv_cache_bytes, kv_cache_memory_fraction)
        self.param_shardings = param_shardings(abstract, self._mesh, self._rules)
        self._reshard: dict[Any, Any] = {}
        layout = jax.eval_shape(functools.partial(to_decode_params, self.config), abstract)
        self.decode_param_shardings = tree_shardings(
            decode_params_axes(self.config), self._mesh, self._rules, shapes=layout
        )
        self._to_decode_params = jax.jit(
            functools.partial(to_decode_params, self.config), out_shardings=self.decode_param_shardings
        )
        self.memory_plan: MemoryPlan | None = None
        self.pages: PageAllocator | None = None
        self.state_shardings: DecodeState | None = None
        self._generate_fns: dict[tuple[int | None, int], Any] = {}
        self._prefill_fns: dict[tuple, Any] = {}
        self._paged_prefill_fns: dict[tuple, Any] = {}
        self._insert_fns: dict[int, Any] = {}
        self._extract_fns: dict[int, Any] = {}
        self._reset_slots()

    # ---- JetStream properties -------------------------------------------------------

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

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
        or `DecodeParams`. Floating leaves are cast to `dtype` (default: the model's param
        dtype), placed with `jax.device_put` in the inference sharding (weights coming from
        the trainer's sharding never visit the host), then re-laid out on the device. The
        result is a new buffer: the caller's params are never donated.
        """
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        dtype = dtype if dtype is not None else self._param_dtype

        def cast(x):
            return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

        if isinstance(params, DecodeParams):
            return jax.device_put(jax.tree.map(cast, params), self.decode_param_shardings)
        return self._to_decode_params(self._place(params, cast, dtype))

    def _place(self, params: nnx.State, cast, dtype) -> nnx.State:
        """``params`` cast and in the inference sharding.

        Arrays already on the engine's devices are resharded by a jitted identity with
        ``out_shardings`` (on-device collectives: 0.018 s for Qwen3-1.7B in float32 on 2
        H200s, where ``jax.device_put`` between the two shardings took 0.89 s;
        bench/weight_sync.py). Anything else (host arrays, other devices) goes through
        ``jax.device_put``, a device-to-device copy between devices.
        """
        mesh_devices = set(self._mesh.devices.flat)
        leaves = jax.tree.leaves(params)
        if leaves and all(isinstance(x, jax.Array) and set(x.sharding.device_set) == mesh_devices for x in leaves):
            key = jnp.dtype(dtype)
            if key not in self._reshard:
                self._reshard[key] = jax.jit(lambda tree: jax.tree.map(cast, tree), out_shardings=self.param_shardings)
            return self._reshard[key](params)
        return jax.device_put(jax.tree.map(cast, params), self.param_shardings)

    # ---- the page pool ------------------------------------------------------------------

    def _plan(self) -> MemoryPlan:
        """Turn the budget into pages per shard (once), log the plan, build the state's shardings."""
        if self.memory_plan is not None:
            return self.memory_plan
        cfg, P = self.config, self.page_size
        bytes_per_page = 2 * cfg.num_layers * cfg.num_kv_heads * P * cfg.head_dim * jnp.dtype(self.cache_dtype).itemsize
        heads = logical_to_spec(("kv_heads",), self._rules, shape=(cfg.num_kv_heads,), mesh=self._mesh)[0]
        heads = () if heads is None else ((heads,) if isinstance(heads, str) else tuple(heads))
        per_device_page = bytes_per_page // math.prod(self._mesh.shape[a] for a in heads)
        full = self._slots_per_shard * self.table_width + 1  # every slot at full length, plus the trash page
        num_pages, kv_bytes, fraction = self._budget
        if num_pages is not None:
            per_shard, source = -(-num_pages // self.num_shards) + 1, f"num_pages={num_pages}"
        elif kv_bytes is not None:
            per_shard, source = kv_bytes // per_device_page, f"kv_cache_bytes={kv_bytes:,}"
        else:
            free = free_device_bytes(list(self._mesh.devices.flat))
            if free is None:
                per_shard, source = full, "the default (devices report no free memory): slots x max length"
            else:
                fraction = DEFAULT_MEMORY_FRACTION if fraction is None else fraction
                per_shard = min(full, int(fraction * free) // per_device_page)
                source = f"kv_cache_memory_fraction={fraction:g} of {free / 2**30:.2f} GiB free"
        per_shard = min(per_shard, full)
        smallest = pages_for(min(self._max_prefill, self.max_target_length - 1) + 1, P)
        if per_shard - 1 < smallest:
            raise ValueError(
                f"Engine: the KV budget ({source}) gives {max(per_shard - 1, 0)} pages of {P} tokens per shard; "
                f"one prompt chunk of max_prefill_length={self._max_prefill} needs {smallest}. Raise "
                "rollout.kv_cache_bytes or rollout.kv_cache_memory_fraction, or lower rollout.page_size / "
                "rollout.max_prompt_length"
            )
        if per_shard - 1 < self._slots_per_shard:
            logger.warning(
                "KV budget: %d pages per shard for %d slots per shard; at most %d sequences can hold a page at "
                "once (rollout.max_concurrent is higher than the budget allows)",
                per_shard - 1, self._slots_per_shard, per_shard - 1,
            )
        self.memory_plan = MemoryPlan(
            page_size=P, bytes_per_page=bytes_per_page, num_shards=self.num_shards, pages_per_shard=per_shard,
            bytes_per_device=per_shard * per_device_page * (self.num_shards if self._rows_spec is None else 1),
            source=source, max_concurrent=self._slots, max_target_length=self.max_target_length,
        )
        logger.info("%s", self.memory_plan.describe())
        self.state_shardings = decode_state_shardings(
            self.config, self._slots, self.num_shards * per_shard, P, self.table_width, self.cache_dtype,
            self._mesh, self._rules,
        )
        make = functools.partial(
            init_decode_state, self.config, self._slots, self.num_shards * per_shard, P, self.table_width,
            self.cache_dtype,
        )
        self._init_state = jax.jit(make, out_shardings=self.state_shardings)
        self._deactivate = jax.jit(
            lambda state, slots: state.replace(active=state.active.at[slots].set(False, mode="drop")),
            donate_argnums=(0,), out_shardings=self.state_shardings,
        )
        return self.memory_plan

    def _reset_slots(self) -> None:
        """Host mirrors of the slots: page lists, table rows, length bounds (all free)."""
        self._slot_pages: list[list[int]] = [[] for _ in range(self._slots)]
        self._table = np.zeros((self._slots, self.table_width), np.int32)
        self._slot_bound = np.zeros((self._slots,), np.int64)  # >= the slot's length on the device
        self._live = np.zeros((self._slots,), bool)
        self._to_deactivate: set[int] = set()
        self._table_dirty = False

    def init_decode_state(self) -> DecodeState:
        """All slots free and every page free, materialized directly in the decode-state sharding.

        The engine keeps one decode state: a new one resets the page allocator.
        """
        plan = self._plan()
        self.pages = PageAllocator(plan.num_shards, plan.pages_per_shard)
        self._reset_slots()
        return self._init_state()

    def shard_of(self, slot: int) -> int:
        """The data shard whose pages `slot` uses."""
        return slot // self._slots_per_shard

    def shard_slots(self, shard: int) -> range:
        return range(shard * self._slots_per_shard, (shard + 1) * self._slots_per_shard)

    def _global(self, shard: int, pages: Sequence[int]) -> list[int]:
        return [shard * self.memory_plan.pages_per_shard + p for p in pages]

    def slot_pages(self, slot: int) -> list[int]:
        return list(self._slot_pages[slot])

    def assign_slot(self, slot: int, pages: Sequence[int], length: int) -> None:
        """Host side of an insert: `slot` reads `pages` (taking over one reference to each)."""
        if len(pages) > self.table_width:
            raise ValueError(f"assign_slot: {len(pages)} pages exceed the table width {self.table_width}")
        self.release_slot(slot)
        self._to_deactivate.discard(slot)
        self._slot_pages[slot] = list(pages)
        self._table[slot, : len(pages)] = pages
        self._slot_bound[slot] = length
        self._live[slot] = True
        self._table_dirty = True

    def release_slot(self, slot: int, *, keep_pages: bool = False) -> list[int]:
        """Free `slot` (deactivated on the device by the next call that takes the state).

        Its page references are dropped, or with ``keep_pages`` handed to the caller (a
        session keeping its pages across a tool call), and returned.
        """
        pages, self._slot_pages[slot] = self._slot_pages[slot], []
        if self._live[slot]:
            self._to_deactivate.add(slot)
        self._live[slot] = False
        self._table[slot] = TRASH_PAGE
        self._table_dirty = True
        if not keep_pages and pages:
            self.pages.release(self.shard_of(slot), pages)
        return pages if keep_pages else []

    def reserve(self, slot: int, steps: int) -> None:
        """Give `slot` the pages its next ``steps`` tokens need (OutOfPages if its shard has too few)."""
        bound = min(int(self._slot_bound[slot]) + steps, self.max_target_length)
        need, have = pages_for(bound, self.page_size), len(self._slot_pages[slot])
        if need > have:
            new = self.pages.alloc(self.shard_of(slot), need - have)
            self._table[slot, have:need] = new
            self._slot_pages[slot] += new
            self._table_dirty = True

    def live_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self._live)]

    def _sync(self, state: DecodeState) -> DecodeState:
        """Apply the host's pending slot frees (one call) and page-table changes (one upload)."""
        if self._to_deactivate:
            slots = sorted(self._to_deactivate)
            slots += [self._slots] * (_bucket(len(slots)) - len(slots))  # out of range: dropped
            state = self._deactivate(state, jnp.asarray(slots, jnp.int32))
            self._to_deactivate.clear()
        if self._table_dirty:
            state = state.replace(page_table=jax.device_put(self._table, self.state_shardings.page_table))
            self._table_dirty = False
        return state

    def get_prefix_destination_sharding(self, capacity: int | None = None, num_samples: int = 1) -> Prefix:
        """The sharding of a `Prefix` of `capacity` cache entries (JetStream API)."""
        capacity = self._max_prefill if capacity is None else capacity
        return prefix_shardings(self.config, capacity, num_samples, self.cache_dtype, self._mesh, self._rules)

    # ---- prefill (JetStream: a prompt's KV as a dense prefix row) ----------------------

    def prefill(
        self,
        *,
        params: DecodeParams,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array | np.ndarray | Sequence[int],
        true_length: int,
        sampler: SamplingParams | None = None,
        num_samples: int = 1,
    ) -> tuple[Prefix, ResultTokens]:
        """Prefill a prompt (or extend `existing_prefix` with new tokens) and sample G first tokens.

        The prefix is a dense KV row outside the page pool (JetStream's prefill takes no
        decode state); `insert` moves it into pages. The `Driver` instead prefills straight
        into pages (`prefill_insert`).

        Args:
          params: params from `load_params`.
          existing_prefix: a prefix to continue (multi-turn); its keys and sample counter carry
            over, and only `padded_tokens[:true_length]` runs through the model.
          padded_tokens: [T] int token ids; padded to a power-of-two bucket here if needed.
          true_length: number of real tokens in `padded_tokens`.
          sampler: sampling params of the request (default greedy). Its `seed` (default 0)
            keys the samples unless `existing_prefix` carries keys.
          num_samples: G samples of this prompt (a GRPO group); each gets its own key
            `fold_in(PRNGKey(seed), g)` and its own first token.

        Returns:
          `(prefix, result)` with `result` holding the G first tokens (rows = samples).
        """
        sampler = sampler if sampler is not None else SamplingParams(temperature=0.0)
        tokens = np.asarray(padded_tokens, np.int32).reshape(-1)
        if not 1 <= true_length <= tokens.shape[0]:
            raise ValueError(f"prefill: true_length={true_length} must be in [1, {tokens.shape[0]}]")
        bucket = prefill_bucket(true_length, self._min_bucket, self._max_prefill)
        tokens = np.pad(tokens[:true_length], (0, bucket - true_length))
        start = 0 if existing_prefix is None else int(existing_prefix.length)
        total = start + true_length
        if total >= self.max_target_length:
            raise ValueError(
                f"prefill: prompt of {total} tokens (existing prefix {start} + {true_length} new) leaves "
                f"no room to generate within max_target_length={self.max_target_length}"
            )
        capacity = min(prefill_bucket(total, self._min_bucket, 1 << 62), self.max_target_length)
        if existing_prefix is None:
            keys = jnp.stack([request_key(sampler.seed or 0, g) for g in range(num_samples)])
            generated = jnp.zeros((num_samples,), jnp.int32)
            old_cache = None
        else:
            if existing_prefix.num_samples != num_samples:
                raise ValueError(
                    f"prefill: existing_prefix has {existing_prefix.num_samples} samples, "
                    f"num_samples={num_samples}; a continuation keeps its sample count"
                )
            keys, generated, old_cache = existing_prefix.keys, existing_prefix.generated, existing_prefix.cache
        key = (bucket, capacity, None if old_cache is None else old_cache.max_len, num_samples)
        if key not in self._prefill_fns:
            self._prefill_fns[key] = jax.jit(
                functools.partial(self._prefill_impl, capacity=capacity),
                out_shardings=(self.get_prefix_destination_sharding(capacity, num_samples), None),
            )
        sampling = SlotSampling.from_params(sampler, num_samples)
        return self._prefill_fns[key](
            params, old_cache, jnp.int32(start), jnp.asarray(tokens), jnp.int32(true_length), keys, generated, sampling
        )

    def _prefill_impl(self, params, old_cache, start, tokens, true_length, keys, generated, sampling, *, capacity):
        if old_cache is None:
            cache = LayerCache.init(self.config, 1, capacity, self.cache_dtype)
        else:
            cache = _resize_row(old_cache, capacity)
        positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
        hidden, cache = forward(
            params, tokens[None], positions[None], cache, start[None],
            config=self.config, attend_len=capacity, dtype=self._dtype,
        )
        last = jax.lax.dynamic_index_in_dim(hidden[0], true_length - 1, keepdims=True)
        logits = next_token_logits(last, *params.output_embedding())
        num_samples = keys.shape[0]
        logits = jnp.broadcast_to(logits, (num_samples, logits.shape[-1]))
        first, log_prob, truncated = sample(logits, step_keys(keys, generated), sampling)
        prefix = Prefix(
            cache=cache,
            length=start + true_length,
            first_tokens=first,
            log_prob=log_prob,
            truncated_log_prob=truncated,
            keys=keys,
            generated=generated + 1,
            sampling=sampling,
        )
        ones = jnp.ones((num_samples,), jnp.int32)
        return prefix, ResultTokens.pack(first, ones, generated + 1, log_prob, truncated)

    # ---- insert (JetStream: a dense prefix into pages) ----------------------------------

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Move sample 0 of `prefix` into `slot`'s fresh pages (the decode state is donated)."""
        first = lambda x: x[:1]
        single = prefix.replace(
            first_tokens=first(prefix.first_tokens),
            log_prob=first(prefix.log_prob),
            truncated_log_prob=first(prefix.truncated_log_prob),
            keys=first(prefix.keys),
            generated=first(prefix.generated),
            sampling=jax.tree.map(first, prefix.sampling),
        )
        return self._insert_dense(single, decode_state, [slot])

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """The G samples of one prefill into G slots: one prompt, G rollouts (GRPO).

        Slots of one shard share the prompt's full pages (one copy, G references); each
        slot gets its own copy of the last, partial page, which it goes on writing.
        """
        if len(slots) != prefix.num_samples:
            raise ValueError(
                f"bulk_insert: {len(slots)} slots for a prefix with {prefix.num_samples} samples; "
                "prefill with num_samples=len(slots)"
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"bulk_insert: slots must be distinct, got {list(slots)}")
        return self._insert_dense(prefix, decode_state, list(slots))

    def _insert_dense(self, prefix: Prefix, state: DecodeState, slots: list[int]) -> DecodeState:
        length = int(prefix.length)
        P = self.page_size
        full, n = length // P, pages_for(length, P)
        for slot in slots:
            self.release_slot(slot)
        tables = []
        for shard in sorted({self.shard_of(s) for s in slots}):
            mine = [s for s in slots if self.shard_of(s) == shard]
            if self.pages.num_free(shard) < full + (n - full) * len(mine):
                raise OutOfPages(
                    f"insert: a prefix of {length} tokens into {len(mine)} slot(s) of shard {shard} needs "
                    f"{full + (n - full) * len(mine)} pages, {self.pages.num_free(shard)} are free"
                )
            shared = self.pages.alloc(shard, full)
            self.pages.incref(shard, shared * (len(mine) - 1))
            for slot in mine:
                pages = shared + self.pages.alloc(shard, n - full)
                self.assign_slot(slot, pages, length)
        tables = [self._global(self.shard_of(s), self._slot_pages[s]) for s in slots]
        state = self._sync(state)
        if n not in self._insert_fns:
            self._insert_fns[n] = jax.jit(
                functools.partial(self._insert_impl, num_pages=n), donate_argnums=(1,),
                out_shardings=self.state_shardings,
            )
        return self._insert_fns[n](prefix, state, jnp.asarray(slots, jnp.int32), jnp.asarray(tables, jnp.int32))

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slots, pages, *, num_pages):
        P, K = self.page_size, self.config.head_dim

        def write(pool, row):  # row [1, KV, C, K] -> num_pages pages [n, KV, P, K]
            need = num_pages * P
            row = row[0, :, :need]
            row = jnp.pad(row, ((0, 0), (0, need - row.shape[1]), (0, 0)))
            blocks = row.reshape(row.shape[0], num_pages, P, K).transpose(1, 0, 2, 3).astype(pool.dtype)
            for g in range(slots.shape[0]):
                pool = pool.at[pages[g]].set(blocks)
            return pool

        def put(field, values):
            return field.at[slots].set(values)

        return state.replace(
            cache=jax.tree.map(write, state.cache, prefix.cache),
            lengths=put(state.lengths, jnp.broadcast_to(prefix.length, slots.shape)),
            last_tokens=put(state.last_tokens, prefix.first_tokens),
            generated=put(state.generated, prefix.generated),
            keys=put(state.keys, prefix.keys),
            sampling=jax.tree.map(put, state.sampling, prefix.sampling),
            active=put(state.active, True),
        )

    def free_resource(self, slot: int, decode_state: DecodeState | None = None) -> DecodeState | None:
        """Release `slot` and its pages (JetStream API).

        Without the decode state the slot is deactivated on the device by the next engine
        call that takes the state (frees are batched into one call per tick).
        """
        self.release_slot(slot)
        return None if decode_state is None else self._sync(decode_state)

    def extract_prefix(self, decode_state: DecodeState, slot: int, *, length: int, generated: int) -> Prefix:
        """A dense copy of `slot`'s first `length` cache entries as a 1-sample `Prefix`.

        For JetStream-style callers that continue a trajectory with `prefill(existing_prefix=...)`;
        the `Driver` keeps a session's pages instead (no copy).

        Args:
          length: valid entries to keep (tokens whose k/v are already in the cache).
          generated: tokens the request has sampled so far (keeps its random stream).
        """
        if not 0 < length < self.max_target_length:
            raise ValueError(f"extract_prefix: length={length} must be in (0, {self.max_target_length})")
        capacity = min(prefill_bucket(length, self._min_bucket, 1 << 62), self.max_target_length)
        n = pages_for(capacity, self.page_size)
        pages = self._global(self.shard_of(slot), self._slot_pages[slot])[:n]
        pages += [TRASH_PAGE] * (n - len(pages))
        decode_state = self._sync(decode_state)
        if capacity not in self._extract_fns:
            self._extract_fns[capacity] = jax.jit(
                functools.partial(self._extract_impl, capacity=capacity),
                out_shardings=self.get_prefix_destination_sharding(capacity, 1),
            )
        return self._extract_fns[capacity](
            decode_state, jnp.asarray(pages, jnp.int32), jnp.int32(slot), jnp.int32(length), jnp.int32(generated)
        )

    @staticmethod
    def _extract_impl(state: DecodeState, pages, slot, length, generated, *, capacity):
        def gather(pool):  # [n, KV, P, K] -> [1, KV, capacity, K]
            blocks = pool[pages]
            row = blocks.transpose(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[3])
            return row[None, :, :capacity]

        one = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
        return Prefix(
            cache=state.cache.map(gather),
            length=length,
            first_tokens=one(state.last_tokens),
            log_prob=jnp.zeros((1,), jnp.float32),
            truncated_log_prob=jnp.zeros((1,), jnp.float32),
            keys=one(state.keys),
            generated=generated[None],
            sampling=jax.tree.map(one, state.sampling),
        )

    # ---- batched prefill straight into pages (the Driver's path) -----------------------

    def prefill_insert(
        self, params: DecodeParams, decode_state: DecodeState, rows: Sequence[PrefillRow]
    ) -> tuple[DecodeState, ResultTokens]:
        """Prefill several sequences' new tokens into their pages and fill decode slots, in one call.

        Row r writes the KV of ``rows[r].tokens`` at entries ``[start, start + len)`` of its
        pages (earlier entries, e.g. a session's previous turns or a shared prompt, are read,
        not recomputed); then ``copies`` duplicate pages (copy-on-write of a group's last
        partial page); then each admission samples its first token from the row's last
        position (or takes its forced token) and fills its slot. Rows are spread over the
        data shards that own their pages; the call's shapes are bucketed (rows per shard,
        tokens, attention window, admissions, copies) so few variants compile.

        Returns:
          the new decode state and `ResultTokens` with one row per admission, in order
          (valid = 0 for forced tokens).
        """
        if not rows:
            raise ValueError("prefill_insert: no rows")
        P, D = self.page_size, self.num_shards
        per_shard = [[r for r in rows if r.shard == d] for d in range(D)]
        rows_per_shard = _bucket(max(len(x) for x in per_shard))
        longest = max(len(r.tokens) for r in rows)
        T = prefill_bucket(longest, self._min_bucket, self._max_prefill)
        reach = max(r.start + len(r.tokens) for r in rows)
        window = min(pages_for(attend_bucket(reach, self.max_target_length, self._attend_granule), P),
                     self.table_width)
        R = D * rows_per_shard
        tokens = np.zeros((R, T), np.int32)
        starts = np.zeros((R,), np.int32)
        lengths = np.ones((R,), np.int32)
        tables = np.zeros((R, window), np.int32)
        admissions = [(d * rows_per_shard + j, a) for d in range(D) for j, r in enumerate(per_shard[d])
                      for a in r.admissions]
        M = _bucket(len(admissions))
        adm_row = np.zeros((M,), np.int32)
        adm_slot = np.full((M,), self._slots, np.int32)
        adm_key = np.zeros((M, 2), np.uint32)
        adm_generated = np.zeros((M,), np.int32)
        adm_forced = np.full((M,), -1, np.int32)
        adm_length = np.zeros((M,), np.int32)
        temperature, top_k, top_p = np.zeros((M,), np.float32), np.zeros((M,), np.int32), np.ones((M,), np.float32)
        copies = [(self._global(r.shard, [s])[0], self._global(r.shard, [t])[0]) for r in rows for s, t in r.copies]
        C = _bucket(len(copies))
        copy_src = np.zeros((C,), np.int32)
        copy_dst = np.zeros((C,), np.int32)
        for i, (s, t) in enumerate(copies):
            copy_src[i], copy_dst[i] = s, t
        for d in range(D):
            for j, r in enumerate(per_shard[d]):
                i, n = d * rows_per_shard + j, len(r.tokens)
                if not 1 <= n <= self._max_prefill:
                    raise ValueError(f"prefill_insert: {n} tokens in a row; 1 to max_prefill_length={self._max_prefill}")
                if r.start + n >= self.max_target_length or len(r.pages) < pages_for(r.start + n, P):
                    raise ValueError(
                        f"prefill_insert: a row of {r.start} + {n} tokens with {len(r.pages)} pages of {P} "
                        f"(max_target_length={self.max_target_length})"
                    )
                tokens[i, :n], starts[i], lengths[i] = r.tokens, r.start, n
                tables[i, : min(len(r.pages), window)] = r.pages[:window]
        for m, (i, a) in enumerate(admissions):
            if self.shard_of(a.slot) != per_shard_of(rows_per_shard, i):
                raise ValueError(f"prefill_insert: slot {a.slot} is not in the shard of its row's pages")
            adm_row[m], adm_slot[m], adm_key[m], adm_generated[m] = i, a.slot, a.key, a.generated
            adm_forced[m] = a.forced_token
            adm_length[m] = starts[i] + lengths[i]
            temperature[m], top_k[m], top_p[m] = a.sampling.temperature, a.sampling.top_k, a.sampling.top_p
            self.assign_slot(a.slot, a.pages, int(adm_length[m]))
        decode_state = self._sync(decode_state)
        key = (R, T, window, M, C)
        if key not in self._paged_prefill_fns:
            self._paged_prefill_fns[key] = jax.jit(
                self._prefill_insert_impl, donate_argnums=(1,), out_shardings=(self.state_shardings, None)
            )
        by_row = NamedSharding(self._mesh, PartitionSpec(self._rows_spec))
        by_row2 = NamedSharding(self._mesh, PartitionSpec(self._rows_spec, None))
        placed = jax.device_put((tokens, tables, starts, lengths), (by_row2, by_row2, by_row, by_row))
        sampling = SlotSampling(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))
        return self._paged_prefill_fns[key](
            params, decode_state, *placed, jnp.asarray(adm_row), jnp.asarray(adm_slot), jnp.asarray(adm_key),
            jnp.asarray(adm_generated), jnp.asarray(adm_forced), jnp.asarray(adm_length), sampling,
            jnp.asarray(copy_src), jnp.asarray(copy_dst),
        )

    def _prefill_insert_impl(self, params, state: DecodeState, tokens, tables, starts, lengths, adm_row, adm_slot,
                             adm_key, adm_generated, adm_forced, adm_length, sampling, copy_src, copy_dst):
        positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        hidden, cache = forward(
            params, tokens, positions, state.cache, starts, config=self.config,
            attend_len=tables.shape[1] * self.page_size, dtype=self._dtype, page_table=tables,
            cache_spec=self.state_shardings.cache.k[0].spec, mesh=self._mesh,
        )
        cache = cache.map(lambda pool: pool.at[copy_dst].set(pool[copy_src]))
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [R, D]
        logits = next_token_logits(last[adm_row], *params.output_embedding())
        sampled, log_prob, truncated = sample(logits, step_keys(adm_key, adm_generated), sampling)
        forced = adm_forced >= 0
        first = jnp.where(forced, adm_forced, sampled)
        generated = jnp.where(forced, adm_generated, adm_generated + 1)

        def put(field, values):
            return field.at[adm_slot].set(values, mode="drop")

        state = state.replace(
            cache=cache,
            lengths=put(state.lengths, adm_length),
            last_tokens=put(state.last_tokens, first),
            generated=put(state.generated, generated),
            keys=put(state.keys, adm_key),
            sampling=jax.tree.map(put, state.sampling, sampling),
            active=put(state.active, True),
        )
        valid = ~forced & (adm_slot < self._slots)
        return state, ResultTokens.pack(first, valid, generated, log_prob, truncated)

    # ---- generate ---------------------------------------------------------------------

    def _step(self, params, state: DecodeState, attend_len: int) -> tuple[DecodeState, tuple]:
        hidden, cache = forward(
            params, state.last_tokens[:, None], state.lengths[:, None], state.cache, state.lengths,
            config=self.config, attend_len=attend_len, dtype=self._dtype, attention=self.decode_attention,
            cache_spec=self.state_shardings.cache.k[0].spec, mesh=self._mesh, page_table=state.page_table,
        )
        logits = next_token_logits(hidden[:, -1], *params.output_embedding())
        tokens, log_prob, truncated = sample(logits, step_keys(state.keys, state.generated), state.sampling)
        valid = state.active & (state.lengths < self.max_target_length)
        step = valid.astype(jnp.int32)
        new_state = state.replace(
            cache=cache,
            lengths=state.lengths + step,
            last_tokens=jnp.where(valid, tokens, state.last_tokens),
            generated=state.generated + step,
            active=valid,
        )
        return new_state, (tokens, valid, new_state.generated, log_prob, truncated)

    def _generate_impl(self, params, state: DecodeState, *, num_steps: int | None, attend_len: int):
        if num_steps is None:
            state, out = self._step(params, state, attend_len)
            return state, ResultTokens.pack(*out)
        slots = self._slots
        buffers = (
            jnp.zeros((num_steps, slots), jnp.int32),
            jnp.zeros((num_steps, slots), bool),
            jnp.zeros((num_steps, slots), jnp.int32),
            jnp.zeros((num_steps, slots), jnp.float32),
            jnp.zeros((num_steps, slots), jnp.float32),
        )

        def body(i, carry):
            state, buffers = carry
            state, out = self._step(params, state, attend_len)
            buffers = tuple(b.at[i].set(o) for b, o in zip(buffers, out))
            return state, buffers

        state, buffers = jax.lax.fori_loop(0, num_steps, body, (state, buffers))
        return state, ResultTokens.pack(*buffers)

    def generate(
        self,
        params: DecodeParams,
        decode_state: DecodeState,
        *,
        num_steps: int | None = None,
        attend_len: int | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step for every slot ([S] results), or `num_steps` steps in one dispatch ([N, S]).

        The decode state is donated. Every live slot first gets the pages its new tokens
        need (`reserve`; OutOfPages when a shard has too few: the `Driver` preempts before
        that happens). A slot stops advancing (valid = 0) once it is inactive or at
        `max_target_length`; every other stop condition is checked by the caller.

        With the "xla" attention every slot reads the pages of the first W entries, W =
        `attend_window` (from the host's length bounds: no device read). A caller may pass
        `attend_len` (any value >= that bound; smaller values give wrong results for the
        longer slots). With "pallas" there is no window (the kernel stops at each slot's
        length) and `attend_len` is ignored.
        """
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"generate: num_steps must be >= 1, got {num_steps}")
        steps = 1 if num_steps is None else num_steps
        for slot in self.live_slots():
            self.reserve(slot, steps)
        if self.decode_attention == "pallas":
            attend_len = self.table_width * self.page_size  # the kernel bounds each slot's reads by its length
        elif attend_len is None:
            attend_len = self.attend_window(decode_state, steps)
        elif not 0 < attend_len <= self.max_target_length:
            raise ValueError(f"generate: attend_len={attend_len} must be in [1, {self.max_target_length}]")
        decode_state = self._sync(decode_state)
        key = (num_steps, attend_len)
        if key not in self._generate_fns:
            self._generate_fns[key] = jax.jit(
                functools.partial(self._generate_impl, num_steps=num_steps, attend_len=attend_len),
                donate_argnums=(1,),
                out_shardings=(self.state_shardings, None),
            )
        out = self._generate_fns[key](params, decode_state)
        live = self._live
        self._slot_bound[live] = np.minimum(self._slot_bound[live] + steps, self.max_target_length)
        return out

    def attend_window(self, decode_state: DecodeState | None = None, num_steps: int = 1) -> int:
        """The "xla" attention window W for `num_steps` steps (see `generate`): whole pages
        covering the longest live slot's length bound + the steps."""
        live = self._live
        longest = int(self._slot_bound[live].max()) if live.any() else 0
        window = attend_bucket(longest + num_steps, self.max_target_length, self._attend_granule)
        return min(pages_for(window, self.page_size), self.table_width) * self.page_size


def per_shard_of(rows_per_shard: int, row: int) -> int:
    return row // rows_per_shard


def _bucket(n: int) -> int:
    """The next power of two >= max(n, 1): few compiled shapes for batched calls."""
    return 1 << max(n - 1, 0).bit_length()
