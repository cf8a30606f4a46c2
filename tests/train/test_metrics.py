"""MetricsWriter: tensorboard events, JSONL, console ETA, non-finite handling; StepTimer."""

import io
import json
import math
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

from agentrl_jax.train.metrics import MetricsWriter, StepTimer, format_duration, read_tensorboard, to_number


def test_scalars_histograms_text_round_trip(tmp_path):
    console = io.StringIO()
    with MetricsWriter(tmp_path, enabled=True, total_steps=10, console=console) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": jnp.float32(0.5 / step), "reward/mean": np.float64(step / 10),
                                "tokens": np.int64(100 * step), "done": True, "lr": jnp.array([1e-6])})
        writer.write_histograms(3, {"advantages": np.array([-1.0, 0.0, 0.5, 2.0])})
        writer.write_text(3, {"samples/trajectory_0": "<code>print(1_000)</code>\n\\boxed{1}"})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["loss"] == pytest.approx(0.25) and rows[2]["reward/mean"] == pytest.approx(0.3)
    assert rows[2]["tokens"] == 300 and isinstance(rows[2]["tokens"], int) and rows[0]["done"] == 1
    assert rows[0]["lr"] == pytest.approx(1e-6)

    events = read_tensorboard(tmp_path)
    assert [s for s, _ in events["loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in events["loss"]], [0.5, 0.25, 0.5 / 3], rtol=1e-6)
    assert events["tokens"][-1] == (3, 300.0)
    (step, histo), = events["advantages"]
    assert step == 3 and histo["num"] == 4 and histo["min"] == -1.0 and histo["max"] == 2.0
    assert histo["sum"] == pytest.approx(1.5) and sum(histo["bucket"]) == 4
    assert events["samples/trajectory_0"] == [(3, "<code>print(1_000)</code>\n\\boxed{1}")]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 3, "tag": "samples/trajectory_0", "text": "<code>print(1_000)</code>\n\\boxed{1}"}]

    lines = console.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("step 1/10 (10%) | - s/step | eta ?")
    assert "| loss 0.1667 | reward/mean 0.3" in lines[2] and "s/step | eta " in lines[2]


def test_nonfinite_values_are_null_in_json_and_counted(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, console_every=0) as writer:
        writer.write(1, {"loss": float("nan"), "grad_norm": jnp.float32(jnp.inf), "ok": 1.0})
        writer.write_histograms(1, {"logprobs": np.array([np.nan, -1.0, -2.0, -np.inf])})
        assert writer.nonfinite_count == 3
        assert writer.nonfinite_by_key == {"loss": 1, "grad_norm": 1, "logprobs": 1}
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["loss"] is None and row["grad_norm"] is None and row["ok"] == 1.0
    events = read_tensorboard(tmp_path)
    assert math.isnan(events["loss"][0][1]) and math.isinf(events["grad_norm"][0][1])
    assert events["logprobs"][0][1]["num"] == 2


def test_disabled_writer_writes_nothing(tmp_path):
    console = io.StringIO()
    writer = MetricsWriter(tmp_path / "off", enabled=False, console=console)
    writer.write(1, {"loss": 1.0})
    writer.write_histograms(1, {"x": np.ones(3)})
    writer.write_text(1, {"t": "x"})
    writer.close()
    assert not os.path.exists(tmp_path / "off") and console.getvalue() == ""


def test_bad_metric_values_name_the_key(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, console_every=0) as writer:
        with pytest.raises(ValueError, match="'per_token' must be a scalar"):
            writer.write(1, {"per_token": np.ones(3)})
        with pytest.raises(TypeError, match="'name' must be a number"):
            writer.write(1, {"name": "x"})
    assert to_number(jnp.bfloat16(1.5), "x") == 1.5


def test_eta_from_recent_step_times(tmp_path):
    console = io.StringIO()
    with MetricsWriter(tmp_path, enabled=True, total_steps=100, console=console) as writer:
        writer.write(10, {"loss": 1.0})
        time.sleep(0.2)
        writer.write(20, {"loss": 1.0})
        per_step = writer.seconds_per_step()
    assert 0.02 <= per_step < 0.1
    eta_text = console.getvalue().splitlines()[-1].split("eta ")[1].split(" |")[0]
    h, m, s = map(int, eta_text.split(":"))
    assert abs(h * 3600 + m * 60 + s - 80 * per_step) <= 1
    assert format_duration(3725) == "1:02:05" and format_duration(float("nan")) == "?"


