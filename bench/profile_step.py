"""Where the time of `bench/train_step.py`'s update goes: a profiler trace summarized as a table.

Builds the same jitted update (Qwen3 shape, random weights, one optimizer step over
``--rows`` x ``--seq`` tokens), runs ``--warmup`` steps, traces ``--steps`` more with
``jax.profiler.trace``, and reduces the trace to a small text table on the machine that ran it
(the raw trace is hundreds of MB):

- every device kernel of the trace's GPU stream lines, attributed to the HLO instruction that
  launched it (the ``hlo_op`` stat, else the kernel name), and
- every HLO instruction classified from the compiled module's text: GEMM (cuBLAS custom calls,
  Triton GEMM fusions, dots), cuDNN attention forward / backward, copies and transposes, other
  fusions (elementwise, norms, reductions); each tagged forward or backward (``transpose(`` in
  its op name), inside the logprob chunks (``token_logprobs``) or the optimizer (``optax``),
  with the innermost source line of its metadata.

    python bench/profile_step.py --size 1.7b --rows 4 --seq 4096 --remat dots_attention_saveable \\
        --attention cudnn --out /tmp/prof
    python bench/profile_step.py --size tiny --rows 2 --seq 128 --attention auto --out /tmp/prof  # CPU smoke

Writes ``summary.txt`` and ``summary.json`` under ``--out``. On CPU the trace has no device
plane; the table is then empty and says so (the smoke run checks the script end to end).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][\w\-]*)\(")


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name -> {op, kind, target, op_name, source} from a compiled module's text."""
    files, functions, locations, frames = {}, {}, {}, {}
    section = None
    ops = {}
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and line and line[0].isdigit():
            key, _, value = line.partition(" ")
            if section == "FileNames":
                files[key] = value.strip('"')
            elif section == "FunctionNames":
                functions[key] = value.strip('"')
            elif section == "FileLocations":
                fields = dict(re.findall(r"(\w+)=(\d+)", value))
                locations[key] = fields
            else:
                frames[key] = dict(re.findall(r"(\w+)=(\d+)", value)).get("file_location_id")
            continue
        section = None
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = m.group("rest")
        op = _OPCODE.search(rest)
        info = {"op": op.group("op") if op else "?"}
        for field, pattern in (("kind", r"kind=(k\w+)"), ("target", r'custom_call_target="([^"]+)"'),
                               ("op_name", r'op_name="([^"]+)"'), ("frame", r"stack_frame_id=(\d+)"),
                               ("fusion_kind", r'"kind":"(__[\w$]+)"')):
            found = re.search(pattern, rest)
            if found:
                info[field] = found.group(1)
        loc = locations.get(frames.get(info.pop("frame", None), ""), None)
        if loc:
            path = files.get(loc.get("file_name_id"), "?")
            short = "/".join(path.split("/")[-3:]) if "optax" in path else os.path.basename(path)
            info["source"] = (f"{short}:{loc.get('line')} "
                              f"{functions.get(loc.get('function_name_id'), '?')}")
        ops[m.group("name")] = info
    return ops


def classify(name: str, info: dict | None) -> str:
    """A coarse category of one HLO instruction (or of a kernel without one)."""
    info = info or {}
    target, fusion_kind, op = info.get("target", ""), info.get("fusion_kind", ""), info.get("op", "")
    lowered = name.lower()
    if "fmha" in target or "cudnn" in target and "attention" in target:
        return "attention bwd (cuDNN)" if "backward" in target.lower() else "attention fwd (cuDNN)"
    if "cublas" in target or "gemm" in fusion_kind or op in ("dot", "convolution") or "gemm" in lowered:
        return "GEMM"
    if "cudnn" in target or "cudnn" in fusion_kind:
        return "cuDNN fusion"
    if op in ("copy", "transpose", "copy-start", "copy-done") or lowered.startswith(("copy", "transpose")):
        return "copy/transpose"
    if op in ("dynamic-update-slice", "dynamic-slice", "gather", "scatter", "concatenate", "pad", "slice"):
        return "slicing/gather"
    if not info:
        if "memcpy" in lowered or "memset" in lowered:
            return "copy/transpose"
        if "fmha" in lowered or "flash" in lowered or "sdpa" in lowered:
            return "attention bwd (cuDNN)" if "bprop" in lowered else "attention fwd (cuDNN)"
        if "gemm" in lowered or "xmma" in lowered or "nvjet" in lowered or "cutlass" in lowered:
            return "GEMM"
        return "unattributed"
    return "fusion/elementwise"


