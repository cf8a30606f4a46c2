"""bench/trace_summary.py: the interval arithmetic against a brute-force count on a time grid,
a synthetic GPU trace against a hand computation, and a real trace of the tiny update on the
fake CPU devices (bench/train_scaling.py's --profile path)."""

from __future__ import annotations

import glob
import gzip
import json
import random

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def ts():
    return load_script("bench/trace_summary.py")


def test_union_merges_overlapping_nested_and_touching_intervals(ts):
    # [0,4] and [2,6] overlap, [7,8] sits inside [6.5,9], [9,10] touches it, [12,13] stands alone
    assert ts.union([(9, 10), (0, 4), (7, 8), (2, 6), (12, 13), (6.5, 9)]) == [(0, 6), (6.5, 10), (12, 13)]
    assert ts.length(ts.union([(0, 4), (2, 6), (1, 3)])) == 6


def test_subtract_and_covered_on_hand_cases(ts):
    compute = [(10, 50), (60, 70)]
    # a collective wholly under compute, one straddling a gap, one after everything
    assert ts.subtract([(20, 40)], compute) == []
    assert ts.subtract([(45, 65)], compute) == [(50, 60)]
    assert ts.subtract([(0, 100)], compute) == [(0, 10), (50, 60), (70, 100)]
    assert ts.covered((45, 65), compute, [10, 60]) == 10
    assert ts.covered((0, 5), compute, [10, 60]) == 0


def test_interval_arithmetic_against_a_grid_count(ts):
    rng = random.Random(0)
    for _ in range(200):
        def draw():
            out = []
            for _ in range(rng.randrange(0, 8)):
                s = rng.randrange(0, 40)
                out.append((s, s + rng.randrange(0, 12)))
            return out

        a, b = draw(), draw()
        in_a = {t for s, e in a for t in range(s, e)}  # unit cells [t, t+1) that a covers
        in_b = {t for s, e in b for t in range(s, e)}
        ua, ub = ts.union(a), ts.union(b)
        assert ts.length(ua) == len(in_a)
        assert ts.length(ts.subtract(ua, ub)) == len(in_a - in_b)
        for s, e in a:
            assert ts.covered((s, e), ub, [x for x, _ in ub]) == len(set(range(s, e)) & in_b)


@pytest.mark.parametrize("name, hlo_op, kind", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all-gather-start.3", "all-gather"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_bf16", "", "reduce-scatter"),
    ("ncclDevKernel_Generic", "all-reduce-start.12", "all-reduce"),
    ("ncclDevKernel_SendRecv", "", "other coll."),
    ("MemcpyP2P", "collective-permute-start.2", "other coll."),
    ("all-gather", "all-gather.78", "all-gather"),  # the CPU backend's thunks
    ("MemcpyD2D", "copy.3", "memcpy"),
    ("Memset (Device)", "", "memcpy"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "dot.4", "compute"),
    ("wrapped_reduce", "wrapped_reduce.2", "compute"),
    ("loop_all_reduce_like_fusion", "fusion.9", "compute"),
])
def test_classification_rules(ts, name, hlo_op, kind):
    assert ts.classify(name, hlo_op) == kind


