"""When the device idles during a traced rollout, and what the host was doing then.

`bench/rollout.py --profile DIR` traces one pass with `jax.profiler` and reduces the trace
here, on the machine that ran it:

- the device's busy time: the union of the kernels on the GPU plane's stream lines
  (memory copies are counted apart: they do not keep the SMs busy), over the span from the
  pass's first kernel to its last;
- its idle gaps, by size, and each gap's overlap with the rollout thread's phases, the
  ``rollout/*`` `jax.profiler.TraceAnnotation`s of `rollout.dispatcher` (prepare: admission,
  page reservation, prefill planning; prefill_call / decode_call: the engine's host side up
  to the dispatch; wait: blocked on a result; accept / accept_first: the stop checks) and
  the time outside any tick (the event loop: agents, tools, resolving futures); and inside
  the engine calls, its ``engine/*`` annotations (pack, sync, put_rows, launch, ...).

A gap the host spends inside ``wait`` is the device's own latency (a transfer, or a kernel
queue drained before the next launch); a gap spent in the other phases is host work on the
critical path. The clocks agree: the profiler puts device events on the host's time base.
"""

from __future__ import annotations

import bisect
import glob
import itertools
import os

PHASES = ("prepare", "prefill_call", "decode_call", "copy_async", "wait", "accept", "accept_first")
GAP_BUCKETS_MS = (0.1, 1.0, 5.0)  # idle gaps under 0.1 ms, 0.1-1 ms, 1-5 ms, over 5 ms


def _module(event) -> str:
    """The XLA program a device event belongs to (its ``hlo_module`` stat), or "?"."""
    try:
        stats = dict(event.stats)
    except Exception:  # noqa: BLE001 - older ProfileData without stats
        return "?"
    return str(stats.get("hlo_module") or stats.get("hlo_module_name") or "?")


def load(trace_dir: str, by_program: dict | None = None
         ) -> tuple[list[tuple[int, int]], int, dict[str, list[tuple[int, int]]]]:
    """(device kernel intervals, memcpy ns, {annotation: host intervals}) of the newest trace.

    ``by_program``, when given, is filled with {program: {"ns": kernel ns, "kernels": {kernel name:
    [count, ns]}}}: where the device's busy time went, per jitted program and kernel."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    kernels, memcpy_ns, host = [], 0, {}
    if not paths:
        return kernels, memcpy_ns, host
    for plane in ProfileData.from_file(paths[-1]).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if not line.name.lower().startswith("stream"):
                    continue
                for event in line.events:
                    if "memcpy" in event.name.lower() or "memset" in event.name.lower():
                        memcpy_ns += event.duration_ns
                    else:
                        kernels.append((int(event.start_ns), int(event.end_ns)))
                        if by_program is not None:
                            program = by_program.setdefault(_module(event), {"ns": 0, "kernels": {}})
                            program["ns"] += event.duration_ns
                            kernel = program["kernels"].setdefault(event.name, [0, 0])
                            kernel[0] += 1
                            kernel[1] += event.duration_ns
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for event in line.events:
                    if event.name.startswith(("rollout/", "engine/")):
                        name = event.name.removeprefix("rollout/")
                        host.setdefault(name, []).append((int(event.start_ns), int(event.end_ns)))
    return sorted(kernels), memcpy_ns, host


def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of sorted intervals, as disjoint sorted intervals."""
    out: list[list[int]] = []
    for start, end in intervals:
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def overlap(intervals: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> int:
    """ns of [lo, hi) covered by disjoint sorted ``intervals`` (``starts``: their start times)."""
    total = 0
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    while i < len(intervals) and intervals[i][0] < hi:
        s, e = intervals[i]
        total += max(0, min(e, hi) - max(s, lo))
        i += 1
    return total


def summarize(kernels, memcpy_ns: int, host: dict, top: int = 8) -> dict:
    """Busy share, idle gaps by size, and the host phases the idle time fell in (ms)."""
    if not kernels:
        return {"timeline": "no device kernels in the trace (CPU, or the trace failed)"}
    busy = merge(kernels)
    span = busy[-1][1] - busy[0][0]
    busy_ns = sum(e - s for s, e in busy)
    gaps = [(busy[i][1], busy[i + 1][0]) for i in range(len(busy) - 1)]
    phases = {name: merge(sorted(host.get(name, []))) for name in (*PHASES, "tick")}
    starts = {name: [s for s, _ in iv] for name, iv in phases.items()}
    where = dict.fromkeys((*PHASES, "tick_other", "outside_ticks"), 0)
    buckets = [[0, 0] for _ in range(len(GAP_BUCKETS_MS) + 1)]
    largest = []
    for lo, hi in gaps:
        ms = (hi - lo) / 1e6
        b = bisect.bisect_right(GAP_BUCKETS_MS, ms)
        buckets[b][0] += 1
        buckets[b][1] += hi - lo
        inside = {name: overlap(phases[name], starts[name], lo, hi) for name in (*PHASES, "tick")}
        for name in PHASES:
            where[name] += inside[name]
        where["tick_other"] += max(inside["tick"] - sum(inside[n] for n in PHASES), 0)
        where["outside_ticks"] += (hi - lo) - inside["tick"]
        largest.append((hi - lo, {k: round(v / 1e6, 2) for k, v in inside.items() if v}))
    largest.sort(key=lambda g: -g[0])
    labels = [f"<{GAP_BUCKETS_MS[0]}ms"] + [f"{a}-{b}ms" for a, b in itertools.pairwise(GAP_BUCKETS_MS)]
    labels.append(f">{GAP_BUCKETS_MS[-1]}ms")
    return {
        "span_ms": round(span / 1e6, 1), "device_busy_ms": round(busy_ns / 1e6, 1),
        "device_busy_share": round(busy_ns / max(span, 1), 3), "memcpy_ms": round(memcpy_ns / 1e6, 1),
        "idle_ms": round((span - busy_ns) / 1e6, 1),
        "idle_gaps": {label: {"count": c, "ms": round(ns / 1e6, 1)} for label, (c, ns) in zip(labels, buckets)},
        "idle_ms_by_host_phase": {k: round(v / 1e6, 1) for k, v in where.items()},
        "host_phase_ms": {name: round(sum(e - s for s, e in merge(sorted(iv))) / 1e6, 1) for name, iv in host.items()},
        "engine_idle_ms": {name: round(sum(overlap(merge(sorted(iv)), [s for s, _ in merge(sorted(iv))], lo, hi)
                                           for lo, hi in gaps) / 1e6, 1)
                           for name, iv in host.items() if name.startswith("engine/")},
        "largest_gaps": [{"ms": round(ns / 1e6, 2), "host_ms": inside} for ns, inside in largest[:top]],
    }


def programs(by_program: dict, top: int = 12) -> dict:
    """`load`'s per-program kernel time as ms, largest first, each with its ``top`` kernels."""
    out = {}
    for name, p in sorted(by_program.items(), key=lambda kv: -kv[1]["ns"]):
        kernels = sorted(p["kernels"].items(), key=lambda kv: -kv[1][1])[:top]
        out[name] = {"ms": round(p["ns"] / 1e6, 1),
                     "kernels": {k[:80]: {"count": c, "ms": round(ns / 1e6, 2)} for k, (c, ns) in kernels}}
    return out
