"""`bench/multi_policy_speed.py`'s summary on metrics written here: trajectories/s and s/step over
the steps after the warm-up but the last, from the rows the multi-policy run writes."""

from __future__ import annotations

import json

import pytest
from repo_scripts import load_script


def test_the_summary_times_the_steps_after_the_warmup_but_the_last(tmp_path):
    bench = load_script("bench/multi_policy_speed.py")
    (tmp_path / "metrics").mkdir()
    # (time/step, trajectories/s): 8 episodes a step; the last step (nothing to overlap) is not timed
    steps = [(10.0, 0.8), (2.0, 4.0), (4.0, 2.0), (0.5, 16.0)]
    rows = [{"step": 0, "eval/team/final_correct": 0.0}]
    rows += [{"step": i, "time/step": t, "throughput/trajectories_per_s": r, "time/rollout": t / 2,
              "solver/time/update": t / 4, "checker/time/update": t / 8} for i, (t, r) in enumerate(steps, 1)]
    (tmp_path / "metrics" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "results.json").write_text(json.dumps({"rl_seconds": 17.0, "schedule": "concurrent"}))
    (tmp_path / "device.txt").write_text("2 x NVIDIA H200")
    summary = bench.summarize(tmp_path, warmup=1)
    assert summary["steps_timed"] == 2 and summary["seconds_per_step"] == pytest.approx(3.0)
    assert summary["trajectories_per_s"] == pytest.approx(16 / 6)
    assert summary["median_seconds_per_step"] == 3.0 and summary["step_seconds"] == [2.0, 4.0]
    assert (summary["rl_seconds"], summary["schedule"]) == (17.0, "concurrent")
    # the medians of the timed steps' rollout and of their longer update
    assert (summary["median_rollout_seconds"], summary["median_update_seconds"]) == (1.5, 0.75)
    assert summary["device"] == "2 x NVIDIA H200"


def test_too_few_steps_to_time_is_one_error_line(tmp_path, capsys):
    bench = load_script("bench/multi_policy_speed.py")
    with pytest.raises(SystemExit):
        bench.main(["--steps", "3", "--warmup", "2", "--out", str(tmp_path)])
    assert "--steps (3) must be >= --warmup (2) + 2" in capsys.readouterr().err
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step": 1.0}))
    with pytest.raises(SystemExit, match="none to time after the 1 of the warm-up but the last"):
        bench.summarize(tmp_path, warmup=1)
