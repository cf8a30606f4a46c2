"""Decode throughput of the rollout engine vs HF transformers `generate`, with model-bandwidth utilization.

Usage (GPU):
    python bench/decode.py --sizes 0.6b,1.7b,4b --batches 1,16,64,256 --prompt 512 --gen 1024
Kernel by kernel (GPU; two dispatches at the run's mean context) and other kernel settings:
    python bench/decode.py --sizes 1.7b --batches 64 --no-hf --profile --kernel block_k=64,stages=2
XLA's GEMMs against the engine's default cuBLAS ones (`Engine(decode_compiler_options=)`), in one run:
    python bench/decode.py --sizes 1.7b --batches 64 --no-hf --compiler-options "none;default"
Quick check (CPU, < 1 min):
    python bench/decode.py --tiny

Qwen3 shapes with random bf16 weights (no download). For each size and batch, the engine
fills every slot with a random `--prompt`-token prompt and decodes `--gen` tokens
(temperature 1, `--steps-per-dispatch` steps per jitted call, results copied to the host
after every dispatch as the driver does). One untimed pass first compiles every attention
window the run needs (`Engine.attend_window`); the timed pass refills the slots and runs
again, so the numbers are steady-state decoding. The baseline is HF transformers `generate`
(PyTorch, bf16, same shapes, random init) in the same run, timed the same way: decode
time = time(generate gen tokens) - time(generate 1 token).

Model-bandwidth utilization (MBU) = (weight bytes + KV bytes the step needs) / step time /
HBM bandwidth, with KV bytes at the average context length of the run (prompt + gen/2).
The card's bandwidth comes from its name (H100 SXM 3.35 TB/s, H200 4.8 TB/s, ...).

Each measurement runs in its own subprocess so JAX's and PyTorch's allocators never share
the card.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3 = {
    # name: (vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tie)
    "0.6b": (151936, 1024, 3072, 28, 16, 8, 128, True),
    "1.7b": (151936, 2048, 6144, 28, 16, 8, 128, True),
    "4b": (151936, 2560, 9728, 36, 32, 8, 128, True),
    "tiny": (512, 64, 128, 2, 4, 2, 16, True),
    "retool_small": (768, 512, 1536, 8, 8, 4, 64, True),  # configs/retool_small.py's scratch model
    "smollm2": (49152, 576, 1536, 30, 9, 3, 64, True),  # SmolLM2-135M-Instruct (configs/smollm2_tools.py)
}
FLOAT32_SIZES = ("tiny", "retool_small", "smollm2")  # run in float32, as their configs do
LLAMA_SIZES = ("smollm2",)  # Llama layers (no q/k norm, rope theta 1e5); the others are Qwen3
HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12))


def hbm_bandwidth(device_name: str) -> float | None:
    for key, bandwidth in HBM_BYTES_PER_S:
        if key.lower() in device_name.lower():
            return bandwidth
    return None


def param_count(size: str) -> int:
    vocab, d, f, layers, heads, kv, k, tie = QWEN3[size]
    per_layer = d * heads * k + 2 * d * kv * k + heads * k * d + 3 * d * f + 2 * d + 2 * k
    return vocab * d * (1 if tie else 2) + layers * per_layer + d


def kv_bytes_per_token(size: str, dtype_bytes: int = 2) -> int:
    _, _, _, layers, _, kv, k, _ = QWEN3[size]
    return 2 * layers * kv * k * dtype_bytes


def qwen3_model(size: str):
    """(random-init Decoder of the Qwen3 ``size`` shape, its dtype): float32 for FLOAT32_SIZES, else bf16."""
    import jax.numpy as jnp
    from flax import nnx

    from agentrl_jax.models import Decoder, DecoderConfig

    vocab, d, f, layers, heads, kv, k, tie = QWEN3[size]
    llama = size in LLAMA_SIZES
    config = DecoderConfig(
        architecture="llama" if llama else "qwen3", vocab_size=vocab, hidden_size=d, intermediate_size=f,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=k, qk_norm=not llama, tie_word_embeddings=tie,
        rope_theta=100_000.0 if llama else 1_000_000.0, max_position_embeddings=40960,
    )
    dtype = jnp.float32 if size in FLOAT32_SIZES else jnp.bfloat16
    return Decoder(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)), dtype


def compiler_options(text: str) -> dict | None:
    """``--compiler-options`` (one set) as `Engine(decode_compiler_options=)` (`config.rollout.parse_compiler_options`)."""
    from agentrl_jax.config.rollout import parse_compiler_options

    try:
        return parse_compiler_options(text)
    except ValueError as e:
        raise SystemExit(f"--compiler-options: {e}") from e


def _jax_worker(size: str, batches: list[int], prompt: int, gen: int, steps: int, attention: str,
                profile: bool = False, page_size: int = 32, max_length: int = 0, options: str = "",
                kernel: str = "") -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentrl_jax.rollout import SamplingParams
    from agentrl_jax.rollout.jetstream import DensePrefixEngine  # the runs use JetStream's dense prefill too
    from agentrl_jax.sharding import make_mesh

    model, dtype = qwen3_model(size)
    vocab = model.config.vocab_size
    device = jax.devices()[0]
    mesh = make_mesh({"data": 1}, [device])
    rows = []
    for batch in batches:
        row = {"impl": "agentrl_jax", "size": size, "batch": batch, "device": device.device_kind, "jax": jax.__version__}
        try:
            engine = DensePrefixEngine(model, mesh=mesh, max_concurrent_decodes=batch,
                            max_target_length=max_length or prompt + gen + 1,
                            max_prefill_length=prompt, cache_dtype=dtype, page_size=page_size,
                            decode_attention=None if attention == "default" else attention,
                            decode_compiler_options=compiler_options(options), decode_kernel=parse_kernel(kernel))
            row["impl"] = f"agentrl_jax ({engine.decode_attention} attention, pages of {page_size})"
            row["compiler_options"] = engine.decode_compiler_options
            if options:
                row["impl"] += f" options {options}: {engine.decode_compiler_options or 'none'}"
            if engine.decode_attention == "pallas":
                k = engine.decode_kernel
                row["impl"] += f" {k.method} b{k.block_k} w{k.warps} s{k.stages} p{k.min_programs} qkv/{k.qkv_splits}"
            if os.environ.get("XLA_FLAGS"):
                row["impl"] += f" XLA_FLAGS={os.environ['XLA_FLAGS']}"
            params = engine.load_params(model)
            tokens = np.random.default_rng(0).integers(0, vocab, prompt).astype(np.int32)
            sampler = SamplingParams(temperature=1.0, seed=0)

            state = result = None  # the last batch's decode state
            state = _fill(engine, params, tokens, sampler, batch)
            t0 = time.perf_counter()
            for _ in range(gen // steps):  # compiles every attention window of the run
                state, result = engine.generate(params, state, num_steps=steps)
                result.convert_to_numpy()
            row["warmup_s"] = time.perf_counter() - t0
            row["compiled_windows"] = len(engine._generate_fns)
            state = result = None  # free the last decode state before building the next (4B x 256: 2 x 68 GB)
            state = _fill(engine, params, tokens, sampler, batch)
            t0 = time.perf_counter()
            prefix, _ = engine.prefill(params=params, padded_tokens=tokens, true_length=prompt, sampler=sampler)
            jax.block_until_ready(prefix)
            row["prefill_ms"] = 1e3 * (time.perf_counter() - t0)
            dispatches = gen // steps
            t0 = time.perf_counter()
            for _ in range(dispatches):
                state, result = engine.generate(params, state, num_steps=steps)
                result.convert_to_numpy()
            elapsed = time.perf_counter() - t0
            row.update(_rates(size, batch, prompt, dispatches * steps, elapsed, dtype_bytes=jnp.dtype(dtype).itemsize))
            if profile:  # two dispatches at the run's mean context (prompt + gen / 2), kernel by kernel
                state = result = None  # free the last decode state before building the next (4B x 256: 2 x 68 GB)
                state = _fill(engine, params, tokens, sampler, batch)
                for _ in range(dispatches // 2 - 1):
                    state, _ = engine.generate(params, state, num_steps=steps)
                step = functools.partial(engine.generate, params, num_steps=steps)
                row["profile"] = _profile(step, state, 2, steps)
        except Exception as e:  # noqa: BLE001  (an OOM at one batch must not hide the others)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def _fill(engine, params, tokens, sampler, batch):
    """A decode state with the same prefilled prompt in every slot."""
    import jax

    state = engine.init_decode_state()
    prefix, _ = engine.prefill(params=params, padded_tokens=tokens, true_length=tokens.size, sampler=sampler)
    for slot in range(batch):
        state = engine.insert(prefix, state, slot)
    return jax.block_until_ready(state)


def parse_kernel(text: str):
    """``--kernel`` (one setting, ``key=value,...``) as `models.decode.DecodeKernel` (`Engine(decode_kernel=)`),
    the keys not named keeping the engine's defaults."""
    import dataclasses

    from agentrl_jax.models.decode import DecodeKernel

    keys = [f.name for f in dataclasses.fields(DecodeKernel)]
    settings = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if not value or key not in keys or (key != "method" and not value.isdigit()):
            raise SystemExit(f"--kernel: {item!r} is not key=value with a key of {', '.join(keys)} (integers but method)")
        settings[key] = value if key == "method" else int(value)
    try:
        return DecodeKernel(**settings)
    except ValueError as e:
        raise SystemExit(f"--kernel: {e}") from e


