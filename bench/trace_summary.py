"""Where a traced step's time goes on each device: compute, collectives, and how much of the
collectives no compute kernel hides.

    python bench/trace_summary.py /tmp/prof/1.7b_fsdp_1gpu /tmp/prof/1.7b_fsdp_4gpu
    python bench/trace_summary.py /tmp/prof --json summary.json     # every trace under /tmp/prof

Reads the Chrome/Perfetto trace JSON that ``jax.profiler`` writes (``perfetto_trace.json.gz``,
else ``*.trace.json.gz``, under ``plugins/profile/<run>/``; bench/train_scaling.py ``--profile``
writes one per worker). Per device and per traced step it reports, in ms:

  step         the host's ``train_step`` annotation (dispatch to ready, as the bench times a step)
  busy         the union of the device's kernels (any stream)
  compute      the union of its compute kernels
  all-gather, reduce-scatter, all-reduce, other coll.   the union of each kind's kernels
  exposed      collective time no compute kernel overlaps (collectives minus compute)
  idle         step - busy (no kernel running: launch gaps, host work, waiting)

so that step = compute + exposed + (memcpy not under compute or a collective) + idle.

Rules, in order (the first that matches decides):
  device       a process named ``/device:GPU:N`` (or TPU) whose lines named ``Stream #...`` hold
               its kernels (TPU: the ``XLA Ops`` line); the other lines (``XLA Ops``,
               ``XLA Modules``, ``Steps``...) re-state the same time and are skipped. Without such a
               process (the CPU backend), the XLA:CPU thunk events carrying ``device_ordinal`` and
               ``hlo_op``, whichever host thread ran them, less the control-flow thunks (while,
               conditional, call) that hold other thunks: counted as compute they would hide the
               collectives inside them.
  collective   the kernel's name starts with ``nccl``, or its ``hlo_op`` is a collective
               (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute,
               collective-broadcast, send, recv; with or without ``-start``/``-done`` and ``.N``)
  kind         AllGather / ReduceScatter / AllReduce in the kernel's name, else in its ``hlo_op``;
               anything else (all-to-all, permutes, ``ncclDevKernel_Generic``) is "other coll."
  memcpy       the name starts with ``Memcpy`` or ``Memset``
  compute      every other kernel
  step         a kernel belongs to the step whose host window holds its start, cut at the
               window's end; without ``train_step`` annotations, one window per device from its
               first kernel to its last
"""

from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import os
import re
import sys
from collections import Counter, defaultdict

STEP_NAME = "train_step"  # the host annotation bench/train_scaling.py puts around each traced step
KINDS = ("all-gather", "reduce-scatter", "all-reduce")
COLLECTIVE_OPS = re.compile(r"^(all-gather|reduce-scatter|all-reduce|all-to-all|ragged-all-to-all|collective-permute|"
                            r"collective-broadcast|send|recv)(-start|-done)?(\.\d+)*$")
DEVICE_PROCESS = re.compile(r"/device:(GPU|TPU):(\d+)")
CONTROL_FLOW = re.compile(r"^(while|conditional|call)(\.\d+)*$")

Interval = tuple[float, float]


# -- interval arithmetic (times in microseconds, as the trace holds them) --------------------------

def union(intervals) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time; touching intervals are merged."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(merged: list[Interval]) -> float:
    return sum(e - s for s, e in merged)


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time in ``a`` outside ``b`` (both as ``union`` returns them)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def covered(interval: Interval, merged: list[Interval], starts: list[float]) -> float:
    """How much of ``interval`` the disjoint ``merged`` (``starts``: their starts) covers."""
    start, end = interval
    k, total = max(bisect.bisect_right(starts, start) - 1, 0), 0.0
    while k < len(merged) and merged[k][0] < end:
        total += max(0.0, min(end, merged[k][1]) - max(start, merged[k][0]))
        k += 1
    return total


# -- classification ---------------------------------------------------------------------------------

def _squash(text: str) -> str:
    return re.sub(r"[-_ ]", "", text.lower())


def classify(name: str, hlo_op: str) -> str:
    """"compute", "memcpy", or the collective's kind: one of KINDS or "other coll."."""
    if name.lower().startswith("nccl") or COLLECTIVE_OPS.match(hlo_op):
        for text in (_squash(name), _squash(hlo_op)):
            for kind in KINDS:
                if _squash(kind) in text:
                    return kind
        return "other coll."
    if name.lower().startswith(("memcpy", "memset")):
        return "memcpy"
    return "compute"