def test_step_timer_accumulates_and_resets():
    timer = StepTimer()
    with timer("rollout"):
        time.sleep(0.05)
        with timer("tools"):
            time.sleep(0.03)
    with timer("tools"):
        time.sleep(0.02)
    metrics = timer.as_metrics(prefix="time/")
    assert set(metrics) == {"time/rollout", "time/tools"}
    assert 0.08 <= metrics["time/rollout"] < 0.5 and 0.05 <= metrics["time/tools"] < 0.5
    assert timer.as_metrics() == {}
    with pytest.raises(RuntimeError):
        with timer("update"):
            raise RuntimeError("boom")
    assert "time/update" in timer.as_metrics(reset=False)


def test_names_are_legal_tags_and_the_same_in_jsonl_tensorboard_and_samples(tmp_path):
    """tensorboardX renames "eval/pass@1" on its own; the writer must give every output one legal name."""
    from tensorboardX.summary import _clean_tag

    from agentrl_jax.train.evaluation import summarize
    from agentrl_jax.train.metrics import metric_name

    evaluation = summarize({"t": [{"correct": True}, {"correct": False}]}, ks=(1, 2))
    with MetricsWriter(tmp_path, enabled=True, console_every=0) as writer:
        writer.write(1, {f"eval/{k}": v for k, v in evaluation.items()})
        writer.write(2, {"user/pass@1": 0.5, "/lead": 1.0, "reward/a b": 2.0})
        writer.write_text(2, {"sample 0": "x"})
        with pytest.raises(ValueError, match="'x@1' and 'x_1' both become 'x_1'"):
            writer.write(3, {"x@1": 1.0, "x_1": 2.0})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    jsonl_names = {k for r in rows for k in r} - {"step", "time"}
    events = read_tensorboard(tmp_path)
    assert jsonl_names | {"sample_0"} == set(events)
    assert all(_clean_tag(tag) == tag for tag in events)
    assert {"eval/pass_at_1", "eval/pass_at_2", "eval/avg_at_2", "user/pass_1", "lead", "reward/a_b"} <= jsonl_names
    assert json.loads((tmp_path / "samples.jsonl").read_text())["tag"] == "sample_0"
    assert metric_name("eval/pass_at_1") == "eval/pass_at_1"
    with pytest.raises(ValueError, match="empty once cleaned"):
        metric_name("/")


def _log(writer, steps, scale):
    for step in steps:
        writer.write(step, {"loss": scale * step})
        writer.write_text(step, {"sample": f"{scale} {step}"})


def test_resume_drops_the_steps_logged_after_the_checkpoint(tmp_path):
    """A run killed at step 5 resumes from its checkpoint of step 3: steps 4, 5 are logged once."""
    writer = MetricsWriter(tmp_path, enabled=True, console_every=0)
    _log(writer, range(0, 6), scale=1.0)
    writer.flush()  # what the killed process had on disk; it never closes
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a row cut short by the kill
    with MetricsWriter(tmp_path, enabled=True, console_every=0, purge_step=4) as resumed:
        _log(resumed, range(4, 8), scale=10.0)
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0),
                                                      (5, 50.0), (6, 60.0), (7, 70.0)]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["text"] for s in samples] == ["1.0 0", "1.0 1", "1.0 2", "1.0 3", "10.0 4", "10.0 5", "10.0 6",
                                            "10.0 7"]
    events = read_tensorboard(tmp_path)
    assert len(os.listdir(tmp_path)) == 4  # two event files (none replaced), metrics.jsonl, samples.jsonl
    assert events["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0)]
    assert [s for s, _ in events["sample"]] == list(range(8))

    with MetricsWriter(tmp_path, enabled=True, console_every=0, purge_step=0) as fresh:
        _log(fresh, [0], scale=2.0)
    assert read_tensorboard(tmp_path) == {"loss": [(0, 0.0)], "sample": [(0, "2.0 0")]}
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_record_cut_short_by_a_kill_ends_the_event_file(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, console_every=0) as writer:
        writer.write(1, {"loss": 1.0})
    (path,) = tmp_path.glob("events.out.tfevents.*")
    whole = read_tensorboard(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00partial")
    assert read_tensorboard(tmp_path) == whole == {"loss": [(1, 1.0)]}
