"""Training scaling: the GRPO update of a Qwen3 shape on 1, 2, 4 ... GPUs of one host, same run.

The update of bench/train_step.py (forward, chunked tempered logprobs, PPO-clip loss,
backward, AdamW; bf16 compute, float32 master params) on a mesh of the first n GPUs, with
the tokens per GPU held fixed (weak scaling): rows = n x tokens_per_gpu / seq. Layouts:
``fsdp`` (every weight and its optimizer state split n ways, rows split n ways) and ``tpK``
(K-way tensor parallel inside fsdp groups of n / K). Each (size, layout, n) runs in its own
process that sees only its GPUs (CUDA_VISIBLE_DEVICES), the 1-GPU baseline included, so
the baseline is measured in the same run on the same machine.

    python bench/train_scaling.py --sizes 1.7b,4b --gpus 1,2,4
    python bench/train_scaling.py --sizes 4b --gpus 4 --layouts fsdp,tp2
    python bench/train_scaling.py --tiny        # CPU, fake devices: checks the script runs
    python bench/train_scaling.py --tiny --gpus 2 --hlo   # how the update splits the tokens (compile only)
    python bench/train_scaling.py --sizes 1.7b --gpus 1,4 --profile /tmp/prof   # + a trace of 2 more steps
    python bench/trace_summary.py /tmp/prof                     # where those steps' time goes, per GPU

The update is traced under ``jax.set_mesh`` so the decoder's activation constraints apply
(``--no-set-mesh``: as the trainer's jits are traced, sharding propagation alone).

``--profile DIR``: after the timed steps each worker traces ``PROFILED_STEPS`` more with
``jax.profiler`` (each in a ``train_step`` annotation, which bench/trace_summary.py splits the
trace by) into DIR/<size>_<layout>_<n>gpu/; the timed steps are not traced, so the table's
numbers are the same with or without it.

Scaling efficiency = (tokens/s per GPU on n GPUs) / (tokens/s on 1 GPU; on the fewest GPUs
measured where one GPU does not hold the model and its optimizer state). MFU counts model
FLOPs as bench/train_step.py does (no recompute) over the card's dense bf16 peak.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.trace_summary import STEP_NAME  # noqa: E402
from bench.train_step import SHAPES, device_peak, make_batch, model_flops_per_token  # noqa: E402
from bench.workers import stop_workers_with_the_bench  # noqa: E402

PROFILED_STEPS = 2


def _mesh_shape(layout: str, n: int) -> dict[str, int]:
    if layout == "fsdp":
        return {"data": 1, "fsdp": n, "tensor": 1}
    if layout.startswith("tp") and layout[2:].isdigit():
        tensor = int(layout[2:])
        if n % tensor:
            raise ValueError(f"layout {layout}: {n} GPUs do not split into {tensor}-way tensor groups")
        return {"data": 1, "fsdp": n // tensor, "tensor": tensor}
    raise ValueError(f"unknown layout {layout!r}: use fsdp or tpK (K-way tensor parallel)")


def measure(size: str, layout: str, seq: int, tokens_per_gpu: int, steps: int, remat: str, attention: str,
            chunk_size: int, lm_head_dtype: str, set_mesh: bool = True, hlo: bool = False, profile: str = "") -> dict:
    """One (size, layout) measurement on every device this process sees.

    One body for the timing and for ``hlo`` (compile only): both need the same model, mesh,
    batch and jitted update, which is most of its length.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from agentrl_jax.losses import global_normalizer
    from agentrl_jax.models import Decoder, DecoderConfig, param_shardings, split_params
    from agentrl_jax.sharding import make_mesh
    from agentrl_jax.train.step import LossSettings, init_train_state, update_step

    n = jax.device_count()
    mesh = make_mesh(_mesh_shape(layout, n))
    cfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[size])
    model = Decoder(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, remat=remat,
                    attention_impl=None if attention == "auto" else attention, lm_head_dtype=lm_head_dtype,
                    rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    params = jax.device_put(params, param_shardings(params, mesh))
    del model
    rows = n * tokens_per_gpu // seq
    ids, mask, adv = make_batch(rows, seq, cfg.vocab_size)
    host = {
        "input_ids": ids, "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)),
        "segment_ids": np.ones((rows, seq), np.int32), "targets": np.roll(ids, -1, axis=1), "loss_mask": mask,
        "advantages": adv, "old_logprobs": -5.0 * mask, "rollout_logprobs": np.zeros((rows, seq), np.float32),
        "sequence_ids": np.broadcast_to(np.arange(rows, dtype=np.int32)[:, None], (rows, seq)),
    }
    rows_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    batch = {k: jax.device_put(np.ascontiguousarray(v), rows_sharding) for k, v in host.items()}
    optimizer = optax.adamw(1e-6)
    state = init_train_state(params, optimizer, 0)
    state_sharding = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(mesh, PartitionSpec())
    settings = LossSettings(loss="ppo", hparams=(("eps_high", 0.28), ("eps_low", 0.2)), chunk_size=chunk_size)
    step = jax.jit(functools.partial(update_step, graphdef=graphdef, optimizer=optimizer, settings=settings,
                                     num_micro_batches=1, num_sequences=None),
                   in_shardings=(state_sharding, rows_sharding, replicated),
                   out_shardings=(state_sharding, replicated), donate_argnums=(0,))
    z = jax.device_put(global_normalizer(batch["loss_mask"], "token-mean"), replicated)
    # Traced under the mesh, the decoder pins its activations (batch over data x fsdp); without
    # it, sharding propagation alone decides, and on 2 fake CPU devices it computed every row
    # on every device.
    context = jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext()
    if hlo:  # this bench's update, and the trainer's form of it (rows sliced from a replicated batch)
        # As train/step.py make_update_fn's jit (without LoRA); the trainer's own update is a Python
        # function that sets the mesh around its jit, which no outer trace may do.
        def sliced(state, whole, rows_index, z):
            minibatch = jax.tree.map(lambda x: x[rows_index], whole)
            return update_step(state, minibatch, z, graphdef=graphdef, optimizer=optimizer, settings=settings,
                               num_micro_batches=1, num_sequences=None)

        trainer = jax.jit(sliced, in_shardings=(state_sharding, replicated, replicated, replicated),
                          out_shardings=(state_sharding, replicated))
        whole = {k: jax.device_put(np.ascontiguousarray(v), replicated) for k, v in host.items()}
        rows_index = jax.device_put(np.arange(rows, dtype=np.int32), replicated)
        with context:
            bench_text = step.lower(state, batch, z).compile().as_text()
            trainer_text = trainer.lower(state, whole, rows_index, z).compile().as_text()
        return {"size": size, "gpus": n, "set_mesh": set_mesh, "bench": token_split(bench_text, rows * seq, n),
                "trainer": token_split(trainer_text, rows * seq, n)}
    with context:
        t0 = time.perf_counter()
        state, metrics = step(state, batch, z)
        jax.block_until_ready(metrics["loss"])
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = step(state, batch, z)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t0)
        loss = float(metrics["loss"])
        traced = trace_steps(step, state, batch, z, profile) if profile else {}
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices()]
    step_s = float(np.median(times))
    name, peak = device_peak()
    flops = model_flops_per_token(cfg, seq) * rows * seq
    return {"size": size, "layout": layout, "gpus": n, "mesh": dict(mesh.shape), "rows": rows, "seq": seq,
            "device": name, "jax": jax.__version__, "step_s": step_s, "steps_s": times, "compile_s": compile_s,
            "tokens_per_s": rows * seq / step_s, "tokens_per_s_per_gpu": rows * seq / step_s / n,
            "mfu": flops / step_s / n / peak if peak else None, "loss": loss,
            "peak_gib_max": max(peaks) / 2**30, "remat": remat, "attention": attention,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "set_mesh": set_mesh, **traced}