# -- reading a trace --------------------------------------------------------------------------------

def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list (not a Chrome/Perfetto trace JSON)")
    return events


def device_timelines(events: list[dict]) -> tuple[dict[str, list[tuple]], list[str]]:
    """{device: [(start, end, name, hlo_op), ...]} by the rules above, and what was found (lines)."""
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    devices, lines_of, notes = {}, defaultdict(set), []
    for (pid, tid), name in names.items():
        if tid is None and (m := DEVICE_PROCESS.search(name)):
            devices[pid] = f"{m[1]}:{m[2]}"
    for (pid, tid), name in names.items():
        if tid is not None and pid in devices:
            lines_of[pid].add((tid, name))
    timelines: dict[str, list[tuple]] = {}
    for pid, device in sorted(devices.items(), key=lambda kv: kv[1]):
        lines = lines_of[pid]
        keep = {t for t, n in lines if n.startswith("Stream")} or {t for t, n in lines if n == "XLA Ops"}
        skipped = sorted({re.sub(r"#\d+", "#N", n) for t, n in lines if t not in keep})
        if not keep:
            notes.append(f"{device}: no 'Stream #' or 'XLA Ops' line (lines: {sorted(n for _, n in lines)}): skipped")
            continue
        kept = sorted({re.sub(r"#\d+", "#N", n) for t, n in lines if t in keep})
        notes.append(f"{device}: {len(keep)} kernel line(s) {kept}; skipped lines {skipped}")
        timelines[device] = [(e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("hlo_op", ""))
                             for e in events if e.get("ph") == "X" and e.get("pid") == pid and e.get("tid") in keep]
    if timelines:
        return timelines, notes
    for e in events:  # the CPU backend: XLA:CPU thunks on the host's threads
        args = e.get("args", {})
        thunk = e.get("ph") == "X" and "device_ordinal" in args and "hlo_op" in args
        if thunk and not CONTROL_FLOW.match(args["hlo_op"]):
            timelines.setdefault(f"CPU:{args['device_ordinal']}", []).append(
                (e["ts"], e["ts"] + e["dur"], args["hlo_op"], args["hlo_op"]))
    if timelines:
        notes.append("no /device:GPU or TPU process: a CPU backend trace; used the XLA:CPU thunk events (args "
                     "device_ordinal, hlo_op) of the host threads. A CPU collective's time includes waiting at "
                     "the rendezvous for the other devices, and its devices share the cores")
        return dict(sorted(timelines.items())), notes
    processes = sorted(n for (_, tid), n in names.items() if tid is None)
    raise ValueError(f"no device timeline: no /device:GPU:N or TPU process with kernel lines, and no XLA:CPU thunk "
                     f"events; processes: {processes}")


