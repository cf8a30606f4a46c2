"""bench/multigpu_window.py and bench/multigpu_tables.py without a device: a window whose
deadline leaves no room runs nothing and still writes its tar with the command for what is
left; the tables read the rows, reports and logs a window leaves."""

from __future__ import annotations

import json
import tarfile

import pytest
from repo_scripts import load_script


@pytest.fixture(scope="module")
def window():
    return load_script("bench/multigpu_window.py")


@pytest.fixture(scope="module")
def tables():
    return load_script("bench/multigpu_tables.py")


def test_a_stage_that_does_not_fit_is_not_started_and_the_tar_says_what_is_left(window, tmp_path, capsys):
    out = tmp_path / "w.tar.gz"
    window.main(["--deadline", "100", "--out", str(out), "--work", str(tmp_path / "work"),
                 "--parts", "procs4,async2+async4"])
    printed = capsys.readouterr().out
    assert "procs4: skipped (needs 300 s" in printed
    assert "async2+async4: skipped (needs 570 s" in printed  # (2 + 4 GPUs side by side do not fit 4 either)
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        summary = json.load(tar.extractfile("multigpu_window/summary.json"))
    assert {"multigpu_window/env.json", "multigpu_window/tables.md"} <= names
    run = summary["runs"][-1]
    assert [(p["name"], p["status"]) for p in run["parts"]] == [("procs4", "not run"), ("async2", "not run"),
                                                                ("async4", "not run")]
    assert run["rerun"].endswith("--parts procs4,async2+async4")


def test_unknown_parts_are_one_error_line(window, tmp_path, capsys):
    with pytest.raises(SystemExit):
        window.main(["--deadline", "100", "--out", str(tmp_path / "w.tar.gz"), "--parts", "train,procs3"])
    assert "--parts: unknown ['procs3']" in capsys.readouterr().err


def _row(size, gpus, step_s, **extra):
    rows = 2 * gpus if size == "1.7b" else gpus
    return {"size": size, "layout": "fsdp", "gpus": gpus, "rows": rows, "seq": 4096, "step_s": step_s,
            "tokens_per_s": rows * 4096 / step_s, "tokens_per_s_per_gpu": rows * 4096 / step_s / gpus, "mfu": 0.3,
            "peak_gib_max": 30.0, "remat": "full", **extra}


def test_the_tables_of_a_window(tables, tmp_path):
    folder = tmp_path / "multigpu_window"
    (folder / "logs").mkdir(parents=True)
    (folder / "env.json").write_text(json.dumps({"device": "4 x NVIDIA H100 80GB HBM3", "jax": "0.11.2",
                                                 "commit": "0123456789", "dirty": False, "date": "2026-11-28 05:00 UTC",
                                                 "command": "python bench/multigpu_window.py --deadline 570"}))
    (folder / "train_1.7b_1gpu_cudnn.jsonl").write_text(json.dumps(_row("1.7b", 1, 0.25)) + "\n")
    (folder / "train_1.7b_2gpu_cudnn.jsonl").write_text(json.dumps(_row("1.7b", 2, 0.3125)) + "\n")
    (folder / "train_1.7b_4gpu_cudnn.jsonl").write_text(json.dumps(
        {"size": "1.7b", "layout": "fsdp", "gpus": 4, "error": "rc=1: XlaRuntimeError: INTERNAL: cuDNN",
         "log": "/tmp/x/window/logs/train_workers/1.7b_fsdp_4gpu_cudnn.log"}) + "\n")
    report = {"processes": 2, "devices": 2, "platform": "cuda", "seconds": {"many": 70.0, "one": 60.0},
              "steps": [{"step": 1, "loss": [0.5, 0.5], "train_tokens": [9, 9], "same_trajectories": True},
                        {"step": 2, "loss": [0.4, 0.41], "train_tokens": [9, 8], "same_trajectories": False}],
              "hosts_log_the_same": True, "hosts_hold_the_same_weights": True,
              "state_after_step_1": {"max_abs": 0.0, "at": "['step']", "bitwise": True},
              "state_after_step_2": {"max_abs": 3e-4, "at": "['params']['embed']", "bitwise": False},
              "state_after_step_3_resumed": {"max_abs": 4e-4, "at": "['params']['wo']", "bitwise": False}}
    (folder / "logs" / "procs2.log").write_text(f"MULTIHOST_REPORT {json.dumps(report)}\n"
                                                "1 passed, 3 deselected in 250.10s (0:04:10)\n")
    (folder / "logs" / "async2.log").write_text(
        "device: 2 x NVIDIA H100 80GB HBM3  shape: 1.7b\n| mode | s/step | traj/s |\n|---|---|---|\n"
        "| sync | 13.90 | 4.60 |\n| async | 10.31 | 6.21 |\nasync / sync speed-up (s/step): 1.35x\n")
    (folder / "summary.json").write_text(json.dumps({"runs": [{
        "command": "python bench/multigpu_window.py --deadline 570", "date": "2026-11-28 05:00 UTC", "seconds": 560,
        "rerun": "python bench/multigpu_window.py --parts procs4",
        "parts": [{"name": "procs2", "status": "ok", "seconds": 250, "estimate_s": 270,
                   "procs": [{"log": "logs/procs2.log", "rc": 0}]},
                  {"name": "procs4", "status": "not run", "why": "needs 300 s, 20 s left", "estimate_s": 300}]}]}))
    text = tables.render(str(folder))
    assert "4 x NVIDIA H100 80GB HBM3, jax 0.11.2, commit 0123456, 2026-11-28 05:00 UTC" in text
    # 2 GPUs at 0.3125 s per 2 x 2 rows against 1 GPU at 0.25 s per 2 rows: 80% per GPU
    assert "| 1.7b | fsdp, remat full | 2 | 4x4096 | 312 ms | 52,429 | 26,214 | 30.0% | 80.0% | 30.0 |" in text
    assert "1.7b on 4 GPUs failed: `rc=1: XlaRuntimeError: INTERNAL: cuDNN` (whole output: " \
           "`logs/train_workers/1.7b_fsdp_4gpu_cudnn.log`)" in text
    assert ("| 2 | 1 passed, 3 deselected | yes | yes | 1: yes (0.5 / 0.5); 2: no (0.4 / 0.41) | bitwise equal "
            "| 3.00e-04 (at `['params']['embed']`) | 4.00e-04 (at `['params']['wo']`) | 70, 60 |") in text
    assert "| async2 | sync | 13.90 | 4.60 |" in text and "async / sync speed-up (s/step): 1.35x" in text
    assert "| 1 | procs4 | not run | - | 300 | needs 300 s, 20 s left |" in text
    assert "Not run: `python bench/multigpu_window.py --parts procs4`" in text