def trace_steps(step, state, batch, z, folder: str):
    """``PROFILED_STEPS`` more steps under ``jax.profiler``, each in a ``STEP_NAME`` annotation
    (``state`` is donated to them); the trace's folder, or why there is none: a profiler that does
    not start must not lose the timed steps measured before it."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python calls would only bury the kernels (and the trace size)
    try:
        jax.profiler.start_trace(folder, create_perfetto_trace=True, profiler_options=options)
        try:
            for i in range(PROFILED_STEPS):
                with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                    state, metrics = step(state, batch, z)
                    jax.block_until_ready((state, metrics))  # every kernel of the step inside its window
        finally:
            jax.profiler.stop_trace()
    except Exception as e:  # noqa: BLE001 (the row says why; the timing stands)
        return {"profile_error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"profile": folder, "profiled_steps": PROFILED_STEPS}


def token_split(hlo_text: str, tokens: int, n: int) -> dict:
    """How the compiled update splits the tokens: its 2-D matmuls whose rows are all ``tokens``
    (every device computes every row) or ``tokens / n`` (each device its share)."""
    shapes = re.findall(r"= \w+\[(\d+),\d+\]\S* dot\(", hlo_text)
    return {"dots_all_tokens": sum(int(m) == tokens for m in shapes),
            "dots_share_of_tokens": sum(int(m) == tokens // n for m in shapes) if n > 1 else 0,
            "collectives": {c: hlo_text.count(c + "(") for c in ("all-gather", "reduce-scatter", "all-reduce",
                                                                 "all-to-all")}}


def _run_worker(size: str, layout: str, gpus: list[str], args) -> dict:
    """One measurement in a fresh process that sees ``gpus`` only."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--sizes", size, "--layouts", layout,
           "--seq", str(args.seq), "--tokens-per-gpu", str(args.tokens_per_gpu), "--steps", str(args.steps),
           "--remat", args.remat, "--attention", args.attention, "--chunk-size", str(args.chunk_size),
           "--lm-head-dtype", args.lm_head_dtype] + (["--no-set-mesh"] if args.no_set_mesh else []) + (
               ["--hlo"] if args.hlo else []) + (
               ["--profile", os.path.join(args.profile, f"{size}_{layout}_{len(gpus)}gpu")] if args.profile else [])
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=args.mem_fraction)
    if args.cpu_devices:  # CPU smoke run: n fake devices stand for n GPUs
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={len(gpus)}"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    log = os.path.join(args.log_dir, f"{size}_{layout}_{len(gpus)}gpu_{args.attention}.log") if args.log_dir else ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired as e:
        _keep_log(log, cmd, f"timeout {args.worker_timeout} s", e.stdout, e.stderr)
        return {"size": size, "layout": layout, "gpus": len(gpus), "error": f"timeout {args.worker_timeout} s"}
    _keep_log(log, cmd, f"rc {proc.returncode}", proc.stdout, proc.stderr)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if args.hlo and results:
        for r in results:
            print(json.dumps(r))
        return {"size": size, "layout": layout, "gpus": len(gpus), "error": "--hlo: compiled only, no timing"}
    if results:
        return results[0]
    # the exception's own line (XLA's errors end in a source-location trace, JAX's in a note)
    lines = proc.stderr.strip().splitlines() or ["no output"]
    raised = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception)\b", ln)]
    return {"size": size, "layout": layout, "gpus": len(gpus), "error": f"rc={proc.returncode}: "
            f"{(raised or lines)[-1][:400]}", "stderr_tail": "\n".join(lines[-25:])[-3000:], "log": log}