def _profile(run, state, dispatches: int, steps: int, top: int = 40) -> list[tuple[str, float, int]]:
    """``(kernel name, device us per decode step, launches per step)`` of the busiest kernels, GPU 0."""
    import glob
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(dispatches):
                state, result = run(state)
                result.convert_to_numpy()
        [path] = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    totals: dict[str, list[float]] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU:0"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                entry = totals.setdefault(event.name, [0.0, 0])
                entry[0] += event.duration_ns / 1e3
                entry[1] += 1
    n = dispatches * steps
    rows = sorted(((name[:90], us / n, count / n) for name, (us, count) in totals.items()), key=lambda r: -r[1])
    busy = sum(r[1] for r in rows)
    return [("TOTAL (device-busy us per step, kernels per step)", busy, sum(r[2] for r in rows))] + rows[:top]


def _hf_worker(size: str, batches: list[int], prompt: int, gen: int, cache: str) -> list[dict]:
    import torch
    import transformers

    vocab, d, f, layers, heads, kv, k, tie = QWEN3[size]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda and size not in FLOAT32_SIZES else torch.float32
    llama = size in LLAMA_SIZES
    config = (transformers.LlamaConfig if llama else transformers.Qwen3Config)(
        vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=k, tie_word_embeddings=tie, max_position_embeddings=40960,
    )
    with torch.device(device):
        model = (transformers.LlamaForCausalLM if llama else transformers.Qwen3ForCausalLM)(config).to(dtype).eval()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    rows = []
    for batch in batches:
        row = {"impl": f"hf-transformers ({cache} cache)", "size": size, "batch": batch, "device": name}
        try:
            ids = torch.randint(0, vocab, (batch, prompt), device=device)
            kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
            if cache == "static":
                kw["cache_implementation"] = "static"

            def timed(n):
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                if cuda:
                    torch.cuda.synchronize()
                assert out.shape[1] == prompt + n
                return time.perf_counter() - t0

            timed(2)  # warm-up
            first = timed(1)
            total = timed(gen)
            row["prefill_ms"] = 1e3 * first
            row.update(_rates(size, batch, prompt, gen - 1, total - first, dtype_bytes=2 if cuda else 4))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if cuda:
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _rates(size: str, batch: int, prompt: int, steps: int, seconds: float, dtype_bytes: int) -> dict:
    step_s = seconds / steps
    context = prompt + steps / 2
    bytes_per_step = param_count(size) * dtype_bytes + batch * context * kv_bytes_per_token(size, dtype_bytes)
    return {
        "tokens_per_s": batch * steps / seconds,
        "step_ms": 1e3 * step_s,
        "bytes_per_step": bytes_per_step,
        "achieved_GBps": bytes_per_step / step_s / 1e9,
    }


