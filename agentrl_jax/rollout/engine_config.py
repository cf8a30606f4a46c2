"""The rollout engine's settings: `EngineConfig`, checked when it is made.

`EngineConfig.from_rollout` is the one mapping from the config file's rollout section
(`config.rollout.RolloutConfig`) onto it, and the fields that section also sets take their
defaults from it (one set of defaults: ``EngineConfig() == EngineConfig.from_rollout(RolloutConfig())``);
the rest are the engine's own. Tests and benchmarks that build an engine directly pass the
fields they set (`Engine(model, max_concurrent_decodes=4, ...)`) and get these defaults for
the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from agentrl_jax.config.rollout import RolloutConfig
from agentrl_jax.models.decode import DecodeKernel
from agentrl_jax.rollout.state import STOP_IDS, STOP_SEQUENCES

DEFAULT_MEMORY_FRACTION = 0.8  # of the free device memory, for the KV pool, when nothing else is set
# XLA options the decode dispatch compiles with on GPU meshes, when `EngineConfig.decode_compiler_options` is
# None. A decode step's weight matmuls have M = the batch (64): XLA's autotuner picks split-K Triton GEMMs for
# them, whose float32 partials the next fusion reads again; cuBLAS measured faster per step at batch 64
# on the 1.7B shape (docs/benchmarks.md, "cuBLAS for the decode step's weight matmuls"). Per program
# (`jax.jit(compiler_options=)`), so the trainer's and the prefill's programs keep XLA's own choice.
GPU_DECODE_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ROLLOUT = RolloutConfig()  # the rollout section's defaults, the engine's for the fields the section sets


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an `Engine` holds, prefills and decodes its sequences (None: chosen for the mesh / model).

    Attributes:
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
        length they only add the combine. Default ``decode_kernel.min_programs`` (512),
        twice that with decode lanes (B < S), whose rows are a mix of lengths and drain to a
        few at the end of a batch (docs/benchmarks.md, "Decode kernel chunks": faster on the
        multi-turn workload with lanes, in the batch's tail; slower on a batch of equal
        lengths).
      decode_kernel: the GPU decode kernel's settings (`models.decode.DecodeKernel`: block,
        method, warps, stages, QKV splits; its ``min_programs`` is ``decode_kernel_programs``'s
        default). `bench/decode.py --kernel` tunes them.
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
      cache_dtype: dtype of the KV cache; None: the model's compute dtype.
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
      page_size: P, tokens per KV page. Any size >= 1 works with the "xla" attentions; the
        kernels ask for theirs (`decode_step.choose_decode_attention`: the GPU kernel a power of
        two >= 16, the TPU kernel whole sublane tiles) and a run's config a power of two
        (`RolloutConfig.validate`), which every kernel default fits. The engine's page
        arithmetic takes any size, and the paged tests use pages of 3 and 5 so that page
        boundaries fall at offsets that powers of two would line up (inside prompts, prefill
        pieces and a group's shared prefix).
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

    max_concurrent_decodes: int = _ROLLOUT.max_concurrent
    decode_batch: int | None = None
    device_stop_ids: int = STOP_IDS
    device_stop_sequences: tuple[int, int] = STOP_SEQUENCES
    decode_kernel_programs: int | None = None
    decode_kernel: DecodeKernel = dataclasses.field(default_factory=DecodeKernel)
    decode_compiler_options: dict[str, Any] | None = None
    max_target_length: int = _ROLLOUT.max_sequence_length
    max_prefill_length: int = _ROLLOUT.max_prompt_length
    min_prefill_bucket: int = 16
    prefill_row_tokens: int = 64
    prefill_compaction: bool | None = None
    cache_dtype: Any = _DTYPES[_ROLLOUT.cache_dtype]
    attend_granule: int = 256
    decode_attention: str | None = None
    prefill_attention: str | None = None
    page_size: int = _ROLLOUT.page_size
    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    compilation_cache_dir: str | None = None

    def __post_init__(self):
        """ValueError naming the first field out of range (the mesh-dependent checks are `Engine`'s)."""
        for name in ("max_concurrent_decodes", "max_target_length", "max_prefill_length", "min_prefill_bucket",
                     "prefill_row_tokens", "attend_granule", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_pages", "kv_cache_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"Engine: {name} must be >= 1, got {getattr(self, name)}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"Engine: kv_cache_memory_fraction must be in (0, 1], got {fraction}")
        if self.device_stop_ids < 1:
            raise ValueError(f"Engine: device_stop_ids must be >= 1, got {self.device_stop_ids}")
        if len(self.device_stop_sequences) != 2 or min(self.device_stop_sequences) < 1:
            raise ValueError(f"Engine: device_stop_sequences must be (sequences >= 1, tokens >= 1), got "
                             f"{self.device_stop_sequences}")
        object.__setattr__(self, "device_stop_sequences", tuple(self.device_stop_sequences))
        if self.decode_kernel_programs is not None and self.decode_kernel_programs < 1:
            raise ValueError(f"Engine: decode_kernel_programs must be >= 1, got {self.decode_kernel_programs}")

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig) -> EngineConfig:
        """The engine of a run: the rollout section's slots, lengths, KV-cache dtype and budget, decode
        lanes and decode programs; the fields the section does not name keep this class's defaults."""
        return cls(max_concurrent_decodes=rollout.max_concurrent, max_target_length=rollout.max_sequence_length,
                   max_prefill_length=rollout.max_prompt_length, cache_dtype=_DTYPES[rollout.cache_dtype],
                   **rollout.engine_kwargs())


def decode_compiler_options(options: dict[str, Any] | None, mesh: Mesh) -> dict[str, Any]:
    """`EngineConfig.decode_compiler_options` checked, or the platform's default (`GPU_DECODE_COMPILER_OPTIONS`)."""
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