def _keep_log(path: str, cmd: list[str], status: str, stdout, stderr) -> None:
    """A worker's whole output in ``path`` (nothing without --log-dir): XLA's errors run to many
    lines and the row keeps only the tail, which lost the cause of a failure before."""
    if not path:
        return
    text = lambda s: s.decode(errors="replace") if isinstance(s, bytes) else (s or "")  # noqa: E731
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n{status}\n--- stdout\n{text(stdout)}\n--- stderr\n{text(stderr)}")


def table(rows: list[dict]) -> str:
    """Markdown: per (size, layout, n) the step, tokens/s per GPU, MFU and the efficiency against the
    fewest GPUs measured for that size (1 GPU unless it did not fit)."""
    base = {}
    for r in sorted((r for r in rows if "error" not in r), key=lambda r: -r["gpus"]):
        base[r["size"]] = (r["gpus"], r["tokens_per_s_per_gpu"])
    out = ["| shape | layout | GPUs | tokens/update | step | tokens/s | tokens/s per GPU | MFU | efficiency "
           "| peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['size']} | {r['layout']} | {r['gpus']} | - | - | - | - | - | {r['error'][:80]} | - |")
            continue
        gpus, per_gpu = base[r["size"]]
        eff = f"{r['tokens_per_s_per_gpu'] / per_gpu:.1%}" + ("" if gpus == 1 else f" (vs {gpus} GPUs)")
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        out.append(f"| {r['size']} | {r['layout']}, remat {r['remat']} | {r['gpus']} | {r['rows']}x{r['seq']} | {1e3 * r['step_s']:.0f} ms "
                   f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {eff} "
                   f"| {r['peak_gib_max']:.1f} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1.7b,4b")
    p.add_argument("--gpus", default="1,2,4", help="GPU counts (comma-separated); 1 is the baseline")
    p.add_argument("--gpu-ids", default="", help="the GPUs to use, in order (default: 0..max-1)")
    p.add_argument("--layouts", default="fsdp", help="fsdp and/or tpK, comma-separated (tpK only where K | n)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--tokens-per-gpu", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--remat", default="dots_attention_saveable")
    p.add_argument("--attention", default="cudnn", choices=["auto", "xla", "cudnn", "splash"])
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--lm-head-dtype", default="compute", choices=["param", "compute"])
    p.add_argument("--worker-timeout", type=float, default=600)
    p.add_argument("--mem-fraction", default="0.95", help="XLA_PYTHON_CLIENT_MEM_FRACTION of each worker")
    p.add_argument("--out", default="", help="append every result row (JSON) to this file")
    p.add_argument("--log-dir", default="", help="write each worker's whole stdout and stderr to a file here")
    p.add_argument("--tiny", action="store_true", help="tiny shape on fake CPU devices: checks the script runs")
    p.add_argument("--no-set-mesh", action="store_true",
                   help="trace the update without jax.set_mesh (as the trainer's jits are): no activation "
                        "constraints, sharding propagation alone splits the work")
    p.add_argument("--hlo", action="store_true",
                   help="compile only and print how the update splits the tokens over the devices, traced with "
                        "and without jax.set_mesh (CPU: --tiny)")
    p.add_argument("--profile", default="", metavar="DIR",
                   help=f"after the timed steps, trace {PROFILED_STEPS} more with jax.profiler into "
                        "DIR/<size>_<layout>_<n>gpu/ (read them with bench/trace_summary.py DIR)")
    p.add_argument("--table", default="", help="print the table of the rows in this --out file and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stop_workers_with_the_bench()
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    args.cpu_devices = args.tiny
    if args.tiny:
        args.sizes, args.seq, args.tokens_per_gpu, args.steps, args.attention = "tiny", 64, 64, 2, "xla"
    if args.worker and args.hlo:
        for set_mesh in (False, True):
            print("RESULT " + json.dumps(measure(args.sizes, args.layouts, args.seq, args.tokens_per_gpu, args.steps,
                                                 args.remat, args.attention, args.chunk_size, args.lm_head_dtype,
                                                 set_mesh=set_mesh, hlo=True)), flush=True)
        return
    if args.worker:
        result = measure(args.sizes, args.layouts, args.seq, args.tokens_per_gpu, args.steps, args.remat,
                         args.attention, args.chunk_size, args.lm_head_dtype, set_mesh=not args.no_set_mesh,
                         profile=args.profile)
        print("RESULT " + json.dumps(result), flush=True)
        return
    counts = sorted({int(g) for g in args.gpus.split(",")})
    ids = args.gpu_ids.split(",") if args.gpu_ids else [str(i) for i in range(max(counts))]
    if len(ids) < max(counts):
        p.error(f"--gpu-ids: {len(ids)} GPUs for a run on {max(counts)}")
    if args.tokens_per_gpu % args.seq:
        p.error(f"--tokens-per-gpu ({args.tokens_per_gpu}) must be a multiple of --seq ({args.seq})")
    rows = []
    for size in args.sizes.split(","):
        for layout in args.layouts.split(","):
            for n in counts:
                if layout != "fsdp" and (n % int(layout[2:]) or n < int(layout[2:])):
                    continue
                row = _run_worker(size, layout, ids[:n], args)
                print(json.dumps({k: v for k, v in row.items() if k != "steps_s"}), flush=True)
                rows.append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    device = next((r["device"] for r in rows if "device" in r), "?")
    print(f"\ndevice: {device}; {args.tokens_per_gpu} tokens per GPU, rows of {args.seq}; remat {args.remat}, "
          f"attention {args.attention}, lm head {args.lm_head_dtype}, chunks of {args.chunk_size}\n")
    print(table(rows))
    if args.profile:
        print(f"\ntraces in {args.profile}: python bench/trace_summary.py {args.profile}")


if __name__ == "__main__":
    main()