def _run_worker(kind: str, size: str, args, kernel: str = "", options: str = "") -> list[dict]:
    batches = args.hf_batches if kind == "hf" else args.batches
    cmd = [sys.executable, __file__, "--worker", kind, "--sizes", size, "--batches", batches,
           "--prompt", str(args.prompt), "--gen", str(args.gen), "--steps-per-dispatch", str(args.steps_per_dispatch),
           "--hf-cache", args.hf_cache, "--decode-attention", args.decode_attention, "--kernel", kernel,
           "--page-size", str(args.page_size), "--max-length", str(args.max_length), "--compiler-options", options] + (
               ["--profile"] if args.profile else [])
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        last = proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else "no output"
        error = f"worker rc={proc.returncode}: {last}"
        return [{"impl": kind, "size": size, "batch": b, "device": "?", "error": error} for b in _ints(batches)]
    return [json.loads(ln) for ln in lines]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _table(rows: list[dict], args) -> str:
    device = next((r["device"] for r in rows if r.get("device") not in (None, "?")), "?")
    jax_version = next((r["jax"] for r in rows if "jax" in r), "?")
    bandwidth = hbm_bandwidth(device)
    lines = [
        f"device: {device}; HBM bandwidth: {bandwidth / 1e12 if bandwidth else 'unknown'} TB/s; jax {jax_version}; "
        f"prompt {args.prompt}, gen {args.gen}, steps/dispatch {args.steps_per_dispatch}",
        "",
        "| size | batch | impl | tokens/s | ms/step | GB/s | MBU | vs HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    hf = {(r["size"], r["batch"]): r for r in rows if r["impl"].startswith("hf") and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['batch']} | {r['impl']} | error: {r['error']} | | | | |")
            continue
        mbu = f"{100 * r['achieved_GBps'] * 1e9 / bandwidth:.0f}%" if bandwidth else "n/a"
        base = hf.get((r["size"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and not r["impl"].startswith("hf") else ""
        lines.append(
            f"| {r['size']} | {r['batch']} | {r['impl']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
            f"{r['achieved_GBps']:.0f} | {mbu} | {ratio} |"
        )
    for r in rows:
        if r.get("profile"):
            lines += ["", f"profile {r['size']} batch {r['batch']}: us per decode step | launches per step | kernel"]
            lines += [f"  {us:8.1f} | {count:5.1f} | {name}" for name, us, count in r["profile"]]
    warm = [r for r in rows if "warmup_s" in r]
    if warm:
        lines.append("")
        lines += [
            f"{r['size']} batch {r['batch']}: untimed first pass {r['warmup_s']:.1f} s "
            f"({r['compiled_windows']} compiled attention windows)"
            for r in warm
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.6b,1.7b,4b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=1024)
    parser.add_argument("--steps-per-dispatch", type=int, default=32)
    parser.add_argument("--hf-cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--hf-batches", help="batches of the transformers baseline (default: --batches)")
    parser.add_argument("--decode-attention", choices=("default", "xla", "pallas"), default="default",
                        help="the engine's decode attention (Engine(decode_attention=...); default: its own choice)")
    parser.add_argument("--page-size", type=int, default=32, help="KV page size (Engine(page_size=...))")
    parser.add_argument("--max-length", type=int, default=0,
                        help="the engine's max_target_length (rollout.max_sequence_length; default prompt + gen + 1: "
                             "the tightest fit). The decode kernel reads each slot up to its own length, so a longer "
                             "budget costs only page-table width")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--kernel", default="", help="override the Pallas kernel's settings, e.g. "
                        "method=dot,block_k=32,warps=4,stages=3,min_programs=1024 (models/decode.py DecodeKernel); "
                        "several settings separated by ';' run one after the other ('' = the defaults)")
    parser.add_argument("--compiler-options", default="",
                        help="Engine(decode_compiler_options=): 'name=value,...', 'none' (XLA's defaults) or 'default' "
                             "(the engine's platform default); several sets separated by ';' run one after the other")
    parser.add_argument("--profile", action="store_true", help="print the busiest kernels per step (GPU)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: a < 1 min smoke run")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--worker", choices=("jax", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.batches, args.prompt, args.gen, args.steps_per_dispatch = "tiny", "1,4", 32, 32, 8
        args.hf_batches = None
    args.hf_batches = args.hf_batches or args.batches
    if args.max_length and args.max_length <= args.prompt + args.gen:
        parser.error(f"--max-length {args.max_length} must exceed --prompt + --gen ({args.prompt + args.gen})")
    if args.gen % args.steps_per_dispatch:
        parser.error(f"--gen {args.gen} must be a multiple of --steps-per-dispatch {args.steps_per_dispatch}")
    kernels = args.kernel.split(";")
    for kernel in kernels:  # checks the values here; each worker runs its own
        parse_kernel(kernel)
    option_sets = args.compiler_options.split(";")
    for options in option_sets:
        compiler_options(options)
    if args.worker:
        size, batches = args.sizes, _ints(args.batches)
        if args.worker == "jax":
            rows = _jax_worker(size, batches, args.prompt, args.gen, args.steps_per_dispatch, args.decode_attention,
                               args.profile, args.page_size, args.max_length, args.compiler_options, args.kernel)
        else:
            rows = _hf_worker(size, batches, args.prompt, args.gen, args.hf_cache)
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    rows = []
    for size in args.sizes.split(","):
        if size not in QWEN3:
            parser.error(f"--sizes: unknown size {size!r}; known: {sorted(QWEN3)}")
        for kernel in kernels:
            for options in option_sets:
                rows += _run_worker("jax", size, args, kernel, options)
        if not args.no_hf:
            rows += _run_worker("hf", size, args)
        print(_table(rows, args), flush=True)
    print(f"\ncommand: python bench/decode.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
