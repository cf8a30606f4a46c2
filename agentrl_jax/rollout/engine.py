"""The rollout engine: JetStream's Engine API (prefill -> insert -> generate over slots), natively.

JetStream (AI-Hypercomputer/JetStream) defined the interface that MaxText's MaxEngine
implements; this class has the same method names and argument shapes (newest version:
keyword-only `prefill` with `existing_prefix`, `bulk_insert` for one prefill into G slots)
without importing `jetstream`.

- `prefill` runs the prompt (or a continuation of an `existing_prefix`) through the decoder
  with a batch-1 cache row and samples the first token(s) from its last position.
- `insert` / `bulk_insert` copy a prefix's KV row into decode slot(s) of the `DecodeState`.
- `generate` feeds every slot's last token, writes its k/v at the slot's length, samples
  the next token per slot; with `num_steps=N` it runs N steps inside one jitted
  `lax.fori_loop` and returns [N, S] results (stop checks happen on the host).
- `extract_prefix` copies a slot's live KV row back into a `Prefix`, so a multi-turn
  trajectory can free its slot while a tool runs and later continue with
  `prefill(existing_prefix=...)` of only the observation tokens.

The model runs through `agentrl_jax.models.decode.forward`, not the trainer's layer scan:
`load_params` re-lays the weights out once per update (`DecodeParams`: one dict per layer,
fused QKV and gate/up), the cache is one `[S, KV, M, K]` buffer per layer updated in place,
and a decode step's attention reads only the filled entries: a window of the first W
entries (W bucketed by `attend_bucket`, a few compiles) with the "xla" attention, or
each slot's own length with our Pallas GPU kernel ("pallas", the default on GPU), which
also finishes the QKV projection, applies QK-norm and RoPE and writes the cache.

All state is sharded on the mesh with the inference rule table (kv heads over `tensor`,
slots over the data axes, weights with tensor parallelism only) and is donated through
every jitted call. Prompt chunks are padded to power-of-two buckets; slot indices,
lengths and sampling parameters are arrays, so none of them recompiles anything.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from agentrl_jax.models import Decoder, param_shardings, split_params
from agentrl_jax.models.decode import (
    DecodeParams,
    LayerCache,
    decode_params_axes,
    forward,
    to_decode_params,
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
from agentrl_jax.sharding import Rules, inference_rules, make_mesh, tree_shardings

DECODE_ATTENTION = ("xla", "pallas")


def _resize_row(cache: LayerCache, capacity: int) -> LayerCache:
    """Keep the first `capacity` entries of a cache row, zero-padding when it is shorter."""

    def one(x):
        have = x.shape[2]
        if have >= capacity:
            return x[:, :, :capacity]
        return jnp.pad(x, ((0, 0), (0, 0), (0, capacity - have), (0, 0)))

    return cache.map(one)


class Engine:
    """Slot-based decoding of a `Decoder` on a mesh.

    Args:
      model: the decoder (its graph and config are used; params are passed per call).
      mesh: the device mesh (default: all devices on `data`).
      max_concurrent_decodes: S, the number of decode slots.
      max_target_length: M, cache entries per slot (prompt + every turn + generated).
      max_prefill_length: the largest prompt chunk one prefill takes.
      min_prefill_bucket: the smallest padded prefill length.
      cache_dtype: dtype of the KV cache (default: the model's compute dtype).
      rules: logical-axis rule table (default: `inference_rules()`).
      attend_granule: decode attention reads a window of the first W cache entries, W
        rounded up from the longest live slot (+ the dispatch's steps) in steps of at
        least this many entries (`attend_bucket`); each W compiles once.
      decode_attention: "xla" (einsums over the window) or "pallas" (the Pallas GPU
        kernel of `models.decode_attention`, run per shard, which reads each slot's
        filled entries only; elsewhere than on GPU it runs interpreted, for tests). Default: "pallas" on
        GPU meshes with a 16-bit compute dtype and a power-of-two head dim, else "xla"
        (the kernel's float32 dots would run in TF32, loosening the engine/trainer
        logprob match).
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
    ):
        for name, value in (
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_target_length", max_target_length),
            ("max_prefill_length", max_prefill_length),
            ("min_prefill_bucket", min_prefill_bucket),
            ("attend_granule", attend_granule),
        ):
            if value < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {value}")
        self._mesh = mesh if mesh is not None else make_mesh({"data": -1})
        if decode_attention is None:
            on_gpu = all(d.platform == "gpu" for d in self._mesh.devices.flat)
            head_dim = model.config.head_dim
            kernel_fits = head_dim >= 16 and head_dim & (head_dim - 1) == 0  # Triton blocks: powers of two
            decode_attention = "pallas" if on_gpu and jnp.dtype(model.dtype).itemsize == 2 and kernel_fits else "xla"
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"Engine: decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        self.config = model.config
        _, abstract = split_params(model)
        self._param_dtype = model.param_dtype
        self._dtype = model.dtype
        self._attend_granule = attend_granule
        self.decode_attention = decode_attention
        self._rules = rules if rules is not None else inference_rules()
        self._slots = max_concurrent_decodes
        self.max_target_length = max_target_length
        # the Pallas kernel walks the cache in blocks (and splits it into chunks for few slots)
        self._cache_len = -(-max_target_length // 256) * 256 if decode_attention == "pallas" else max_target_length
        self._max_prefill = max_prefill_length
        self._min_bucket = min(min_prefill_bucket, max_prefill_length)
        self.cache_dtype = cache_dtype if cache_dtype is not None else model.dtype
        self.param_shardings = param_shardings(abstract, self._mesh, self._rules)
        self._reshard: dict[Any, Any] = {}
        layout = jax.eval_shape(functools.partial(to_decode_params, self.config), abstract)
        self.decode_param_shardings = tree_shardings(
            decode_params_axes(self.config), self._mesh, self._rules, shapes=layout
        )
        self._to_decode_params = jax.jit(
            functools.partial(to_decode_params, self.config), out_shardings=self.decode_param_shardings
        )
        self.state_shardings = decode_state_shardings(
            self.config, self._slots, self._cache_len, self.cache_dtype, self._mesh, self._rules
        )
        self._generate_fns: dict[tuple[int | None, int], Any] = {}
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=self.state_shardings)
        self._deactivate = jax.jit(
            lambda state, slots: state.replace(active=state.active.at[slots].set(False)),
            donate_argnums=(0,),
            out_shardings=self.state_shardings,
        )
        self._prefill_fns: dict[tuple, Any] = {}
        self._init_state = None
        self._extract_fns: dict[int, Any] = {}

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

    # ---- params and state -------------------------------------------------------------

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

    def init_decode_state(self) -> DecodeState:
        """All slots free, materialized directly in the decode-state sharding."""
        if self._init_state is None:
            make = functools.partial(
                init_decode_state, self.config, self._slots, self._cache_len, self.cache_dtype
            )
            self._init_state = jax.jit(make, out_shardings=self.state_shardings)
        return self._init_state()

    def get_prefix_destination_sharding(self, capacity: int | None = None, num_samples: int = 1) -> Prefix:
        """The sharding of a `Prefix` of `capacity` cache entries (JetStream API)."""
        capacity = self._max_prefill if capacity is None else capacity
        return prefix_shardings(self.config, capacity, num_samples, self.cache_dtype, self._mesh, self._rules)

    # ---- prefill ----------------------------------------------------------------------

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

    # ---- insert -----------------------------------------------------------------------

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slots: jax.Array) -> DecodeState:
        row = _resize_row(prefix.cache, min(prefix.capacity, self.max_target_length))

        def copy_into(whole, part):
            for g in range(slots.shape[0]):
                whole = jax.lax.dynamic_update_slice(whole, part.astype(whole.dtype), (slots[g], 0, 0, 0))
            return whole

        cache = jax.tree.map(copy_into, state.cache, row)

        def put(field, values):
            return field.at[slots].set(values)

        return DecodeState(
            cache=cache,
            lengths=put(state.lengths, jnp.broadcast_to(prefix.length, slots.shape)),
            last_tokens=put(state.last_tokens, prefix.first_tokens),
            generated=put(state.generated, prefix.generated),
            keys=put(state.keys, prefix.keys),
            sampling=jax.tree.map(put, state.sampling, prefix.sampling),
            active=put(state.active, True),
        )

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """Copy sample 0 of `prefix` into `slot` (the decode state is donated)."""
        first = lambda x: x[:1]
        single = prefix.replace(
            first_tokens=first(prefix.first_tokens),
            log_prob=first(prefix.log_prob),
            truncated_log_prob=first(prefix.truncated_log_prob),
            keys=first(prefix.keys),
            generated=first(prefix.generated),
            sampling=jax.tree.map(first, prefix.sampling),
        )
        return self._insert(single, decode_state, jnp.asarray([slot], jnp.int32))

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Copy the G samples of one prefill into G slots: one prompt, G rollouts (GRPO)."""
        if len(slots) != prefix.num_samples:
            raise ValueError(
                f"bulk_insert: {len(slots)} slots for a prefix with {prefix.num_samples} samples; "
                "prefill with num_samples=len(slots)"
            )
        if len(set(slots)) != len(slots):
            raise ValueError(f"bulk_insert: slots must be distinct, got {list(slots)}")
        return self._insert(prefix, decode_state, jnp.asarray(slots, jnp.int32))

    def free_resource(self, slot: int, decode_state: DecodeState | None = None) -> DecodeState | None:
        """Release `slot` (JetStream API). With the decode state, mark the slot inactive.

        Nothing needs freeing on the device: a slot's cache row is overwritten by the next
        insert. Marking it inactive stops it from reporting valid tokens.
        """
        if decode_state is None:
            return None
        return self._deactivate(decode_state, jnp.asarray([slot], jnp.int32))

    def extract_prefix(self, decode_state: DecodeState, slot: int, *, length: int, generated: int) -> Prefix:
        """A copy of `slot`'s first `length` cache entries as a 1-sample `Prefix`.

        Used between turns of a trajectory: the caller keeps the prefix (device memory of
        `length` tokens) and frees the slot; the next turn calls `prefill(existing_prefix=
        ..., padded_tokens=[last sampled token] + observation)`.

        Args:
          length: valid entries to keep (tokens whose k/v are already in the cache).
          generated: tokens the request has sampled so far (keeps its random stream).
        """
        if not 0 < length < self.max_target_length:
            raise ValueError(f"extract_prefix: length={length} must be in (0, {self.max_target_length})")
        capacity = min(prefill_bucket(length, self._min_bucket, 1 << 62), self.max_target_length)
        if capacity not in self._extract_fns:
            self._extract_fns[capacity] = jax.jit(
                functools.partial(self._extract_impl, capacity=capacity),
                out_shardings=self.get_prefix_destination_sharding(capacity, 1),
            )
        return self._extract_fns[capacity](decode_state, jnp.int32(slot), jnp.int32(length), jnp.int32(generated))

    @staticmethod
    def _extract_impl(state: DecodeState, slot, length, generated, *, capacity):
        row = state.cache.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)[:, :, :capacity])
        one = lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)
        return Prefix(
            cache=row,
            length=length,
            first_tokens=one(state.last_tokens),
            log_prob=jnp.zeros((1,), jnp.float32),
            truncated_log_prob=jnp.zeros((1,), jnp.float32),
            keys=one(state.keys),
            generated=generated[None],
            sampling=jax.tree.map(one, state.sampling),
        )

    # ---- generate ---------------------------------------------------------------------

    def _step(self, params, state: DecodeState, attend_len: int) -> tuple[DecodeState, tuple]:
        hidden, cache = forward(
            params, state.last_tokens[:, None], state.lengths[:, None], state.cache, state.lengths,
            config=self.config, attend_len=attend_len, dtype=self._dtype, attention=self.decode_attention,
            cache_spec=self.state_shardings.cache.k[0].spec, mesh=self._mesh,
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

        The decode state is donated. A slot stops advancing (valid = 0) once it is inactive
        or its cache is full; every other stop condition is checked by the caller.

        Attention reads the first W cache entries of every slot, W = `attend_bucket` of the
        longest active slot's length + the dispatch's steps (read from the state: one small
        device-to-host copy). A caller that tracks lengths itself may pass `attend_len`
        (any value >= that bound, at most `max_target_length`; smaller values give wrong
        results for the longer slots). With `decode_attention="pallas"` there is no window
        (the kernel stops at each slot's length) and `attend_len` is ignored.
        """
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"generate: num_steps must be >= 1, got {num_steps}")
        if self.decode_attention == "pallas":
            attend_len = self._cache_len  # the kernel bounds each slot's reads by its length itself
        elif attend_len is None:
            attend_len = self.attend_window(decode_state, 1 if num_steps is None else num_steps)
        elif not 0 < attend_len <= self.max_target_length:
            raise ValueError(f"generate: attend_len={attend_len} must be in [1, {self.max_target_length}]")
        key = (num_steps, attend_len)
        if key not in self._generate_fns:
            self._generate_fns[key] = jax.jit(
                functools.partial(self._generate_impl, num_steps=num_steps, attend_len=attend_len),
                donate_argnums=(1,),
                out_shardings=(self.state_shardings, None),
            )
        return self._generate_fns[key](params, decode_state)

    def attend_window(self, decode_state: DecodeState, num_steps: int = 1) -> int:
        """The attention window W for `num_steps` steps of `decode_state` (see `generate`)."""
        lengths, active = jax.device_get((decode_state.lengths, decode_state.active))
        longest = int(lengths[active].max()) if active.any() else 0
        return attend_bucket(longest + num_steps, self.max_target_length, self._attend_granule)