def _gpu_trace() -> dict:
    """Two GPUs, two host steps of 100 us each; GPU 0 has two compute streams, a NCCL stream, and
    ``XLA Ops`` and ``Steps`` lines that re-state the time (and must be skipped)."""
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Kernel)"}},
        {"ph": "M", "pid": 1, "tid": 14, "name": "thread_name", "args": {"name": "Stream #14(Kernel)"}},
        {"ph": "M", "pid": 1, "tid": 20, "name": "thread_name", "args": {"name": "Stream #20(Kernel,Memcpy)"}},
        {"ph": "M", "pid": 1, "tid": 3735928559, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 1, "tid": 3735928560, "name": "thread_name", "args": {"name": "Steps"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1"}},
        {"ph": "M", "pid": 2, "tid": 13, "name": "thread_name", "args": {"name": "Stream #13(Kernel)"}},
        {"ph": "M", "pid": 701, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]

    def x(pid, tid, start, end, name, hlo_op=""):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": start, "dur": end - start, "name": name,
                "args": {"hlo_op": hlo_op} if hlo_op else {}}

    events = [
        x(701, 1, 0, 100, "train_step"), x(701, 1, 100, 200, "train_step"),
        x(1, 13, 10, 30, "loop_fusion", "fusion.1"), x(1, 13, 30, 50, "nvjet_gemm", "dot.2"),  # touching
        x(1, 14, 25, 35, "input_reduce_fusion", "fusion.3"),  # inside the two above, on another stream
        x(1, 13, 60, 70, "loop_fusion", "fusion.4"),
        x(1, 20, 20, 40, "ncclDevKernel_AllGather_RING_LL", "all-gather-start.1"),  # hidden by compute
        x(1, 20, 45, 65, "ncclDevKernel_ReduceScatter_Sum_bf16", "reduce-scatter.2"),  # 10 exposed
        x(1, 20, 80, 90, "ncclDevKernel_Generic", "all-reduce-start.3"),  # all exposed
        x(1, 20, 90, 95, "MemcpyD2D", "copy.5"),
        x(1, 13, 95, 105, "loop_fusion", "fusion.6"),  # crosses into step 1: cut at 100
        x(1, 3735928559, 0, 100, "fusion.1", "fusion.1"),
        x(1, 3735928560, 0, 100, "train_step"),  # a device's derived step line: not a second step 0
        x(1, 13, 120, 130, "loop_fusion", "fusion.1"),
        x(1, 20, 125, 140, "ncclDevKernel_AllGather_RING_LL", "all-gather-start.1"),
        x(2, 13, 0, 50, "loop_fusion", "fusion.1"),
    ]
    return {"displayTimeUnit": "ns", "traceEvents": meta + events}


def test_a_synthetic_gpu_trace_against_a_hand_computation(ts, tmp_path):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_gpu_trace(), f)
    s = ts.summarize(str(path))
    rows = {(r["device"], r["step"]): r for r in s["rows"]}
    assert len(s["rows"]) == 4  # 2 GPUs x 2 host steps
    # GPU 0, step 0: compute [10,50] + [60,70] + [95,100] = 55; collectives [20,40], [45,65],
    # [80,90]; exposed [50,60] + [80,90] = 20; busy [10,70] + [80,100] = 80; idle 20
    ms = 1e-3
    assert {k: v for k, v in rows[("GPU:0", 0)].items() if k not in ("device", "step")} == pytest.approx({
        "span": 100 * ms, "busy": 80 * ms, "compute": 55 * ms, "all-gather": 20 * ms, "reduce-scatter": 20 * ms,
        "all-reduce": 10 * ms, "other coll.": 0, "exposed": 20 * ms, "memcpy": 5 * ms, "idle": 20 * ms,
        "kernels": 9, "collective_kernels": 3})
    # step 1: compute [120,130], all-gather [125,140]: 10 of it exposed; busy 20
    r = rows[("GPU:0", 1)]
    assert (r["compute"], r["all-gather"], r["exposed"], r["busy"], r["idle"]) == pytest.approx(
        (10 * ms, 15 * ms, 10 * ms, 20 * ms, 80 * ms))
    assert rows[("GPU:1", 0)]["compute"] == pytest.approx(50 * ms) and rows[("GPU:1", 1)]["busy"] == 0
    assert any("GPU:0: 3 kernel line(s)" in n and "XLA Ops" in n for n in s["found"])
    # exposed per op, summed over the 4 device-steps and divided by them
    assert dict(s["top_exposed"]) == pytest.approx({"all-reduce-start.3": 10 * ms / 4,
                                                    "reduce-scatter.2": 10 * ms / 4,
                                                    "all-gather-start.1": 10 * ms / 4})
    text = ts.table([("synthetic", s)])
    assert "| synthetic | GPU:0 | 0 | 0.1 |" in text and "| synthetic | mean | - |" in text


def test_a_trace_without_a_device_timeline_is_one_error_line(ts, tmp_path, capsys):
    path = tmp_path / "host.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [{"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
                                   {"ph": "X", "pid": 7, "tid": 1, "ts": 0, "dur": 5, "name": "python"}]}, f)
    with pytest.raises(SystemExit, match=r"no device timeline.*processes: \['/host:CPU'\]"):
        ts.main([str(path)])
    with pytest.raises(SystemExit, match="no trace"):
        ts.main([str(tmp_path / "empty")])


def test_the_scaling_bench_profiles_the_tiny_update_and_the_summary_reads_it(ts, tmp_path, capsys):
    row = load_script("bench/train_scaling.py").measure("tiny", "fsdp", 64, 64, 1, "full", "xla", 64, "compute",
                                                        profile=str(tmp_path / "tiny_fsdp_8gpu"))
    assert row["profiled_steps"] == 2 and "profile_error" not in row
    assert glob.glob(str(tmp_path / "tiny_fsdp_8gpu" / "plugins" / "profile" / "*" / "perfetto_trace.json.gz"))
    ts.main([str(tmp_path), "--json", str(tmp_path / "s.json")])
    printed = capsys.readouterr().out
    assert "a CPU backend trace" in printed and "| tiny_fsdp_8gpu | CPU:7 | 1 |" in printed
    rows = json.loads((tmp_path / "s.json").read_text())["tiny_fsdp_8gpu"]["rows"]
    assert len(rows) == 16  # 8 devices x 2 steps
    for r in rows:  # FSDP on 8 devices gathers weights every step; the parts add up to the step
        assert r["all-gather"] > 0 and r["compute"] > 0
        assert r["busy"] + r["idle"] == pytest.approx(r["span"])
        assert r["compute"] + r["exposed"] <= r["busy"] + 1e-9
