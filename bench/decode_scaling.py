"""Decode scaling over the GPUs of one host: tensor parallel vs engine replicas (data parallel).

The rollout engine decodes a Qwen3 shape (random bf16 weights) with every slot filled by
a random ``--prompt``-token prompt, for ``--gen`` tokens, timed after an untimed pass that
compiles every attention window (as bench/decode.py). Layouts of the engine's mesh over
n GPUs:
  tp   ``tensor=n``: one engine, every weight and kv head split n ways, all slots on every GPU
  dp   ``data=n``:  one engine whose slots (and their KV pages) are split n ways, the weights
       replicated: n replicas that never talk to each other during decode
Each (layout, n) runs in its own process seeing only its GPUs; 1 GPU is the baseline of
both, measured in the same run.

    python bench/decode_scaling.py --size 4b --gpus 1,2,4 --batches 64,256
    python bench/decode_scaling.py --tiny       # CPU, fake devices: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode import QWEN3, hbm_bandwidth, kv_bytes_per_token, param_count, qwen3_model  # noqa: E402
from bench.workers import stop_workers_with_the_bench  # noqa: E402


def measure(size: str, layout: str, batches: list[int], prompt: int, gen: int, steps: int) -> list[dict]:
    """Decode throughput of ``layout`` over every device this process sees, per batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from agentrl_jax.rollout import Engine, SamplingParams
    from agentrl_jax.sharding import make_mesh

    n = jax.device_count()
    mesh = make_mesh({"tensor": n} if layout == "tp" else {"data": n})
    model, dtype = qwen3_model(size)
    rows = []
    for batch in batches:
        row = {"size": size, "layout": layout, "gpus": n, "batch": batch, "device": jax.devices()[0].device_kind,
               "jax": jax.__version__}
        try:
            engine = Engine(model, mesh=mesh, max_concurrent_decodes=batch, max_target_length=prompt + gen + 1,
                            max_prefill_length=prompt, cache_dtype=dtype, page_size=32)
            row["attention"] = engine.decode_attention
            params = engine.load_params(model)
            tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, prompt).astype(np.int32)
            sampler = SamplingParams(temperature=1.0, seed=0)
            for timed in (False, True):  # the first pass compiles every attention window of the run
                state = result = None  # free the last pass's decode state first
                state = engine.init_decode_state()
                prefix, _ = engine.prefill(params=params, padded_tokens=tokens, true_length=prompt, sampler=sampler)
                for slot in range(batch):
                    state = engine.insert(prefix, state, slot)
                jax.block_until_ready(state)
                t0 = time.perf_counter()
                for _ in range(gen // steps):
                    state, result = engine.generate(params, state, num_steps=steps)
                    result.convert_to_numpy()
                elapsed = time.perf_counter() - t0
            row["warm_s"] = elapsed
            itemsize = jnp.dtype(dtype).itemsize
            weights = param_count(size) * itemsize // (n if layout == "tp" else 1)  # read per GPU per step
            kv = batch * (prompt + gen / 2) * kv_bytes_per_token(size, itemsize) / n
            step_s = elapsed / gen
            row.update(tokens_per_s=batch * gen / elapsed, step_ms=1e3 * step_s,
                       gbps_per_gpu=(weights + kv) / step_s / 1e9)
            bandwidth = hbm_bandwidth(row["device"])
            if bandwidth:
                row["mbu"] = (weights + kv) / step_s / bandwidth
        except Exception as e:  # noqa: BLE001  (an OOM at one batch must not hide the others)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def _run_worker(layout: str, gpus: list[str], args) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--layouts", layout, "--size", args.size,
           "--batches", args.batches, "--prompt", str(args.prompt), "--gen", str(args.gen),
           "--steps-per-dispatch", str(args.steps_per_dispatch)]
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"))
    if args.tiny:  # n fake CPU devices stand for n GPUs
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={len(gpus)}"
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    error = ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.worker_timeout)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if rows:
            return rows
        error = f"rc={proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    except subprocess.TimeoutExpired:
        error = f"timeout {args.worker_timeout} s"
    return [{"size": args.size, "layout": layout, "gpus": len(gpus), "batch": int(b), "error": error}
            for b in args.batches.split(",")]


def table(rows: list[dict]) -> str:
    """Markdown: tokens/s per (layout, n, batch) and the speed-up over 1 GPU at the same batch."""
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["gpus"] == 1 and "error" not in r}
    out = ["| layout | GPUs | batch | tokens/s | step | speed-up vs 1 GPU | per GPU | HBM GB/s per GPU (MBU) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["gpus"], r["layout"])):
        if "error" in r:
            out.append(f"| {r['layout']} | {r['gpus']} | {r['batch']} | {r['error'][:90]} | | | | |")
            continue
        up = f"{r['tokens_per_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
        per = f"{r['tokens_per_s'] / base[r['batch']] / r['gpus']:.0%}" if r["batch"] in base else "-"
        mbu = f" ({r['mbu']:.0%})" if "mbu" in r else ""
        out.append(f"| {r['layout']} | {r['gpus']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.2f} ms "
                   f"| {up} | {per} | {r['gbps_per_gpu']:,.0f}{mbu} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="4b", choices=sorted(QWEN3))
    p.add_argument("--gpus", default="1,2,4", help="GPU counts (comma-separated); 1 is the baseline")
    p.add_argument("--gpu-ids", default="", help="the GPUs to use, in order (default: 0..max-1)")
    p.add_argument("--layouts", default="tp,dp")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=512)
    p.add_argument("--steps-per-dispatch", type=int, default=32)
    p.add_argument("--worker-timeout", type=float, default=600)
    p.add_argument("--out", default="", help="append every result row (JSON) to this file")
    p.add_argument("--tiny", action="store_true", help="tiny shape on fake CPU devices: checks the script runs")
    p.add_argument("--table", default="", help="print the table of the rows in this --out file and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    stop_workers_with_the_bench()
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    if args.tiny:
        args.size, args.batches, args.prompt, args.gen, args.steps_per_dispatch = "tiny", "4,8", 32, 16, 8
    if args.gen % args.steps_per_dispatch:
        p.error(f"--gen {args.gen} must be a multiple of --steps-per-dispatch {args.steps_per_dispatch}")
    if args.worker:
        batches = [int(b) for b in args.batches.split(",")]
        for row in measure(args.size, args.layouts, batches, args.prompt, args.gen, args.steps_per_dispatch):
            print(json.dumps(row), flush=True)
        return
    counts = sorted({int(g) for g in args.gpus.split(",")})
    ids = args.gpu_ids.split(",") if args.gpu_ids else [str(i) for i in range(max(counts))]
    rows = []
    for n in counts:
        for layout in args.layouts.split(",") if n > 1 else ["tp"]:  # on 1 GPU the layouts are one engine
            for row in _run_worker(layout, ids[:n], args):
                if n == 1:
                    row["layout"] = "1 GPU"
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    device = next((r["device"] for r in rows if "device" in r), "?")
    print(f"\ndevice: {device}; {args.size}, prompt {args.prompt}, {args.gen} tokens decoded, "
          f"{args.steps_per_dispatch} steps per dispatch\n")
    print(table(rows))


if __name__ == "__main__":
    main()