def step_windows(events: list[dict]) -> list[Interval]:
    """The host's ``STEP_NAME`` annotations (a device's derived ``Steps`` line, which may carry the
    same name, is left out: each step would count once per device)."""
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and DEVICE_PROCESS.search(e["args"]["name"])}
    return sorted({(e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("name") == STEP_NAME and e.get("pid") not in device_pids})


# -- the summary ------------------------------------------------------------------------------------

def window_summary(kernels: list[tuple], window: Interval) -> tuple[dict, dict[str, float]]:
    """One device's step: the row (ms) and each collective op's exposed time (ms)."""
    lo, hi = window
    inside = [(s, min(e, hi), name, op) for s, e, name, op in kernels if lo <= s < hi]
    kinds = [classify(name, op) for _, _, name, op in inside]
    by_class = defaultdict(list)
    for (s, e, _, _), kind in zip(inside, kinds):
        by_class[kind].append((s, e))
    compute = union(by_class["compute"])
    collectives = union(iv for kind, ivs in by_class.items() if kind not in ("compute", "memcpy") for iv in ivs)
    busy = length(union((s, e) for s, e, _, _ in inside))
    exposed = length(subtract(collectives, compute))
    ms = 1e-3
    row = {"span": (hi - lo) * ms, "busy": busy * ms, "compute": length(compute) * ms,
           **{kind: length(union(by_class[kind])) * ms for kind in (*KINDS, "other coll.")},
           "exposed": exposed * ms, "memcpy": length(union(by_class["memcpy"])) * ms, "idle": (hi - lo - busy) * ms,
           "kernels": len(inside), "collective_kernels": sum(k not in ("compute", "memcpy") for k in kinds)}
    starts = [s for s, _ in compute]
    per_op: dict[str, float] = Counter()
    for (s, e, name, op), kind in zip(inside, kinds):
        if kind not in ("compute", "memcpy"):
            per_op[op or name] += (e - s - covered((s, e), compute, starts)) * ms
    return row, per_op


def summarize(path: str) -> dict:
    """Every device's rows (one per step) of the trace at ``path``, what was found, and the
    collective ops that are exposed longest (ms per step, mean over the devices)."""
    events = load_events(path)
    timelines, notes = device_timelines(events)
    windows = step_windows(events)
    if not windows:
        notes.append(f"no '{STEP_NAME}' annotations: one window per device from its first kernel to its last")
    rows, exposed_ops, outside = [], Counter(), 0
    for device, kernels in timelines.items():
        spans = windows or ([(min(s for s, *_ in kernels), max(e for _, e, *_ in kernels))] if kernels else [])
        outside += sum(not any(lo <= s < hi for lo, hi in spans) for s, *_ in kernels)
        for i, window in enumerate(spans):
            row, per_op = window_summary(kernels, window)
            rows.append({"device": device, "step": i, **row})
            exposed_ops.update(per_op)
    if outside:
        notes.append(f"{outside} kernel(s) started outside every step window (not counted)")
    count = max(len(rows), 1)
    top = [(op, t / count) for op, t in exposed_ops.most_common(8)]
    return {"trace": path, "found": notes, "rows": rows, "top_exposed": top}


def mean_row(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k not in ("device", "step")}


COLUMNS = ("span", "busy", "compute", *KINDS, "other coll.", "exposed", "idle")  # "span": the step's window


def table(summaries: list[tuple[str, dict]]) -> str:
    """Markdown: a row per (trace, device, step) and a mean row per trace; then what each trace
    held and its longest-exposed collective ops."""
    heads = [f"{'step' if c == 'span' else c} ms" for c in COLUMNS]
    out = ["| trace | device | step | " + " | ".join(heads) + " | exposed / step |",
           "|---|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for label, s in summaries:
        rows = s["rows"]
        for r in [*rows, {"device": "mean", "step": "-", **mean_row(rows)}] if rows else []:
            share = f"{r['exposed'] / r['span']:.1%}" if r["span"] else "-"
            out.append(f"| {label} | {r['device']} | {r['step']} | " + " | ".join(f"{r[c]:.1f}" for c in COLUMNS)
                       + f" | {share} |")
    for label, s in summaries:
        out += ["", f"{label} ({s['trace']}):", *(f"- {note}" for note in s["found"])]
        if s["top_exposed"]:
            out.append("- longest-exposed collective ops (ms per device-step): " + ", ".join(
                f"`{op}` {t:.2f}" for op, t in s["top_exposed"]))
    return "\n".join(out)


def find_traces(path: str) -> list[tuple[str, str]]:
    """(label, trace file) for a trace file, or for every profile run under a folder (its
    ``perfetto_trace.json.gz``, else its ``*.trace.json.gz``); the label is the folder above
    ``plugins/`` relative to ``path``."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    found = []
    runs = sorted(glob.glob(os.path.join(path, "**", "plugins", "profile", "*"), recursive=True))
    for run in runs:
        files = glob.glob(os.path.join(run, "perfetto_trace.json.gz")) or sorted(
            glob.glob(os.path.join(run, "*.trace.json.gz")))
        top = run.split(os.sep + "plugins" + os.sep)[0]
        label = os.path.basename(os.path.abspath(path)) if os.path.samefile(top, path) else os.path.relpath(top, path)
        if sum(r.startswith(top + os.sep) for r in runs) > 1:  # several runs into one folder: which is which
            label += "@" + os.path.basename(run)
        found += [(label if len(files) == 1 else f"{label}/{os.path.basename(f)}", f) for f in files]
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="trace files, or folders holding jax.profiler runs")
    p.add_argument("--json", default="", help="also write the rows and findings to this file")
    args = p.parse_args(argv)
    traces = [t for path in args.paths for t in find_traces(path)]
    if not traces:
        raise SystemExit(f"trace_summary: no trace (perfetto_trace.json.gz or *.trace.json.gz under plugins/profile/) "
                         f"in {args.paths}")
    summaries = []
    for label, trace in traces:
        try:
            summaries.append((label, summarize(trace)))
        except (ValueError, KeyError, OSError) as e:
            raise SystemExit(f"trace_summary: {trace}: {type(e).__name__}: {e}") from None
    print(table(summaries))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: s for label, s in summaries}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