def test_the_scaling_bench_measures_the_tiny_update_on_the_fake_devices():
    # the window's first part: an import or signature it lost since its last GPU run fails here
    row = load_script("bench/train_scaling.py").measure("tiny", "fsdp", 64, 64, 1, "full", "xla", 64, "compute")
    assert row["gpus"] == 8 and row["rows"] == 8 and row["mesh"]["fsdp"] == 8
    assert row["step_s"] > 0 and row["tokens_per_s_per_gpu"] > 0 and row["loss"] == row["loss"]


def test_a_process_running_at_the_deadline_is_killed_with_what_it_started(window, tmp_path):
    import argparse
    import os
    import time

    w = window.Window(argparse.Namespace(deadline=window.RESERVE_S + 2, dry_run=True), str(tmp_path), str(tmp_path),
                      time.monotonic())
    os.makedirs(tmp_path / "logs")
    marker = tmp_path / "child.pid"
    started = time.monotonic()
    result = window.run_proc(w, (["bash", "-c", f"sleep 60 & echo $! > {marker}; wait"], [], "slow.log"))
    assert result["rc"] == "deadline" and time.monotonic() - started < 20
    child = int(marker.read_text())
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"


def test_the_profile_part_needs_four_gpus_and_its_estimate(window, tmp_path, capsys):
    window.main(["--deadline", "100", "--out", str(tmp_path / "w.tar.gz"), "--work", str(tmp_path / "work"),
                 "--parts", "prof4"])
    assert "prof4: skipped (needs 200 s" in capsys.readouterr().out
    assert window.gpus_of("prof4") == 4


@pytest.mark.slow  # two tiny workers and a summary: ~20 s on 2 shared cores
def test_the_profile_part_dry_run_packs_the_summary_and_the_traces(window, tmp_path, capsys):
    out = tmp_path / "w.tar.gz"
    window.main(["--dry-run", "--deadline", "300", "--out", str(out), "--work", str(tmp_path / "work"),
                 "--parts", "prof4"])
    assert "prof4: ok" in capsys.readouterr().out
    with tarfile.open(out) as tar:
        names = tar.getnames()
        tables_md = tar.extractfile("multigpu_window/tables.md").read().decode()
    assert "multigpu_window/prof4_summary.json" in names
    assert sum(n.endswith("perfetto_trace.json.gz") for n in names) == 2  # 1 and 4 fake devices
    assert "| tiny_fsdp_4gpu | CPU:3 | 1 |" in tables_md and "| tiny | fsdp, remat" in tables_md


def test_the_tables_show_the_profile(tables, tmp_path):
    folder = tmp_path / "multigpu_window"
    (folder / "logs").mkdir(parents=True)
    (folder / "prof4_rows.jsonl").write_text(json.dumps(_row("1.7b", 1, 0.25)) + "\n" +
                                             json.dumps(_row("1.7b", 4, 0.3125)) + "\n")
    (folder / "logs" / "prof4_summary.log").write_text("$ python bench/trace_summary.py /tmp/x\n| trace | device |\n")
    text = "\n".join(tables.profile_section(str(folder)))
    assert "| 1.7b | fsdp, remat full | 4 | 8x4096 | 312 ms |" in text and "80.0%" in text
    assert "| trace | device |" in text and "$ python" not in text
    assert tables.profile_section(str(tmp_path)) == ["(not profiled)"]
