"""The real entry point, end to end, on the 8 fake CPU devices.

`launch/tpu_pod.py --config configs/demo.py` (the README's main command) with a tiny model:
scratch tokenizer and model, SFT, 2 RL steps through the real engine, driver, sandbox pool
and arithmetic environment on a (data=2, fsdp=2, tensor=2) mesh; then resume.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.head_dim=16",
    "model.scratch.vocab_size=320",
    "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
    "rollout.max_concurrent=8", "rollout.max_new_tokens_per_turn=12", "rollout.max_sequence_length=96",
    "data.prompts_per_step=2", "algorithm.group_size=4", "algorithm.entropy_coef=0.01",
    "environment.num_train_tasks=64", "environment.num_eval_tasks=4",
    "eval.num_tasks=4", "eval.samples_per_task=2",
    "sft.steps=3", "sft.batch_size=8",
]


# A KL to the reference and a hybrid teacher: both frozen copies of the post-SFT policy.
FROZEN_MODELS = ["algorithm.kl_coef=0.05", "hybrid.mode=hybrid", "hybrid.judge=oracle", "hybrid.teacher_dtype=float32"]


def _launch(out_dir, *extra, check=True):
    env = dict(os.environ)  # carries the 8-fake-device XLA_FLAGS from conftest
    cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py",
           "--set", f"output_dir={out_dir}"]
    for item in TINY + list(extra):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def assert_counts_of_samples(pass_at_1: float, num_samples: int) -> None:
    """Unbiased pass@1 is (correct samples) / (tasks x samples): a multiple of 1 / num_samples."""
    correct = pass_at_1 * num_samples
    assert 0 <= pass_at_1 <= 1 and abs(correct - round(correct)) < 1e-6, (pass_at_1, num_samples)


def _metrics(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "run"
    # rollout.warmup=on: CPU's "auto" skips the warm-up; here it is checked on the sharded engine.
    # rollout.decode_batch=4: half the 8 slots decode per step (decode lanes); the resume test below
    # continues without lanes and compares with a run that never had them, so the two steps here must
    # roll out exactly what a lane per slot rolls out
    proc = _launch(out, "total_steps=2", "checkpoint.resume=false", "rollout.warmup=on", "rollout.decode_batch=4",
                   *FROZEN_MODELS)
    return out, proc


def test_demo_command_trains_two_steps_on_a_2x2x2_mesh(two_step_run):
    out, proc = two_step_run
    assert "held-out evaluation" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    for stage in ("start", "end"):
        assert results[stage]["num_tasks"] == 4
        assert_counts_of_samples(results[stage]["pass_at_1"], 4 * 2)
    steps = _metrics(out)
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert math.isfinite(m["loss"]) and m["skipped"] == 0
        assert m["update_norm"] > 0  # params changed (the entropy term always has a gradient)
        assert m["logprob_gap_train_infer"] < 1e-4  # engine and trainer logprobs agree
        assert m["rollout/sampled_tokens"] > 0
        # no rollout (start evaluation, steps) compiled a program the warm-up did not
        assert m["rollout/engine/compiled_programs"] == results["rollout_warmup"]["programs"]
    assert results["rollout_warmup"]["prefill_shapes"] >= 1
    from agentrl_jax.train.metrics import read_tensorboard

    tb = read_tensorboard(out / "metrics")
    assert "reward/mean" in tb and len(tb["reward/mean"]) == 2
    rows = [json.loads(line) for line in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    data = next(r for r in rows if "data/train/rows_kept" in r)  # the task counts, written at step 0
    assert data["step"] == 0 and data["data/train/rows_kept"] >= 64 and data["data/train/rows_skipped"] == 0
    assert data["data/eval/rows_kept"] >= 4 and tb["data/train/rows_kept"] == [(0, data["data/train/rows_kept"])]
    texts = {json.loads(line)["tag"] for line in (out / "metrics" / "samples.jsonl").read_text().splitlines()}
    assert {k for r in rows for k in r} - {"step", "time"} == set(tb) - texts
    assert "eval/pass_at_1" in tb  # one legal name in every output, not tensorboardX's rename of "pass@1"
    assert (out / "init" / "model" / "config.json").exists()
    assert (out / "checkpoints").is_dir()


def test_bad_override_fails_with_the_field_name(tmp_path):
    proc = _launch(tmp_path / "bad", "algorithm.aggregation=mean", check=False)
    assert proc.returncode == 2
    assert "algorithm.aggregation: got 'mean'; allowed values are" in proc.stderr


def test_resume_continues_exactly_like_an_uninterrupted_run(two_step_run, tmp_path):
    """Continue the finished 2-step run to step 4; compare with 4 steps in one go.

    With a checkpoint every 2 steps the last step is also a periodic one (a crash at the
    final save on old main); the resumed run keeps the start evaluation, and its reference
    and teacher are the post-SFT policy, not the restored step-2 policy.
    """
    out, _ = two_step_run
    first = json.loads((out / "results.json").read_text())
    _launch(out, "total_steps=4", "checkpoint.resume=true", "checkpoint.every_steps=2", *FROZEN_MODELS)
    resumed = _metrics(out)
    assert sorted(resumed) == [1, 2, 3, 4]
    assert json.loads((out / "results.json").read_text())["start"] == first["start"]
    straight_dir = tmp_path / "straight"
    _launch(straight_dir, "total_steps=4", "checkpoint.resume=false", "checkpoint.every_steps=2", *FROZEN_MODELS)
    straight = _metrics(straight_dir)
    for step in (3, 4):
        assert resumed[step]["kl_k3"] > 0 and resumed[step]["opd/teacher_fraction"] > 0
        for key in ("reward/mean", "rollout/sampled_tokens", "loss", "grad_norm", "entropy", "param_norm", "kl_k3",
                    "opd/kl_student_teacher", "opd/advantage_mean"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.slow
def test_resume_keeps_the_lagged_teachers_ema(tmp_path):
    """hybrid.teacher=lagged with an EMA: the teacher after 2 steps is a mix of three policies,
    not the step-2 policy the resumed run starts at; resumed from the checkpoint it must teach
    exactly as in an uninterrupted run (on old main it restarted at the resumed policy)."""
    lagged = [*FROZEN_MODELS, "hybrid.teacher=lagged", "hybrid.teacher_ema_decay=0.5", "hybrid.lam=0.3"]
    out = tmp_path / "run"
    _launch(out, "total_steps=2", "checkpoint.resume=false", *lagged)
    _launch(out, "total_steps=4", "checkpoint.resume=true", "checkpoint.every_steps=2", *lagged)
    straight_dir = tmp_path / "straight"
    _launch(straight_dir, "total_steps=4", "checkpoint.resume=false", "checkpoint.every_steps=2", *lagged)
    resumed, straight = _metrics(out), _metrics(straight_dir)
    for step in (3, 4):
        assert resumed[step]["opd/teacher_fraction"] > 0
        for key in ("opd/kl_student_teacher", "opd/advantage_mean", "opd/min_token", "loss", "param_norm"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-4, abs=1e-6), (step, key)


# ------------------------------------------------------------------ kill -9, then the same command
#
# A run killed with SIGKILL at any point, then started again with the same command, ends with
# the same outputs as a run never interrupted (docs/running.md, "Checkpoints and restarts"). A
# tiny model, a checkpoint every step, a non-zero KL to the reference and the hybrid teacher
# (the frozen post-SFT policy), so the frozen models of the resumed run are compared too. The run is deterministic on one
# machine: rollout, judge and evaluation seeds come from (seed, step), the data position and
# params are restored. Keys that measure wall time (`time`, `time/*`, `throughput/*`,
# `*_seconds`) are excluded from the comparison; everything else must be equal.

LIFECYCLE = TINY + FROZEN_MODELS + ["total_steps=4", "checkpoint.every_steps=2", "checkpoint.resume=true",
                                    "checkpoint.max_to_keep=2", "checkpoint.export_hf=true"]
WALL_TIME = ("time/", "throughput/")


def command(out_dir):
    cmd = [sys.executable, str(ROOT / "launch" / "tpu_pod.py"), "--config", "configs/demo.py",
           "--set", f"output_dir={out_dir}"]
    for item in LIFECYCLE:
        cmd += ["--set", item]
    return cmd


def run_to_end(out_dir):
    proc = subprocess.run(command(out_dir), cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_and_kill(out_dir, ready, sig=signal.SIGKILL):
    """Starts the command and sends it ``sig`` once ``ready(out_dir)`` holds; returns its exit code."""
    proc = subprocess.Popen(command(out_dir), cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while not ready(out_dir):
            assert proc.poll() is None, "the run ended before the kill point"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(sig)
        return proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()


def logged_steps(out_dir):
    """Steps of the complete rows of metrics.jsonl so far."""
    path = out_dir / "metrics" / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def without_wall_time(row):
    return {k: v for k, v in row.items() if k != "time" and not k.startswith(WALL_TIME)}


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def file_names(root):
    """Relative paths of the outputs, where they are stable: an event file's name holds the time,
    and orbax names its array chunks at random (under ``d/`` and ``ocdbt.process_*``)."""
    names = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if "events.out.tfevents" in rel:
            rel = rel.split("events.out.tfevents")[0] + "<events>"
        for chunks in ("/ocdbt.process_", "/d/"):
            if chunks in rel:
                rel = rel.split(chunks)[0] + "/<chunks>"
        names.add(rel)
    return names


def assert_same_outputs(resumed, straight, checkpoints=("2", "4")):
    """Same files and contents (wall times aside); the resumed run keeps ``checkpoints``."""
    from agentrl_jax.train.metrics import read_tensorboard

    both = set(checkpoints) & {"2", "4"}

    def stable(names):  # a preempted run keeps another checkpoint step: compare the steps both keep
        return {n for n in names if not n.startswith("checkpoints/") or n.split("/")[1] in both} - {
            "metrics/<events>"}

    assert stable(file_names(resumed)) == stable(file_names(straight))
    assert sorted(os.listdir(straight / "checkpoints")) == ["2", "4"]
    assert sorted(os.listdir(resumed / "checkpoints")) == list(checkpoints)
    for logdir in ("metrics", "sft_metrics"):
        got, want = jsonl(resumed / logdir / "metrics.jsonl"), jsonl(straight / logdir / "metrics.jsonl")
        assert [r["step"] for r in got] == [r["step"] for r in want]  # one row per step, nothing twice
        assert [without_wall_time(r) for r in got] == [without_wall_time(r) for r in want]
        assert jsonl(resumed / logdir / "samples.jsonl") == jsonl(straight / logdir / "samples.jsonl")
        got_tb, want_tb = read_tensorboard(resumed / logdir), read_tensorboard(straight / logdir)
        assert {k: v for k, v in got_tb.items() if not k.startswith(WALL_TIME)} == {
            k: v for k, v in want_tb.items() if not k.startswith(WALL_TIME)}
    steps = [r for r in jsonl(straight / "metrics" / "metrics.jsonl") if "loss" in r]
    assert all(r["kl_k3"] > 0 and r["opd/teacher_fraction"] > 0 for r in steps)  # the frozen models are in use
    got, want = (json.loads((d / "results.json").read_text()) for d in (resumed, straight))
    assert {k: v for k, v in got.items() if not k.endswith("_seconds")} == {
        k: v for k, v in want.items() if not k.endswith("_seconds")}
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (resumed / "export" / name).read_bytes() == (straight / "export" / name).read_bytes()


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    run_to_end(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_point", ["step_3_logged", "during_sft"])
def test_kill_9_then_the_same_command_ends_like_an_uninterrupted_run(straight_run, tmp_path, kill_point):
    """SIGKILL once step 3 is logged after the checkpoint of step 2 (its row must go), or during SFT
    (no checkpoint yet: the run starts over). About 3 + 4 minutes on 2 busy cores."""
    ready = {"step_3_logged": lambda out: (out / "checkpoints" / "2").is_dir() and 3 in logged_steps(out),
             "during_sft": lambda out: (out / "sft_metrics" / "metrics.jsonl").exists()}[kill_point]
    out = tmp_path / "run"
    assert run_and_kill(out, ready) == -signal.SIGKILL
    if kill_point == "step_3_logged":
        assert sorted(os.listdir(out / "checkpoints")) == ["2"] and not (out / "results.json").exists()
    run_to_end(out)
    assert_same_outputs(out, straight_run)


@pytest.mark.slow
def test_sigterm_saves_stops_and_the_same_command_ends_like_an_uninterrupted_run(straight_run, tmp_path):
    """A preemption during step 3: the run saves step 3 and exits 0 without a final evaluation
    (old main went on to evaluate and save the unfinished policy as the last step)."""
    out = tmp_path / "run"
    code = run_and_kill(out, lambda o: (o / "checkpoints" / "2").is_dir() and 2 in logged_steps(o), signal.SIGTERM)
    assert code == 0
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"] and not (out / "results.json").exists()
    assert max(logged_steps(out)) == 3
    run_to_end(out)
    assert_same_outputs(out, straight_run, checkpoints=("3", "4"))