def region(info: dict | None) -> str:
    """Which part of the step: optimizer, logprob chunks, layer stack; forward or backward."""
    info = info or {}
    op_name, source = info.get("op_name", ""), info.get("source", "")
    if "optax" in source or "adam" in op_name:
        return "optimizer"
    phase = "bwd" if "transpose(" in op_name else "fwd"
    if any(s in source for s in ("logprobs.py", "logits.py")):
        return f"logprobs {phase}"
    if any(s in source for s in ("layers.py", "decoder.py", "remat.py")):
        return f"layers {phase}"
    return f"other {phase}" if op_name else "other"


def device_kernels(trace_dir: str) -> tuple[list[tuple[str, str, int]], dict]:
    """(kernel name, HLO op or '', duration ns) of every kernel on the GPU stream lines, and notes."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    notes = {"xplane": paths[-1:] and os.path.basename(paths[-1]), "lines": {}, "sample_stats": []}
    kernels = []
    if not paths:
        return kernels, notes
    for plane in ProfileData.from_file(paths[-1]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            events = list(line.events)
            notes["lines"][f"{plane.name}:{line.name}"] = len(events)
            if not line.name.lower().startswith("stream"):
                continue
            for event in events:
                stats = {k: v for k, v in event.stats}
                if len(notes["sample_stats"]) < 3:
                    notes["sample_stats"].append({"name": event.name[:80], **{k: str(v)[:80] for k, v in stats.items()}})
                hlo_op = stats.get("hlo_op") or ""
                kernels.append((event.name, str(hlo_op), int(event.duration_ns)))
    return kernels, notes


def hlo_instruction(kernel: str, hlo_op: str, hlo_ops: dict[str, dict]) -> str:
    """The HLO instruction a kernel belongs to, or the kernel name when none is known.

    Kernels launched from a CUDA graph (XLA's command buffers) carry the command buffer as
    their ``hlo_op``; XLA names its own kernels after their fusion (``loop_add_fusion_3`` for
    ``loop_add_fusion.3``), so the kernel name finds the instruction. Library kernels (cuBLAS,
    cuDNN) inside a graph keep their library names and are classified by those.
    """
    if hlo_op and hlo_op in hlo_ops:
        return hlo_op
    for candidate in (kernel, re.sub(r"_(\d+)$", r".\1", kernel), re.sub(r"_(\d+)_\d+$", r".\1", kernel)):
        if candidate in hlo_ops:
            return candidate
    return kernel


def summarize(kernels, hlo_ops: dict[str, dict], steps: int, step_s: float, top: int) -> dict:
    """Per-category, per-region and per-op device milliseconds per step."""
    by_op = collections.defaultdict(lambda: [0, 0])
    for kernel, hlo_op, ns in kernels:
        key = hlo_instruction(kernel, hlo_op, hlo_ops)
        by_op[key][0] += ns
        by_op[key][1] += 1
    def per_step(ns):
        return ns / 1e6 / steps

    categories, regions = collections.Counter(), collections.Counter()
    rows = []
    for key, (ns, count) in by_op.items():
        info = hlo_ops.get(key)
        cat, reg = classify(key, info), region(info)
        categories[cat] += ns
        regions[f"{reg} | {cat}"] += ns
        rows.append({"op": key[:60], "category": cat, "region": reg, "ms_per_step": per_step(ns),
                     "launches_per_step": count / steps, "source": (info or {}).get("source", ""),
                     "op_name": (info or {}).get("op_name", "")[-90:]})
    rows.sort(key=lambda r: -r["ms_per_step"])
    busy = sum(ns for ns, _ in by_op.values())
    return {"step_ms": step_s * 1e3, "device_busy_ms_per_step": per_step(busy),
            "categories": {k: per_step(v) for k, v in categories.most_common()},
            "regions": {k: per_step(v) for k, v in regions.most_common()}, "top_ops": rows[:top]}


def render(summary: dict, header: str) -> str:
    out = [header, f"step (wall, median): {summary['step_ms']:.1f} ms; device kernels: "
           f"{summary['device_busy_ms_per_step']:.1f} ms/step", "", "| category | ms/step | share |", "|---|---|---|"]
    busy = max(summary["device_busy_ms_per_step"], 1e-9)
    out += [f"| {k} | {v:.2f} | {v / busy:.1%} |" for k, v in summary["categories"].items()]
    out += ["", "| region / category | ms/step | share |", "|---|---|---|"]
    out += [f"| {k} | {v:.2f} | {v / busy:.1%} |" for k, v in summary["regions"].items()]
    out += ["", "| op | category | region | ms/step | launches/step | source | op_name |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {r['op']} | {r['category']} | {r['region']} | {r['ms_per_step']:.2f} | {r['launches_per_step']:.0f} "
            f"| {r['source']} | {r['op_name']} |" for r in summary["top_ops"]]
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.7b")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--remat", default="dots_attention_saveable")
    p.add_argument("--attention", default="cudnn", choices=["auto", "xla", "cudnn"])
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--lm-head-dtype", default="param", choices=["param", "compute"])
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=4, help="untimed-by-the-profiler steps (all but the first timed)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from train_step import SHAPES, build_update, model_flops_per_token
    from agentrl_jax.models import DecoderConfig

    cfg = DecoderConfig(architecture="qwen3", qk_norm=True, rope_theta=1e6, **SHAPES[args.size])
    step, state, batch, z = build_update(
        cfg, args.rows, args.seq, jnp.float32 if args.param_dtype == "float32" else jnp.bfloat16, args.remat,
        None if args.attention == "auto" else args.attention, args.chunk_size,
        args.lm_head_dtype)
    compiled = step.lower(state, batch, z).compile()
    os.makedirs(args.out, exist_ok=True)
    hlo_ops = parse_hlo(compiled.as_text())
    untraced = []
    for _ in range(args.warmup):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch, z)
        jax.block_until_ready(metrics["loss"])
        untraced.append(time.perf_counter() - t0)
    times = []
    trace_dir = os.path.join(args.out, "trace")
    with jax.profiler.trace(trace_dir):
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batch, z)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t0)
    kernels, notes = device_kernels(trace_dir)
    step_s = float(np.median(times))
    summary = summarize(kernels, hlo_ops, args.steps, step_s, args.top)
    flops = model_flops_per_token(cfg, args.seq) * args.rows * args.seq
    plain_s = float(np.median(untraced[1:] or untraced))
    peak = jax.devices()[0].memory_stats() or {}
    result = {"size": args.size, "rows": args.rows, "seq": args.seq, "remat": args.remat, "attention": args.attention,
              "param_dtype": args.param_dtype, "lm_head_dtype": args.lm_head_dtype, "chunk_size": args.chunk_size,
              "step_s": plain_s, "tokens_per_s": args.rows * args.seq / plain_s, "traced_step_s": step_s,
              "mfu": flops / plain_s / 989e12, "peak_gib": peak.get("peak_bytes_in_use", 0) / 2**30}
    header = (f"{jax.devices()[0].device_kind}: {args.size} {args.rows}x{args.seq} remat={args.remat} "
              f"attention={args.attention} param={args.param_dtype} lm_head={args.lm_head_dtype} "
              f"chunk={args.chunk_size}; model TFLOP/step {flops / 1e12:.1f}; traced steps {args.steps}\n"
              f"untraced step (median of warm-up steps 2..{args.warmup}): {plain_s * 1e3:.1f} ms, "
              f"{result['tokens_per_s']:.0f} tok/s, MFU {result['mfu']:.1%} (989 TFLOP/s peak), "
              f"peak {result['peak_gib']:.1f} GiB")
    if not kernels:
        header += "\n(no GPU kernels in the trace: nothing to attribute)"
    text = render(summary, header)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"result": result, **summary, "notes": notes, "hlo_instructions": len(hlo_ops)}, f, indent=1)
    print("RESULT " + json.dumps(result))
    print(text)
    print(json.dumps(notes)[:3000])


if __name__ == "__main__":
    main()
